"""Decode at memory speed (issue 17): captured decode over `StaticLatentKVCache` against dense, one harness for
every row, on a Llama-3.1-8B-shaped model (random bf16 weights built on the device, no download).

    source profiling/h200/setup.sh   # flash-attn-4 for the FLASH prefill backend (optional)
    python profiling/decode_static.py --parts decode --out docs/results/decode_static
    python profiling/decode_static.py --parts e2e,checks --out docs/results/decode_static

Parts (``--parts``, comma-separated; each call merges its rows into ``OUT/decode_static.json``):

* ``decode``: decode step ms at each ``--contexts`` (batch 1) and ``--batch8`` (batch 8) for
  ``hf_eager_dense`` (DynamicCache, SDPA flash), ``hf_static_dense_compiled`` (HF StaticCache sized to the context,
  the forward compiled as ``generate`` compiles it: CUDA graphs), ``eager_latent`` (LatentKVCache) and
  ``static_latent_captured`` (StaticLatentKVCache, compiled forward) and ``dense_lengths_captured`` (the strongest
  dense decode these kernels give, `dense_lengths_config`: the full cache in static buffers, never evicted, read
  over exactly its valid entries by flash-attn-4's kernel, compiled and captured as flexentropy's; SDPA over the
  masked buffer where that kernel cannot run). The prompt's KV is random (filled through the
  caches' own ``update``: a decode step's cost does not depend on the values); the latent rows run their
  ``decode_delay`` phase-1 steps eagerly, then are timed on the steady state (evictions included). Each row has
  ``limit_ms``: (weights + KV bytes read per step) / 4.3 TB/s.
* ``e2e``: prefill + ``--new-tokens`` at ``--e2e-context`` through ``generate``: ``dense_best`` (the faster of a
  cuDNN SDPA prefill and a FLASH-backend dense flex prefill, HF StaticCache, compiled decode) vs ``flexentropy``
  (sparse prefill on the FLASH backend when flash-attn-4 is importable, StaticLatentKVCache, compiled decode), the
  latter cold (dynamo reset) and after ``fe.warm_up``; ``dense_lengths``: SDPA prefill, then the decode of
  ``dense_lengths_captured``, through ``generate`` after a warm-up request.
* ``checks``: greedy tokens of the captured vs the uncaptured static latent decode at a covering budget on a short
  prompt, and the same for dense (HF ``StaticCache``, eager against compiled) as a control, on the random-weight
  model or, with ``--check-model``, on a real one (Qwen2.5-Coder-1.5B on the device) and an essay prompt; graphs
  compiled across prompts of ``--check-lengths`` and ``--long-steps`` decode steps after one warm-up; the cache's
  bytes at the end.

The JSON is rewritten after every row; a failed row records its error and the others go on. A table is printed
last. ``--device cpu --tiny`` runs a small model for a quick check of the harness.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import (  # noqa: E402
    PROBE_KERNEL,
    causal_block_mask,
    dense_flex,
    environment,
    speed_config,
    sync,
    write_json,
)
from end_to_end import build_model  # noqa: E402

import flexentropy as fe  # noqa: E402
from flexentropy.engine.driver import recorded_steps  # noqa: E402
from flexentropy.integrations.hf import cache_keyword, prefill_density  # noqa: E402
from flexentropy.sparse.kernel import flash_available, kernel_options  # noqa: E402

BANDWIDTH = 4.3e12
"""H200 HBM bytes per second: the memory-speed limit of a decode step."""

VARIANTS = ("hf_eager_dense", "hf_static_dense_compiled", "dense_lengths_captured", "eager_latent",
            "static_latent_captured")


def dense_lengths_config(cfg: fe.EntropyConfig, entries: int) -> fe.EntropyConfig:
    """``cfg`` for a `StaticLatentKVCache` that is a dense decode: a budget above the ``entries`` a request holds
    (nothing is ever evicted) and the switch to the static buffers at the first decode step (``decode_delay=0``),
    so every step is captured and reads exactly the valid entries (``lengths``) with flash-attn-4's kernel."""
    return cfg.replace(decode_budget=entries, decode_delay=0)


TUNED = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
"""``--tuned``: inductor options of ``mode="reduce-overhead"`` plus coordinate-descent tuning, under which inductor
lowers a matrix product with one row (batch-1 decode's linears) to a tuned Triton reduction instead of cuBLAS."""


def compile_config(device: torch.device, backend: str, tuned: bool = False):
    from transformers.generation import CompileConfig

    if tuned and device.type == "cuda":
        config = CompileConfig(backend=backend, mode=None, options=dict(TUNED))
    else:
        config = CompileConfig(backend=backend, mode="reduce-overhead" if device.type == "cuda" else None)
    if device.type != "cuda":
        config._compile_all_devices = True
    return config


