"""Where a generated token's time goes (issue 46): one long request through ``generate`` and through
``fe.greedy_generate`` on a Llama-3.1-8B-shaped model (random bf16 weights, `fe.fuse_projections`), step by step,
against the strongest dense decode these machines give.

    source profiling/h200/setup.sh   # flash-attn-4 (decode kernel, FLASH prefill)
    python profiling/decode_timeline.py --out docs/results/decode_timeline/after.json

Parts (``--parts``):

* ``dense``: the strong dense baseline. The same fused model over a transformers ``StaticCache`` of ``n + new``
  entries; the prompt on cuDNN SDPA (TTFT: the forward and the first token); each decode step the eager HF forward
  captured whole in one CUDA graph (with the argmax and the position's advance), its attention cuDNN SDPA over the
  whole buffer with no mask (an ``AttentionInterface`` function, and no mask function); replayed in a plain loop.
  Per token: ``(t_new - t_1) / (new - 1)``, the loop timed without the prefill.
* ``flexentropy``: ``fe.enable(model, cfg)`` (the default observation, fixed budgets ``--prefill-budget`` as on the
  issue's runs: density ~0.09), ``StaticLatentKVCache(cfg, model=model, max_prompt_length=n)``, ``fe.warm_up``
  (timed: the cold warm-up of this process) through ``generate`` and again with ``loop=True``. For each
  ``--new-tokens`` N: ``generate`` and ``greedy_generate`` of 1 and of N tokens (per token ``(t_N - t_1) /
  (N - 1)``, prefill + N = ``t_N``); for the first N also a step record: every decode step's host wall time
  (call to call), the GPU time of its forward (CUDA events around the call, no sync added) and its phase (phase 1,
  the first eviction, a recompression, a static step), summed into an attribution of every millisecond per token
  above the captured step. The attribution reads host wall times, which follow the GPU only where the host waits
  for it each step (``generate``'s stopping check); the greedy loop never waits, so its wall times are the host's
  pace (a step's is short, and the first eviction's long while the queue drains) and its breakdown is the steps'
  GPU times (``--plot``).
* ``profile``: one ``generate`` of the first N under torch.profiler: the host's top operators over the static steps
  and the GPU's busy and idle time per step, written beside the JSON (``*_profile.txt``).
* ``check``: greedy tokens of the recorded steps against the same steps run eagerly, and of ``generate`` against
  `greedy_generate`, on a 2k prompt at a covering budget (the first difference).
* ``scores``: the first eviction's scoring of one layer at the context (random bf16 window queries and keys of the
  8B shape): the float32 eager path (the keys copied to float32, a float32 GEMM, then softmax, masks and means one
  pass each: what the first eviction ran before) against the library's (a GEMM with a float32 output, then one
  compiled pass for the rows' statistics and one for the sums), timed, with their largest relative difference and
  the share of kept entries they agree on (`keep_indices` of the pooled, spread scores at the default budget).
* ``coldstart``: a new process's first request: ``fe.warm_up(..., artifacts=--artifacts,
  compiled_dir=--compiled-dir)`` then one request of the first N, timed from the warm-up's start (run it in fresh
  processes, with a kept ``TORCHINDUCTOR_CACHE_DIR``, the artifacts file or the compiled dir, to see what each saves;
  it runs before the other parts, so that it times a fresh process). The row attributes the warm-up: every frame
  dynamo compiled (``get_compilation_metrics``: its name, seconds, backend and inductor seconds, cache hits and
  misses), torch's compile counters, and, unless ``--no-profile``, the warm-up's wall time split into `BUCKETS` by a
  sampler of the main thread's stack (each sample's time to the innermost frame a bucket names: dynamo tracing,
  inductor and FX-graph cache loads and compiles, CuTe DSL compiles, Triton compiles, CUDA-graph recording, the rest)
  and a ``cProfile`` of it, its top functions in the row and the whole listing beside the JSON
  (``<out>_<tag>_warm_up.txt``). Both profilers slow the Python they watch: time a clean warm-up with
  ``--no-profile``.

Every row is written to ``--out`` as it completes (a lost machine keeps what ran). ``--device cpu --tiny`` checks the
harness on a small model; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, record_graph, speed_config, sync, time_ms, write_json  # noqa: E402
from end_to_end import build_model  # noqa: E402

import flexentropy as fe  # noqa: E402
from flexentropy.engine import observe_steps  # noqa: E402
from flexentropy.engine.warm_up import FLASH_KERNEL_CACHE  # noqa: E402
from flexentropy.integrations.hf import cache_keyword, prefill_density  # noqa: E402

STEP_MARK = "decode_timeline.step"
"""The profiler range around each recorded decode step."""

DENSE = "flexentropy_dense_baseline"
"""The strong dense baseline's name in transformers' attention and mask interfaces."""



# -- the strong dense baseline ---------------------------------------------------------------------------------------
def dense_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The dense baseline's attention over a ``StaticCache``: a prompt (``query`` of ``n`` tokens, the cache's
    first ``n`` entries) causal; a decode step over the whole buffer with no mask (its unwritten entries are read
    too: the step reads what a full buffer holds, the fastest a dense step over it can be)."""
    n = query.shape[-2]
    if n == 1:
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(query, key[:, :, :n], value[:, :, :n], is_causal=True, scale=scaling,
                                             enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def dense_step(model: Any, cache: Any, token: torch.Tensor, position: torch.Tensor) -> Callable[[], None]:
    """The dense baseline's decode step over ``cache`` (a ``StaticCache``): ``token [B, 1]`` in, its greedy next
    token written back in place, ``position`` advanced (everything a CUDA graph of it needs is in place)."""
    keyword = cache_keyword(model)

    def step() -> None:
        out = model(input_ids=token, position_ids=position, **{keyword: cache}, use_cache=True,
                    logits_to_keep=1).logits
        token.copy_(out[:, -1:].argmax(dim=-1))
        position.add_(1)

    return step


def dense_rows(model: Any, ids: torch.Tensor, news: list[int], device: torch.device) -> Iterator[dict]:
    from transformers import AttentionInterface, StaticCache
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DENSE, dense_attention)
    AttentionMaskInterface.register(DENSE, no_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(DENSE)
    n, keyword = ids.shape[1], cache_keyword(model)
    cache = StaticCache(config=model.config, max_cache_len=n + max(news))
    try:
        with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                           SDPBackend.MATH]):
            sync(device)
            t0 = time.perf_counter()
            logits = model(input_ids=ids, **{keyword: cache}, use_cache=True, logits_to_keep=1).logits
            first = logits[:, -1:].argmax(dim=-1)
            sync(device)
            ttft = time.perf_counter() - t0
            token, position = first.clone(), torch.full_like(first, n)
            lengths = [layer.cumulative_length.clone() for layer in cache.layers]

            def restore() -> None:   # back to the state right after the prompt
                token.copy_(first)
                position.fill_(n)
                for layer, length in zip(cache.layers, lengths, strict=True):
                    layer.cumulative_length.copy_(length)

            run = record_graph(dense_step(model, cache, token, position), device, undo=restore)
            for new in news:
                restore()
                tokens = []
                sync(device)
                t0 = time.perf_counter()
                for _ in range(new - 1):
                    run()
                    if new == news[0]:
                        tokens.append(token.clone())
                sync(device)
                seconds = time.perf_counter() - t0
                yield {"part": "dense", "variant": "dense_captured_cudnn_nomask", "n": n, "new_tokens": new,
                       "ttft_s": ttft, "per_token_ms": seconds / max(new - 1, 1) * 1e3,
                       "total_s": ttft + seconds, "first_tokens": [int(first)] + [int(t) for t in tokens[:16]]}
    finally:
        model.set_attn_implementation(previous)


# -- flexentropy -----------------------------------------------------------------------------------------------------
def evictions(cache: Any) -> int:
    """Decisions the cache applied so far (the latent policy's first eviction, then its recompressions)."""
    return int(cache.evictions)


class StepRecorder:
    """An observer of a model's decode steps (`flexentropy.engine.observe_steps`: every step ``generate``'s compiled
    path and `greedy_generate` run through the model's step drivers): each step's host start and end, CUDA events
    around it (recorded, never waited on during the run) and the cache's decisions before and after, so that the
    phase of each step is known."""

    def __init__(self, cache: Any, device: torch.device, profiler: Any = None, count_syncs: bool = False) -> None:
        self.cache, self.device, self.steps = cache, device, []
        self.profiler, self.count_syncs = profiler, count_syncs and device.type == "cuda"

    @contextlib.contextmanager
    def observe(self, cache: Any, tokens: torch.Tensor) -> Iterator[None]:
        """Around one step (the `Observer` protocol)."""
        if self.profiler is not None and not self.steps:
            self.profiler.start()
        before = evictions(self.cache)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" else []
        start = time.perf_counter()
        if events:
            events[0].record()
        with torch.profiler.record_function(STEP_MARK), warnings.catch_warnings(record=True) as caught:
            if self.count_syncs:   # every synchronising CUDA call inside the step warns once
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if self.count_syncs:
                    torch.cuda.set_sync_debug_mode("default")
        if events:
            events[1].record()
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        self.steps.append({"start": start, "end": time.perf_counter(), "events": events,
                           "before": before, "after": evictions(self.cache), "syncs": syncs})

    def summary(self, total_s: float, ttft_s: float, new: int) -> dict:
        """Per phase: steps, median host wall and forward GPU ms; the attribution per generated token."""
        sync(self.device)
        steps = self.steps
        ends = [s["start"] for s in steps[1:]]
        for s, end in zip(steps, ends, strict=False):
            s["wall_ms"] = (end - s["start"]) * 1e3
        if steps:   # the last step ends when the request returns
            steps[-1]["wall_ms"] = (self.finished - steps[-1]["start"]) * 1e3
        for s in steps:
            s["gpu_ms"] = s["events"][0].elapsed_time(s["events"][1]) if s["events"] else (s["end"] - s["start"]) * 1e3
            s["host_ms"] = (s["end"] - s["start"]) * 1e3
            s["phase"] = ("phase1" if s["after"] == 0 else "first_eviction" if s["before"] == 0
                          else "recompression" if s["after"] > s["before"] else "static")
        phases: dict[str, dict] = {}
        for name in ("phase1", "first_eviction", "recompression", "static"):
            chosen = [s for s in steps if s["phase"] == name]
            if chosen:
                phases[name] = {"steps": len(chosen), "syncs": sum(s["syncs"] for s in chosen),
                                "wall_ms_median": statistics.median(s["wall_ms"] for s in chosen),
                                "gpu_ms_median": statistics.median(s["gpu_ms"] for s in chosen),
                                "host_call_ms_median": statistics.median(s["host_ms"] for s in chosen),
                                "wall_ms_total": sum(s["wall_ms"] for s in chosen)}
        static = phases.get("static", {})
        step_ms = static.get("gpu_ms_median", 0.0)
        per = 1.0 / max(new - 1, 1)
        attribution = {"captured_step_ms": step_ms}
        if static:
            attribution["static_steps_outside_step_ms"] = sum(
                s["wall_ms"] - s["gpu_ms"] for s in steps if s["phase"] == "static") * per
            attribution["static_steps_step_jitter_ms"] = sum(
                s["gpu_ms"] - step_ms for s in steps if s["phase"] == "static") * per
        for name in ("phase1", "first_eviction", "recompression"):
            if name in phases:
                attribution[f"{name}_above_step_ms"] = (phases[name]["wall_ms_total"]
                                                        - phases[name]["steps"] * step_ms) * per
        attribution["per_token_ms"] = (total_s - ttft_s) * 1e3 * per
        attribution["unattributed_ms"] = attribution["per_token_ms"] - sum(
            v for k, v in attribution.items() if k not in ("per_token_ms",))
        return {"phases": phases, "attribution_per_token": attribution,
                "steps": [{k: round(s[k], 4) if isinstance(s[k], float) else s[k]
                           for k in ("phase", "wall_ms", "gpu_ms", "host_ms")} for s in steps]}