@contextlib.contextmanager
def dense_backend(backend: SDPBackend) -> Iterator[None]:
    """SDPA pinned to ``backend`` first, the others allowed after it (a masked call cannot run flash)."""
    order = [backend] + [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                     SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if b != backend]
    try:
        context = sdpa_kernel(order, set_priority=True)
    except TypeError:  # torch without set_priority
        context = sdpa_kernel(order)
    with context:
        yield


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every parameter but the input embedding (one row of it)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


def kv_bytes(model, batch: int, entries: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * entries * head_dim * 2


def fill(cache, model, batch: int, n: int, device: torch.device) -> None:
    """The prompt's keys and values (random) in every layer of ``cache``, queries handed over for policy caches."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, cfg.num_key_value_heads, n, head_dim, device=device, generator=gen,
                        dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cache.update(k, v, layer)
        if hasattr(cache, "observe_queries"):
            q = torch.randn(batch, cfg.num_attention_heads, 1, head_dim, device=device, generator=gen,
                            dtype=torch.bfloat16)
            cache.observe_queries(q.expand(-1, -1, n, -1), layer)
        del k, v


def step_fn(model, forward: Callable, cache, batch: int, n: int, device: torch.device) -> Callable[[], None]:
    """One greedy decode step per call (positions advance), through ``forward``."""
    state = {"tok": torch.full((batch, 1), 5, device=device, dtype=torch.long), "pos": n}
    keyword = cache_keyword(model)

    def step() -> None:
        pos = torch.full((batch, 1), state["pos"], device=device, dtype=torch.long)
        logits = forward(input_ids=state["tok"], position_ids=pos, **{keyword: cache}, use_cache=True).logits
        state["tok"] = logits[:, -1:].argmax(dim=-1)
        state["pos"] += 1

    return step


def time_steps(step: Callable[[], None], device: torch.device, warm: int, steps: int) -> float:
    """Mean ms per step over ``steps`` back-to-back steps after ``warm`` (CUDA events on GPU)."""
    for _ in range(warm):
        step()
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) * 1e3 / steps


def profile_steps(step: Callable[[], None], device: torch.device, path: Path, steps: int = 10) -> float:
    """``steps`` steps under torch.profiler; the kernels sorted by GPU time written to ``path``; returns the summed
    kernel time per step in ms (against the step's wall time: what launches and gaps cost)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    events = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events.table(sort_by="self_device_time_total" if device.type == "cuda" else "self_cpu_time_total",
                                 row_limit=30, max_name_column_width=90), encoding="utf-8")
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.self_device_time_total for e in kernels) / 1e3 / steps


def decode_row(model, variant: str, batch: int, n: int, args, device: torch.device) -> dict:
    from transformers import DynamicCache, StaticCache

    cfg = fe.EntropyConfig(decode_budget=args.budget, decode_kernel=args.decode_kernel)
    config = compile_config(device, args.compile_backend, args.tuned)
    row = {"part": "decode", "variant": variant + args.tag, "batch": batch, "n": n}
    with torch.inference_mode():
        if variant == "hf_eager_dense":
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
            fill(cache, model, batch, n, device)
            with dense_backend(SDPBackend.FLASH_ATTENTION):
                row["step_ms"] = time_steps(step_fn(model, model.__call__, cache, batch, n, device), device,
                                            args.warm, args.steps)
            entries = n + args.warm + args.steps
        elif variant == "hf_static_dense_compiled":
            model.set_attn_implementation("sdpa")
            size = n + args.warm + args.steps + 8
            cache = StaticCache(config=model.config, max_cache_len=size)
            fill(cache, model, batch, n, device)
            with dense_backend(SDPBackend.FLASH_ATTENTION):
                step = step_fn(model, model.get_compiled_call(config), cache, batch, n, device)
                row["step_ms"] = time_steps(step, device, args.warm, args.steps)
            entries = size  # attention reads the whole buffer under its mask
        else:
            if variant == "dense_lengths_captured":
                cfg = dense_lengths_config(cfg, n + cfg.decode_delay + args.warm + args.steps + 8)
            fe.enable(model, cfg, prefill="dense")
            static = variant in ("static_latent_captured", "dense_lengths_captured")
            cache = (fe.StaticLatentKVCache(cfg, model=model) if static else fe.LatentKVCache(cfg))
            fill(cache, model, batch, n, device)
            step = step_fn(model, model.__call__, cache, batch, n, device)
            for _ in range(cfg.decode_delay):  # phase 1 (full cache) eagerly, up to the first eviction
                step()
            if static:  # the compiled call as generate gets it once the cache has routed it (one graph per step)
                compiled = model.get_compiled_call(config)
                step_compiled = step_fn(model, compiled, cache, batch, n + cfg.decode_delay, device)
                row["step_ms"] = time_steps(step_compiled, device, args.warm, args.steps)
                if args.profile_decode:
                    row["gpu_busy_ms"] = profile_steps(step_compiled, device, Path(args.out) /
                                                       f"decode_profile_{row['variant']}_b{batch}_{n}.txt")
                flash = cache.flash
                entries = n + args.warm + args.steps if flash and variant == "dense_lengths_captured" else (
                    cache.capacity)  # flash reads the valid entries (at most this many), SDPA the whole buffer
                row["decode_kernel"] = "flash" if flash else "sdpa"
            else:
                row["step_ms"] = time_steps(step, device, args.warm, args.steps)
                entries = cache.stored_length(0)
            row["cache_gib"] = cache.nbytes() / 2**30
        row["kv_entries"] = entries
    weights, kv = weight_bytes(model), kv_bytes(model, batch, entries)
    row.update(weight_gb=weights / 1e9, kv_gib=kv / 2**30, limit_ms=(weights + kv) / BANDWIDTH * 1e3)
    row["x_limit"] = row["step_ms"] / row["limit_ms"]
    del cache
    return row


class StepClock:
    """A logits processor that only notes the time of each call: ``generate`` calls it once per new token, after
    that token's forward (the first call ends the prompt's forward, TTFT)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times, self.start = device, [], 0.0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores

    def summary(self, delay: int) -> dict:
        """TTFT, the median step after ``delay`` steps (the latent cache's phase 1) and over phase 1, the step that
        switches to the static phase (the first eviction), and the five slowest steps as ``[index, ms]``."""
        steps = [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:], strict=False)]
        return {"ttft_s": self.times[0] - self.start,
                "decode_step_ms": statistics.median(steps[delay + 1:]) if len(steps) > delay + 1 else None,
                "phase1_step_ms": statistics.median(steps[:delay]) if len(steps) >= delay > 0 else None,
                "switch_step_ms": steps[delay] if len(steps) > delay else None,
                "slowest_steps_ms": sorted(([i, round(ms, 2)] for i, ms in enumerate(steps)), key=lambda x: -x[1])[:5]}


class GraphRecordings:
    """CUDA graphs recorded so far by torch's CUDA graph trees (``mode="reduce-overhead"``), which announce each
    recording to dynamo's compilation callbacks: a step that replays records nothing, one whose static inputs moved
    (a new cache's buffers at new addresses) records the whole step again."""

    def __init__(self) -> None:
        from torch._dynamo.callback import CallbackTrigger, callback_handler

        self.count = 0

        def on_start(args) -> None:
            if args.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING:
                self.count += 1

        callback_handler.register_start_callback(on_start)


RECORDINGS = GraphRecordings()


def graphs_recorded(model) -> int:
    """CUDA graphs recorded so far: by torch's graph trees (`RECORDINGS`: dense's compiled ``StaticCache`` steps) and
    by ``model``'s step drivers (a `StaticLatentKVCache`'s steps, which the driver records itself)."""
    return RECORDINGS.count + recorded_steps(model)


def generate_s(model, ids: torch.Tensor, cache, new: int, device: torch.device, clock: StepClock | None = None,
               **kwargs) -> tuple[float, list]:
    from transformers import LogitsProcessorList

    sync(device)
    t0 = time.perf_counter()  # generate's own no_grad, as fe.warm_up: inference tensors would fail its graphs' guards
    if clock:
        clock.start = t0
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                         eos_token_id=None, **{cache_keyword(model): cache},
                         logits_processor=LogitsProcessorList([clock] if clock else []), **kwargs)
    sync(device)
    return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()


def loop_s(model, ids: torch.Tensor, cache, new: int, device: torch.device, compile_config) -> float:
    """Seconds of ``fe.greedy_generate`` of ``new`` tokens after ``ids`` (the plain-loop twin of `generate_s`)."""
    sync(device)
    t0 = time.perf_counter()
    fe.greedy_generate(model, ids, cache, new, compile_config=compile_config)
    sync(device)
    return time.perf_counter() - t0


def flash_flex_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs):
    """An HF attention function for the dense baseline's FLASH-backend prefill: a prompt (``query``, ``key``,
    ``value``: ``[B, H, N, D]``, no padding) runs causal flex attention compiled for its length on flash-attn-4;
    anything else (decode) runs SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n = query.shape[-2]
    if n != key.shape[-2] or n == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    out = dense_flex(query, key, value, block_mask=causal_block_mask(n, query.device), scale=scaling, enable_gqa=True,
                      kernel_options=kernel_options("flash", query.device, 128, query.dtype))
    return out.transpose(1, 2).contiguous(), None


def flash_flex_prefill_s(model, ids: torch.Tensor, device: torch.device) -> float:
    """TTFT of a dense prefill on FLASH-backend flex attention (the faster dense prompt kernel at 128k on the
    H200, docs/results/probe_cost), through ``generate`` with a DynamicCache; compiled on a first, untimed call."""
    from transformers import AttentionInterface, DynamicCache

    AttentionInterface.register("dense_flex_baseline", flash_flex_attention)
    model.set_attn_implementation("dense_flex_baseline")
    try:
        generate_s(model, ids, DynamicCache(config=model.config), 1, device, disable_compile=True)
        return generate_s(model, ids, DynamicCache(config=model.config), 1, device, disable_compile=True)[0]
    finally:
        model.set_attn_implementation("sdpa")


def e2e_rows(model, args, device: torch.device) -> Iterator[dict]:
    from transformers import StaticCache

    n, new = args.e2e_context, args.new_tokens
    cc = compile_config(device, args.compile_backend, args.tuned)
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(100, model.config.vocab_size - 1, (1, n), device=device, generator=gen)
    cfg = speed_config(decode_budget=args.budget, base_budget=args.prefill_budget,
                       probe_kernel=PROBE_KERNEL[args.probe_kernel], decode_kernel=args.decode_kernel)
    caches: dict = {}

    def serve(config: fe.EntropyConfig) -> fe.StaticLatentKVCache:
        """The one `StaticLatentKVCache` of ``config`` that serves every request of this part, reset: its buffers
        keep the addresses the warm-up recorded the decode step with."""
        if config not in caches:
            caches[config] = fe.StaticLatentKVCache(config, model=model, max_prompt_length=args.max_prompt_length)
        cache = caches[config]
        cache.reset()
        return cache

    def flexentropy_row(kind: str) -> dict:
        fe.enable(model, cfg, prefill="entropy")
        clock = StepClock(device)
        recorded = graphs_recorded(model)
        seconds, _ = generate_s(model, ids, serve(cfg), new, device, clock, compile_config=cc)
        return {"part": "e2e", "variant": f"flexentropy_{kind}{args.tag}", "n": n, "new_tokens": new,
                "total_s": seconds, "cuda_graphs_recorded": graphs_recorded(model) - recorded,
                **clock.summary(cfg.decode_delay), "density": prefill_density(model),
                "segment_size": cfg.segment_size, "probe_kernel": args.probe_kernel,
                "flash_attn": environment()["flash_attn"]}

    def run(fn: Callable[[], dict]) -> dict:
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - one failed row must not lose the others
            traceback.print_exc()
            return {"part": "e2e", "error": f"{type(err).__name__}: {err}"}

    if args.cold:
        torch._dynamo.reset()
        yield run(lambda: flexentropy_row("cold"))

    def warm() -> dict:
        fe.enable(model, cfg, prefill="entropy")
        t0 = time.perf_counter()
        times = fe.warm_up(model, args.warm_lengths, config=cfg, compile_config=cc, cache=serve(cfg))
        return {"part": "e2e", "variant": "warm_up" + args.tag, "total_s": time.perf_counter() - t0,
                "per_length_s": {str(k): v for k, v in times.items()}}

    yield run(warm)
    yield run(lambda: flexentropy_row("warm"))

    def profile() -> dict:
        """Where a decode step inside ``generate`` spends its time: the warm row's ``generate`` on a short prompt
        under torch.profiler, the top CPU-side functions written to ``OUT/generate_profile.txt``."""
        fe.enable(model, cfg, prefill="entropy")
        short = ids[:, : args.warm_lengths[0]]
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            seconds, _ = generate_s(model, short, serve(cfg), args.profile_steps, device, compile_config=cc)
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70)
        (Path(args.out) / "generate_profile.txt").write_text(table, encoding="utf-8")
        return {"part": "e2e", "variant": "generate_profile", "n": short.shape[1], "new_tokens": args.profile_steps,
                "total_s": seconds}

    if args.profile_steps:
        yield run(profile)

    def loop() -> dict:
        """The same request through `fe.greedy_generate` (a plain loop, as the dense row decodes), after
        ``fe.warm_up(..., loop=True)``; its TTFT from a second call of one token."""
        fe.enable(model, cfg, prefill="entropy")
        t0 = time.perf_counter()
        fe.warm_up(model, args.warm_lengths, config=cfg, compile_config=cc, loop=True, cache=serve(cfg))
        warm_s = time.perf_counter() - t0
        recorded = graphs_recorded(model)
        timed = {tokens: loop_s(model, ids, serve(cfg), tokens, device, cc) for tokens in (new, 1)}
        return {"part": "e2e", "variant": f"flexentropy_loop{args.tag}", "n": n, "new_tokens": new,
                "total_s": timed[new], "ttft_s": timed[1], "cuda_graphs_recorded": graphs_recorded(model) - recorded,
                "decode_step_ms": (timed[new] - timed[1]) / (new - 1) * 1e3, "warm_up_loop_s": warm_s,
                "density": prefill_density(model), "flash_attn": environment()["flash_attn"]}

    yield run(loop)

    def dense_lengths() -> dict:
        """Dense through flexentropy's own decode machinery (`dense_lengths_config`): SDPA prefill (its default
        backend), then every step captured, reading exactly the valid entries; a warm-up request of
        ``--warm-lengths[0]`` tokens compiles and records the step first (the buffers' shapes do not depend on the
        prompt)."""
        full = dense_lengths_config(cfg, n + new + 8)
        fe.enable(model, full, prefill="dense")
        generate_s(model, ids[:, :args.warm_lengths[0]], serve(full), 8, device, compile_config=cc)
        clock = StepClock(device)
        cache = serve(full)
        seconds, _ = generate_s(model, ids, cache, new, device, clock, compile_config=cc)
        return {"part": "e2e", "variant": "dense_lengths" + args.tag, "n": n, "new_tokens": new, "total_s": seconds,
                **clock.summary(0), "decode_kernel": "flash" if cache.flash else "sdpa"}

    yield run(dense_lengths)

    def dense() -> dict:
        """Best dense per phase: cuDNN SDPA prefill (eager, through generate), then the compiled static decode
        (SDPA flash first) continuing on the same StaticCache; the decode graph compiled and recorded beforehand on
        that cache (reset before the prompt)."""
        model.set_attn_implementation("sdpa")
        size = n + new + 8
        compiled = model.get_compiled_call(cc)
        with dense_backend(SDPBackend.FLASH_ATTENTION):
            cache = StaticCache(config=model.config, max_cache_len=size)
            fill(cache, model, 1, 16, device)
            t0 = time.perf_counter()
            with torch.no_grad():
                time_steps(step_fn(model, compiled, cache, 1, 16, device), device, 3, 1)
            compile_s = time.perf_counter() - t0
        cache.reset()   # the same buffers: the decode graph recorded on them replays (a new cache records again)
        with dense_backend(SDPBackend.CUDNN_ATTENTION):
            prefill_s, first = generate_s(model, ids, cache, 1, device, disable_compile=True)
        step = step_fn(model, compiled, cache, 1, n + 1, device)
        with dense_backend(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(new - 1):
                step()
            sync(device)
            decode_s = time.perf_counter() - t0
        del cache
        flash_s = flash_flex_prefill_s(model, ids, device) if flash_available() else None
        best = min(prefill_s, flash_s or prefill_s)
        return {"part": "e2e", "variant": "dense_best" + args.tag, "n": n, "new_tokens": new,
                "total_s": best + decode_s, "ttft_s": best, "ttft_cudnn_s": prefill_s, "ttft_flash_flex_s": flash_s,
                "decode_step_ms": decode_s / (new - 1) * 1e3, "compile_s": compile_s}

    yield run(dense)


def real_model_prompt(path: str, n: int, device: torch.device):
    """``(model, ids [1, ~n])``: a real model loaded offline (``--check-model``, bf16) and a prompt of about ``n``
    tokens of Paul Graham's essays asking for a summary, so that greedy tokens follow the model's own margins."""
    from bench.data import load_essays, prompt_ids
    from bench.loading import load_model

    model, tokenizer, _ = load_model(path, device=str(device), dtype="bfloat16")
    ids = prompt_ids(tokenizer, load_essays(), "Summarize the text above in a few sentences.", context_tokens=n)
    return model, torch.tensor([ids], device=device)


def checks_rows(llama: Callable[[], object], args, device: torch.device) -> Iterator[dict]:
    """The ``checks`` part's rows (``--checks``); ``llama()`` builds the Llama-shaped model on first use."""
    cc = compile_config(device, args.compile_backend)
    gen = torch.Generator(device=device).manual_seed(2)
    suffix = ""
    if args.check_model:  # identity and its dense control on a real model (the recompile check keeps the Llama shape)
        real, check_ids = real_model_prompt(args.check_model, args.check_prompt, device)
        suffix = "_" + real.config.model_type
    else:
        real = llama()
        check_ids = torch.randint(100, real.config.vocab_size - 1, (1, args.check_prompt), device=device,
                                  generator=gen)

    def agreement(variant: str, eager: list, captured: list) -> dict:
        first = next((i for i, (a, b) in enumerate(zip(eager, captured, strict=False)) if a != b), None)
        return {"part": "checks", "variant": variant + suffix, "n": check_ids.shape[1],
                "identical": eager == captured, "first_mismatch": first, "tokens": len(eager),
                **({"model": Path(args.check_model).name} if args.check_model else {})}

    eager = {"disable_compile": True}
    captured = {"compile_config": cc}

    def latent_tokens(model, **kwargs) -> list:
        # covering the short prompt and its tokens
        cfg = fe.EntropyConfig(decode_budget=8192, dense_prefix=8192, decode_kernel=args.decode_kernel)
        fe.enable(model, cfg, prefill="dense")
        return generate_s(model, check_ids, fe.StaticLatentKVCache(cfg, model=model), args.check_tokens, device,
                          **kwargs)[1]

    def dense_tokens(model, **kwargs) -> list:
        from transformers import StaticCache

        model.set_attn_implementation("sdpa")
        size = check_ids.shape[1] + args.check_tokens + 8
        return generate_s(model, check_ids, StaticCache(config=model.config, max_cache_len=size), args.check_tokens,
                          device, **kwargs)[1]

    def identity() -> dict:
        return agreement("greedy_identity_covering", latent_tokens(real, **eager), latent_tokens(real, **captured))

    def dense_control() -> dict:
        """The same identity check for dense (HF ``StaticCache``, eager against compiled): how far bf16 rounding of
        compiled kernels alone moves greedy tokens (of a random-weight model: near-tied logits)."""
        return agreement("greedy_identity_dense_control", dense_tokens(real, **eager), dense_tokens(real, **captured))

    def uncaptured() -> dict:
        """Captured (CUDA graphs) against the same compiled step without them (``mode="default"``): what the
        capture and the static buffers change, apart from compiled kernels' rounding."""
        plain = compile_config(device, args.compile_backend)
        plain.mode = "default"
        return agreement("greedy_identity_captured_vs_compiled", latent_tokens(real, compile_config=plain),
                         latent_tokens(real, **captured))

    def float32() -> dict:
        """Eager against captured in float32 (the model cast): rounding too small to flip a greedy choice."""
        real.float()
        try:
            latent = agreement("greedy_identity_covering_float32", latent_tokens(real, **eager),
                               latent_tokens(real, **captured))
            dense = agreement("greedy_identity_dense_control_float32", dense_tokens(real, **eager),
                              dense_tokens(real, **captured))
        finally:
            real.to(torch.bfloat16)
        return {**latent, "dense_control": {k: dense[k] for k in ("identical", "first_mismatch", "tokens")}}

    def recompiles(loop: bool = False) -> dict:
        """Graphs compiled after one warm-up across ``--check-lengths`` (``--long-steps`` steps at the first),
        through ``generate`` or (``loop``) `fe.greedy_generate`."""
        model = llama()
        vocab = model.config.vocab_size - 1
        cfg = speed_config(decode_budget=args.budget, probe_kernel=PROBE_KERNEL[args.probe_kernel],
                           decode_kernel=args.decode_kernel)
        fe.enable(model, cfg, prefill="entropy")
        serving = fe.StaticLatentKVCache(cfg, model=model)
        fe.warm_up(model, args.warm_lengths, config=cfg, compile_config=cc, loop=loop, cache=serving)
        graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        recorded = graphs_recorded(model)
        per_length = {}
        for length in args.check_lengths:
            ids = torch.randint(100, vocab, (1, length), device=device, generator=gen)
            steps = args.long_steps if length == args.check_lengths[0] else 8
            # the serving cache reset, or (--new-cache) a new cache per request: new addresses
            cache = fe.StaticLatentKVCache(cfg, model=model) if args.new_cache else serving
            cache.reset()
            seconds = (loop_s(model, ids, cache, steps, device, cc) if loop
                       else generate_s(model, ids, cache, steps, device, compile_config=cc)[0])
            per_length[str(length)] = {"steps": steps, "seconds": seconds, "cache_gib": cache.nbytes() / 2**30,
                                       "graphs_since_warm_up":
                                           int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - graphs,
                                       "cuda_graphs_recorded_since_warm_up": graphs_recorded(model) - recorded}
        return {"part": "checks", "variant": "recompiles_after_warm_up" + ("_loop" if loop else "")
                + ("_new_cache" if args.new_cache else ""),
                "per_length": per_length,
                "graphs_compiled": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - graphs,
                "cuda_graphs_recorded": graphs_recorded(model) - recorded}

    checks = {"identity": identity, "dense_control": dense_control, "uncaptured": uncaptured, "float32": float32,
              "recompiles": recompiles, "recompiles_loop": functools.partial(recompiles, loop=True)}
    for name in args.checks:
        try:
            yield checks[name]()
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            yield {"part": "checks", "variant": name, "error": f"{type(err).__name__}: {err}"}


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    decode = [r for r in rows if r.get("part") == "decode" and "step_ms" in r]
    if not decode:
        return
    cases = sorted({(r["batch"], r["n"]) for r in decode})
    variants = sorted({r["variant"] for r in decode},
                      key=lambda v: (VARIANTS.index(v) if v in VARIANTS else len(VARIANTS), v))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        values = [next((r["step_ms"] for r in decode if (r["batch"], r["n"]) == c and r["variant"] == variant), 0)
                  for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], values, width, label=variant)
    for j, case in enumerate(cases):
        limit = min(r["limit_ms"] for r in decode if (r["batch"], r["n"]) == case)
        for factor, style in ((1, "dotted"), (1.5, "dashed")):
            ax.hlines(factor * limit, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles=style)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], [f"B{b} {n // 1024}k" for b, n in cases])
    ax.set_ylabel("decode step ms")
    ax.set_title("decode step (dotted: latent bytes / 4.3 TB/s; dashed: 1.5x that)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def plot_runs(paths: list[Path], path: Path) -> None:
    """The captured step's rows (``static_latent_captured*``) of several runs' JSON side by side, each labelled by
    its file's stem."""
    rows = []
    for run in paths:
        decode = [r for r in json.loads(run.read_text())["rows"]
                  if r.get("part") == "decode" and r.get("variant", "").startswith("static_latent_captured")]
        rows += [dict(r, variant=run.stem if len({d["variant"] for d in decode}) == 1 else f"{run.stem} {r['variant']}")
                 for r in decode]
    plot(rows, path)


def table(rows: list[dict]) -> None:
    print(f"\n{'part':>7} {'variant':>26} {'B':>2} {'N':>7} {'step ms':>8} {'limit ms':>8} {'x limit':>7} "
          f"{'total s':>8}  notes")
    for r in rows:
        notes = r.get("error") or {k: (round(r[k], 3) if isinstance(r[k], float) else r[k]) for k in (
            "identical", "first_mismatch", "graphs_compiled", "ttft_s", "decode_step_ms", "decode_kernel",
            "gpu_busy_ms") if r.get(k) is not None}
        print(f"{r.get('part', ''):>7} {r.get('variant', ''):>26} {r.get('batch', ''):>2} {r.get('n', ''):>7} "
              f"{r.get('step_ms', float('nan')):8.2f} {r.get('limit_ms', float('nan')):8.2f} "
              f"{r.get('x_limit', float('nan')):7.2f} {r.get('total_s', float('nan')):8.2f}  {notes or ''}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="decode,e2e,checks")
    p.add_argument("--contexts", type=int, nargs="*", default=[32768, 65536, 131072])
    p.add_argument("--batch8", type=int, nargs="*", default=[32768], help="contexts run at batch 8")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--prefill-budget", type=int, default=2048,
                   help="e2e: B_0 of the fixed prefill budgets (2048: density 0.070 at 128k on this model; a real "
                        "model's attention sets the default's density, 0.097 on Qwen2.5-Coder-1.5B at 128k); another "
                        "value adds _b0N to the e2e rows' variants")
    p.add_argument("--e2e-context", type=int, default=131072)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-length", type=int, default=None,
                   help="e2e: serve with StaticLatentKVCache(max_prompt_length=...): the phase-1 steps captured in "
                        "prompt buffers (e.g. the --e2e-context; default: phase 1 eager)")
    p.add_argument("--profile-steps", type=int, default=64,
                   help="e2e: profile a generate of this many tokens on a short prompt after the warm row (0: skip)")
    p.add_argument("--no-cold", dest="cold", action="store_false",
                   help="e2e: skip the cold row (the first call of the process, ~90 s at 128k on the H200)")
    p.add_argument("--warm-lengths", type=int, nargs="+", default=[8192, 12345])
    p.add_argument("--check-prompt", type=int, default=2048)
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--check-lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    p.add_argument("--long-steps", type=int, default=1000)
    checks = ["identity", "dense_control", "uncaptured", "float32", "recompiles", "recompiles_loop"]
    p.add_argument("--checks", nargs="+", choices=checks, default=checks)
    p.add_argument("--new-cache", action="store_true",
                   help="checks: recompiles: serve each request with a new StaticLatentKVCache (new buffer addresses) "
                        "instead of the warmed cache reset: the cost of new addresses")
    p.add_argument("--check-model", default=None,
                   help="checks: run identity and dense_control on this real model (a .gguf file, a model folder or "
                        "an alias of bench.models) with an essay prompt of --check-prompt tokens; their "
                        "variants get the model type as a suffix")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--tuned", action="store_true",
                   help="compile with coordinate-descent tuning (TUNED) on CUDA, dense and flexentropy alike; "
                        "the rows' variants get the suffix _tuned")
    p.add_argument("--freeze", action="store_true",
                   help="compile with inductor's freezing (weights as constants: q/k/v and gate/up each become one "
                        "matrix product, at the cost of a fused copy of those weights), dense and flexentropy "
                        "alike; the rows' variants get the suffix _frozen")
    p.add_argument("--profile-decode", action="store_true",
                   help="decode: profile 10 captured steps of static_latent_captured (OUT/decode_profile_*.txt)")
    p.add_argument("--probe-kernel", choices=list(PROBE_KERNEL), default="auto",
                   help="e2e and checks: EntropyConfig.probe_kernel (auto: the library's default, the kernel on CUDA)")
    p.add_argument("--fuse", action="store_true",
                   help="fe.fuse_projections on the model (q/k/v and gate/up as one product each), dense and "
                        "flexentropy alike; the rows' variants get the suffix _fused")
    p.add_argument("--decode-kernel", choices=["auto", "sdpa", "flash"], default="auto",
                   help="EntropyConfig.decode_kernel of the static latent cache (auto: flash-attn-4's where it can "
                        "run); other than auto, the rows' variants get it as a suffix")
    p.add_argument("--out", default="docs/results/decode_static")
    p.add_argument("--compare", type=Path, nargs="+", default=None,
                   help="only plot the captured step of these runs' JSON side by side "
                        "(OUT/decode_static_compare.png)")
    args = p.parse_args(argv)
    if args.compare:
        plot_runs(args.compare, Path(args.out) / "decode_static_compare.png")
        return
    default_budget = p.get_default("prefill_budget")
    args.tag = ("_tuned" if args.tuned else "") + ("_frozen" if args.freeze else "") + (
        "_fused" if args.fuse else "") + (
        f"_b0{args.prefill_budget}" if args.prefill_budget != default_budget else "") + (
        f"_{args.decode_kernel}" if args.decode_kernel != "auto" else "") + (
        "_p1_captured" if args.max_prompt_length else "")
    torch._inductor.config.freezing = args.freeze
    device = torch.device(args.device)
    out = Path(args.out)
    path = out / "decode_static.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    def model():
        built = build_model(args.layers, device, args.tiny)
        if args.fuse:
            fe.fuse_projections(built)
        return built

    llama = functools.cache(model)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def keep(row: dict) -> None:
        key = (row.get("part"), row.get("variant"), row.get("batch"), row.get("n"))
        rows[:] = [r for r in rows if (r.get("part"), r.get("variant"), r.get("batch"), r.get("n")) != key] + [row]
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        write_json(path, {"benchmark": "decode_static", "model": "Llama-3.1-8B shape, random weights, bf16",
                          "layers": args.layers, "environment": environment(), "rows": rows})

    parts = set(args.parts.split(","))
    if "decode" in parts:
        cases = [(1, n) for n in args.contexts] + [(8, n) for n in args.batch8]
        for batch, n in cases:
            for variant in args.variants:
                try:
                    keep(decode_row(llama(), variant, batch, n, args, device))
                except Exception as err:  # noqa: BLE001
                    traceback.print_exc()
                    keep({"part": "decode", "variant": variant, "batch": batch, "n": n,
                          "error": f"{type(err).__name__}: {err}"})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if "e2e" in parts:
        for row in e2e_rows(llama(), args, device):
            keep(row)
    if "checks" in parts:
        for row in checks_rows(llama, args, device):
            keep(row)
    plot(rows, out / "decode_static.png")
    table(rows)


if __name__ == "__main__":
    main()