def request_s(model: Any, ids: torch.Tensor, cache: Any, new: int, device: torch.device, loop: bool) -> float:
    """Seconds of one request of ``new`` tokens: ``generate`` (greedy, no stopping token) or `greedy_generate`."""
    cache.reset()
    sync(device)
    t0 = time.perf_counter()
    if loop:
        fe.greedy_generate(model, ids, cache, new)
    else:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, eos_token_id=None, **{cache_keyword(model): cache})
    sync(device)
    return time.perf_counter() - t0


def flexentropy_rows(model: Any, ids: torch.Tensor, args: argparse.Namespace, device: torch.device,
                     out: Path) -> Iterator[dict]:
    cfg = speed_config(base_budget=args.prefill_budget)
    fe.enable(model, cfg)
    cache = fe.StaticLatentKVCache(cfg, model=model, max_prompt_length=args.max_prompt_length or ids.shape[1])
    n = ids.shape[1]
    for loop in (False, True):
        via = "greedy_generate" if loop else "generate"
        t0 = time.perf_counter()
        fe.warm_up(model, args.warm_lengths, cache=cache, loop=loop)
        yield {"part": "flexentropy", "variant": f"warm_up_{via}", "seconds": time.perf_counter() - t0}
        # medians of --repeats runs: one TTFT's noise (~0.1 s) alone moves (t_256 - t_1) / 255 by 0.4 ms
        ttfts = [request_s(model, ids, cache, 1, device, loop) for _ in range(args.repeats)]
        ttft = statistics.median(ttfts)
        for index, new in enumerate(args.new_tokens):
            totals = [request_s(model, ids, cache, new, device, loop) for _ in range(args.repeats)]
            total = statistics.median(totals)
            row = {"part": "flexentropy", "variant": f"flexentropy_{via}", "n": n, "new_tokens": new,
                   "ttft_s": ttft, "total_s": total, "per_token_ms": (total - ttft) / (new - 1) * 1e3,
                   "ttft_runs_s": ttfts, "total_runs_s": totals, "density": prefill_density(model)}
            if index == 0:   # one more run, its steps recorded (the events add a little to it)
                recorder = StepRecorder(cache, device)
                with observe_steps(model, recorder.observe):
                    recorded = request_s(model, ids, cache, new, device, loop)
                    recorder.finished = time.perf_counter()
                timeline = recorder.summary(recorded, ttft, new)
                row["phases"] = timeline["phases"]
                row["attribution_per_token"] = timeline["attribution_per_token"]
                write_json(out.with_name(f"{out.stem}_steps_{via}.json"), {"steps": timeline["steps"]})
            yield row
    if "profile" in args.parts:
        yield profile_row(model, ids, cache, args.new_tokens[0], device, out)


def profile_row(model: Any, ids: torch.Tensor, cache: Any, new: int, device: torch.device, out: Path) -> dict:
    """One ``generate`` with its decode steps under torch.profiler (started at the first decode step): the host's
    top operators by self CPU time (``OUT_profile.txt``), and per phase the GPU's busy time within each step's host
    window (kernels assigned by their start, their union per window) against the window."""
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = torch.profiler.profile(activities=activities)
    recorder = StepRecorder(cache, device, profiler=prof, count_syncs=True)
    try:
        with observe_steps(model, recorder.observe):
            total = request_s(model, ids, cache, new, device, loop=False)
            recorder.finished = time.perf_counter()
    finally:
        if recorder.steps:
            prof.stop()
    if not recorder.steps:
        return {"part": "profile", "error": "generate called no compiled decode step (not on CUDA?)"}
    phases = recorder.summary(total, 0.0, new)["phases"]
    averages = prof.key_averages()
    table = "\n\n".join(averages.table(sort_by=key, row_limit=40, max_name_column_width=80)
                         for key in ("self_cpu_time_total", "self_device_time_total"))
    events = prof.events()
    marks = sorted(e.time_range.start for e in events if e.name == STEP_MARK)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    windows = list(zip(marks, marks[1:] + [max([k[1] for k in kernels] + marks[-1:])], strict=True))
    per_phase: dict[str, list[tuple[float, float]]] = {}
    for (low, high), step in zip(windows, recorder.steps, strict=False):
        busy, reach = 0.0, low
        for start, end in kernels:
            if low <= start < high:
                start = max(start, reach)
                if end > start:
                    busy, reach = busy + end - start, end
        per_phase.setdefault(step["phase"], []).append((busy / 1e3, (high - low) / 1e3))
    gpu = {phase: {"steps": len(v), "busy_ms_median": statistics.median(b for b, _ in v),
                   "window_ms_median": statistics.median(w for _, w in v)} for phase, v in per_phase.items()}
    path = out.with_name(f"{out.stem}_profile.txt")
    path.write_text(table, encoding="utf-8")
    return {"part": "profile", "variant": "generate_profiled", "new_tokens": new, "total_s": total,
            "gpu_per_phase": gpu, "syncs_per_phase": {name: phase["syncs"] for name, phase in phases.items()},
            "table": str(path)}


def check_row(model: Any, device: torch.device, n: int = 2048, new: int = 64) -> dict:
    """Greedy tokens of the recorded steps against the same steps eager (`greedy_generate(compiled=False)`), and of
    ``generate`` against `greedy_generate`, at a budget covering the request (no eviction: the comparison is of
    kernels, not of decisions): the position of the first difference (None: all equal)."""
    cfg = speed_config(base_budget=2048, decode_budget=n + new)
    fe.enable(model, cfg)
    gen = torch.Generator(device=device).manual_seed(7)
    ids = torch.randint(100, model.config.vocab_size - 1, (1, n), device=device, generator=gen)
    cache = fe.StaticLatentKVCache(cfg, model=model, max_prompt_length=n)
    runs = {"eager": fe.greedy_generate(model, ids, cache, new, compiled=False)}
    cache.reset()
    runs["recorded"] = fe.greedy_generate(model, ids, cache, new)
    cache.reset()
    runs["generate"] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
                                      **{cache_keyword(model): cache})[:, n:]

    def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
        diff = (a != b).flatten().nonzero()
        return int(diff[0]) if diff.numel() else None

    return {"part": "check", "variant": "greedy_identity", "n": n, "new_tokens": new,
            "recorded_vs_eager_first_difference": first_difference(runs["recorded"], runs["eager"]),
            "generate_vs_loop_first_difference": first_difference(runs["generate"], runs["recorded"])}


def scores_row(model: Any, n: int, device: torch.device) -> dict:
    """The ``scores`` part (module docstring): one layer's scoring at the first eviction, eager float32 against the
    library's path."""
    from flexentropy.kv import keep_indices, pool_scores, spread_forward, window_attention_scores
    from flexentropy.kv.scoring import softmax_scores

    cfg, text = fe.EntropyConfig(), model.config
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    dim, window = text.hidden_size // heads, cfg.decode_window
    gen = torch.Generator(device=device).manual_seed(11)
    keys = torch.randn(1, kv_heads, n, dim, device=device, dtype=torch.bfloat16, generator=gen)
    queries = keys[:, :, -window:].repeat_interleave(heads // kv_heads, dim=1) + torch.randn(
        1, heads, window, dim, device=device, dtype=torch.bfloat16, generator=gen)   # attend their neighbourhood
    positions = dict(query_positions=torch.arange(n - window, n, device=device),
                     key_positions=torch.arange(n, device=device))

    def eager_float32() -> torch.Tensor:
        group = heads // kv_heads
        q = queries.float().view(kv_heads, group * window, dim)
        logits = (q @ keys[0].float().transpose(1, 2)).view(kv_heads, group, window, n)
        return softmax_scores(logits, positions["key_positions"].view(1, n), positions["query_positions"], None,
                              dim**-0.5, "mean", compiled=False).view(1, kv_heads, n)

    def library() -> torch.Tensor:
        return window_attention_scores(queries, keys, **positions)

    def kept(scores: torch.Tensor) -> torch.Tensor:
        ranked = spread_forward(pool_scores(scores, cfg.decode_pool), cfg.decode_span)
        return keep_indices(ranked, cfg.decode_budget, window)

    with torch.no_grad():
        want, got = eager_float32(), library()
        agree = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(kept(want)[0], kept(got)[0], strict=True))
        return {"part": "scores", "variant": "first_eviction_one_layer", "n": n, "window": window,
                "eager_float32_ms": time_ms(eager_float32, device), "library_ms": time_ms(library, device),
                "keep_ms": time_ms(lambda: kept(got), device),
                "max_relative_difference": float(((got - want).abs() / want.abs().clamp_min(1e-30)).max()),
                "kept_agreement": agree / (kv_heads * cfg.decode_budget)}


BUCKETS = (
    ("CuTe DSL compiles and kernel cache loads", "flash_attn/cute/cute_dsl_utils.py", ("cute_compile_patched",)),
    ("CuTe DSL compiles and kernel cache loads", "flash_attn/cute/cache_utils.py", None),
    ("Triton compiles", "triton/compiler/", None),
    ("Triton compiles", "torch/_inductor/async_compile.py", None),
    ("Triton compiles", "torch/_inductor/runtime/triton_heuristics.py",
     ("precompile", "_precompile_worker", "_precompile_config", "_make_launchers", "benchmark_all_configs",
      "autotune_to_one_config", "coordinate_descent_tuning")),
    ("inductor and FX-graph cache loads and compiles", "torch/_inductor/compile_fx.py", None),
    ("dynamo tracing", "torch/_dynamo/convert_frame.py", None),
    ("CUDA-graph recording", "torch/cuda/graphs.py", None),
    ("CUDA-graph recording", "flexentropy/engine/driver.py", ("_recording",)),
    ("compiled graphs loaded from the compiled dir", "flexentropy/_compile.py", ("load",)),
)
"""``(bucket, path fragment, functions or None: any)``: a stack sample goes to the bucket of its innermost frame whose
file path holds the fragment (in a function named, where some are), or of an import (a module's body run by
importlib: `IMPORTS`), else `REST`. The fragments name compile-time entry points only (a compiled graph's run goes
through other torch files): a Triton compile under inductor is Triton's, inductor's compile under dynamo
inductor's, and the eager runs of a step while the driver records it are the recording's."""

IMPORTS = "imports (module bodies: flash-attn-4's CuTe DSL, triton, ...)"
REST = "the rest (the warm-up's own requests: eager Python, kernels, waits)"


def frame_bucket(frame: Any) -> str:
    """The bucket of a stack (its innermost ``frame``) under `BUCKETS`."""
    while frame is not None:
        code = frame.f_code
        path = code.co_filename.replace(os.sep, "/")
        for bucket, fragment, functions in BUCKETS:
            if fragment in path and (functions is None or code.co_name in functions):
                return bucket
        if code.co_name == "<module>" and frame.f_back is not None and "importlib" in frame.f_back.f_code.co_filename:
            return IMPORTS
        frame = frame.f_back
    return REST


class StackSampler:
    """Inside, a thread samples ``thread``'s stack (default: the one that enters) every ``interval`` seconds and
    gives the wall time since its previous sample to that stack's bucket (`frame_bucket`): ``seconds`` sums to the
    time inside."""

    def __init__(self, interval: float = 0.01, thread: int | None = None) -> None:
        self.interval, self.thread = interval, thread
        self.seconds: dict[str, float] = {}
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> StackSampler:
        self.thread = threading.get_ident() if self.thread is None else self.thread
        self._last = time.perf_counter()
        self._sampler = threading.Thread(target=self._run, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        frame = sys._current_frames().get(self.thread)
        now = time.perf_counter()
        bucket = frame_bucket(frame)
        self.seconds[bucket] = self.seconds.get(bucket, 0.0) + now - self._last
        self._last = now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sampler.join()
        self._sample()


METRICS = ("compile_id", "co_name", "co_filename", "co_firstlineno", "entire_frame_compile_time_s",
           "backend_compile_time_s", "inductor_compile_time_s", "code_gen_time_s", "triton_compile_time_us",
           "runtime_triton_autotune_time_us", "compile_time_autotune_time_us", "inductor_fx_local_cache_hit_count",
           "inductor_fx_local_cache_miss_count", "inductor_fx_remote_cache_hit_count",
           "inductor_fx_remote_cache_miss_count", "aotautograd_local_cache_hit_count",
           "aotautograd_local_cache_miss_count", "graph_op_count", "guard_count", "cache_size", "recompile_reason",
           "fail_reason")
"""Fields of dynamo's ``CompilationMetrics`` kept per compiled frame (absent ones are None: they vary with torch)."""


def compiled_frames() -> list[dict]:
    """Every frame dynamo compiled in this process so far, with `METRICS`."""
    from torch._dynamo.utils import get_compilation_metrics

    frames = []
    for metrics in get_compilation_metrics():
        frame = {name: getattr(metrics, name, None) for name in METRICS}
        frame["compile_id"] = None if frame["compile_id"] is None else str(frame["compile_id"])
        frames.append(frame)
    return frames


def top_functions(stats: pstats.Stats, key: str, count: int) -> list[dict]:
    """The ``count`` functions of ``stats`` with the most ``key`` time (``"cumulative"`` or ``"tottime"``)."""
    rows = [{"function": f"{file}:{line}({name})", "calls": calls, "own_s": own, "cumulative_s": cumulative}
            for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items()]
    rows.sort(key=lambda row: row["cumulative_s" if key == "cumulative" else "own_s"], reverse=True)
    return rows[:count]


def coldstart_row(model: Any, ids: torch.Tensor, args: argparse.Namespace, device: torch.device, out: Path) -> dict:
    """A fresh process's first request, timed from the start of ``fe.warm_up``, and the warm-up's attribution (module
    docstring)."""
    from flexentropy.engine import compiled_work
    from flexentropy.engine.driver import recorded_steps

    cfg = speed_config(base_budget=args.prefill_budget)
    fe.enable(model, cfg)
    cache = fe.StaticLatentKVCache(cfg, model=model, max_prompt_length=args.max_prompt_length or ids.shape[1])
    flash_cache = os.environ.get(FLASH_KERNEL_CACHE)
    profiler, sampler = (None, None) if args.no_profile else (cProfile.Profile(), StackSampler())
    with sampler or contextlib.nullcontext():
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        fe.warm_up(model, args.warm_lengths, cache=cache, artifacts=args.artifacts, compiled_dir=args.compiled_dir)
        warm = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
    request = request_s(model, ids, cache, args.new_tokens[0], device, loop=False)
    frames = compiled_frames()   # what dynamo traced (and inductor compiled or took from its caches)
    row = {"part": "coldstart", "variant": args.tag or "coldstart", "warm_up_s": warm, "request_s": request,
           "first_request_done_s": warm + request, "profiled": not args.no_profile, "artifacts": args.artifacts,
           "artifacts_existed": args.artifacts_existed, "compiled_dir": args.compiled_dir,
           "compiled_dir_existed": args.compiled_dir_existed, "kept": compiled_work(), "graphs": len(frames),
           "graphs_s": sum(frame["entire_frame_compile_time_s"] or 0.0 for frame in frames),
           "frames": frames, "recorded_steps": recorded_steps(model),
           "counters": {kind: dict(values) for kind, values in torch._dynamo.utils.counters.items()
                        if kind in ("stats", "inductor", "aot_autograd")},
           "flash_attn_cache_env": {"before": flash_cache, "after": os.environ.get(FLASH_KERNEL_CACHE)},
           "flash_attn_cache": os.environ.get(FLASH_KERNEL_CACHE) == "1"}
    if sampler is not None:
        row["warm_up_buckets_s"] = dict(sorted(sampler.seconds.items(), key=lambda item: -item[1]))
    if profiler is not None:
        stats = pstats.Stats(profiler)
        row["top_cumulative"] = top_functions(stats, "cumulative", 25)
        row["top_own"] = top_functions(stats, "tottime", 15)
        listing = io.StringIO()
        pstats.Stats(profiler, stream=listing).sort_stats("cumulative").print_stats(200)
        path = out.with_name(f"{out.stem}_{args.tag or 'coldstart'}_warm_up.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(listing.getvalue())
        row["profile"] = str(path)
    return row


PHASES = {"static": "static steps", "phase1": "phase-1 steps", "first_eviction": "first eviction",
          "recompression": "recompressions"}


def breakdown(steps: list[dict], per_token_ms: float, new: int) -> dict[str, float]:
    """Milliseconds per generated token: each phase's summed step time (CUDA events around each step: its GPU work and
    any launch wait inside the call), and what remains of ``(t_new - t_1)`` between the steps (the host's work while
    the GPU waits: ``generate``'s own, its synchronisation)."""
    per = 1.0 / (new - 1)
    parts = {label: sum(s["gpu_ms"] for s in steps if s["phase"] == phase) * per for phase, label in PHASES.items()}
    parts["between steps"] = max(per_token_ms - sum(parts.values()), 0.0)
    return parts


def plot(folder: Path) -> dict[str, dict[str, float]]:
    """``folder/per_token.png``: per generated token of the first ``--new-tokens`` request, before and after, through
    ``generate`` and `greedy_generate`, stacked by `breakdown`, beside the dense decode of the same run; returns the
    breakdowns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars: dict[str, dict[str, float]] = {}
    for run in ("before", "after"):
        rows = json.loads((folder / f"{run}.json").read_text())["rows"]
        dense = next(r for r in rows if r.get("part") == "dense")
        bars[f"dense, {run} run"] = {"dense step": dense["per_token_ms"]}
        for via in ("generate", "greedy_generate"):
            row = next(r for r in rows if r.get("variant") == f"flexentropy_{via}" and "phases" in r)
            steps = json.loads((folder / f"{run}_steps_{via}.json").read_text())["steps"]
            bars[f"{via}, {run}"] = breakdown(steps, row["per_token_ms"], row["new_tokens"])
    labels = list(bars)
    fig, ax = plt.subplots(figsize=(11, 3.8))
    colors = {"dense step": "#888888", "static steps": "#1f77b4", "phase-1 steps": "#ff7f0e",
              "first eviction": "#d62728", "recompressions": "#9467bd", "between steps": "#bcbd22"}
    for name, color in colors.items():
        left = [sum(v for k, v in bars[label].items() if list(colors).index(k) < list(colors).index(name))
                for label in labels]
        ax.barh(labels, [bars[label].get(name, 0.0) for label in labels], left=left, color=color, label=name)
    ax.invert_yaxis()
    ax.set_xlabel("ms per generated token, (t_256 - t_1) / 255, 131,072-token prompt")
    ax.set_title("Llama-3.1-8B shape on one H200: where a generated token's time goes")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(folder / "per_token.png", dpi=120)
    return bars


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="dense,flexentropy,profile,check")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--new-tokens", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--prefill-budget", type=int, default=3328,
                   help="B_0 of the fixed prefill budgets (3328: density ~0.09 at 128k, near the default's on "
                        "Qwen2.5-Coder-1.5B)")
    p.add_argument("--max-prompt-length", type=int, default=None, help="default: the context")
    p.add_argument("--warm-lengths", type=int, nargs="+", default=[8192, 12345])
    p.add_argument("--artifacts", default=None, help="coldstart: fe.warm_up's artifacts file")
    p.add_argument("--compiled-dir", default=None, help="coldstart: fe.warm_up's compiled_dir")
    p.add_argument("--tag", default="", help="coldstart: the row's variant")
    p.add_argument("--no-profile", action="store_true",
                   help="coldstart: time the warm-up without the stack sampler and cProfile")
    p.add_argument("--repeats", type=int, default=3, help="flexentropy: runs of each request, their median")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="docs/results/decode_timeline/timeline.json")
    p.add_argument("--plot", type=Path, default=None,
                   help="only plot the runs FOLDER/before.json and FOLDER/after.json (FOLDER/per_token.png) and print "
                        "their breakdowns")
    args = p.parse_args(argv)
    if args.plot:
        for label, parts in plot(args.plot).items():
            print(f"{label:32s} " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) +
                  f" = {sum(parts.values()):.2f} ms")
        return
    args.artifacts_existed = bool(args.artifacts) and Path(args.artifacts).is_file()
    args.compiled_dir_existed = bool(args.compiled_dir) and any(Path(args.compiled_dir).glob("*/*/*.bin"))
    device = torch.device(args.device)
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def keep(row: dict) -> None:
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
               if k not in ("phases", "frames", "counters", "top_cumulative", "top_own")}, flush=True)
        write_json(out, {"benchmark": "decode_timeline", "model": "Llama-3.1-8B shape, random weights, bf16, "
                         "fe.fuse_projections", "layers": args.layers, "environment": environment(), "rows": rows})

    def guarded(part: str, rows_of: Callable[[], Iterator[dict]]) -> None:
        try:
            for row in rows_of():
                keep(row)
        except Exception as err:  # noqa: BLE001 - one failed part must not lose the others
            traceback.print_exc()
            keep({"part": part, "error": f"{type(err).__name__}: {err}"[:500]})

    model = build_model(args.layers, device, args.tiny)
    fe.fuse_projections(model)
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(100, model.config.vocab_size - 1, (1, args.context), device=device, generator=gen)
    parts = set(args.parts.split(","))
    if "coldstart" in parts:   # first: it times a fresh process
        guarded("coldstart", lambda: iter([coldstart_row(model, ids, args, device, out)]))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "dense" in parts:
        guarded("dense", lambda: dense_rows(model, ids, args.new_tokens, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "flexentropy" in parts:
        guarded("flexentropy", lambda: flexentropy_rows(model, ids, args, device, out))
    if "check" in parts:
        guarded("check", lambda: iter([check_row(model, device)]))
    if "scores" in parts:
        guarded("scores", lambda: iter([scores_row(model, args.context, device)]))


if __name__ == "__main__":
    main()
