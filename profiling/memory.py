"""Peak memory of one request (issue 57): dense ``generate`` against each flexentropy path, on a Llama-3.1-8B-shaped
model (random bf16 weights, `fe.fuse_projections`, as the other scripts).

    python profiling/memory.py --out docs/results/memory/memory.json

For each part (``--parts``) and prompt length (``--lengths``): one greedy request of that many random tokens and
``--new-tokens`` new ones (past the first eviction and a recompression), after an untimed request that compiles what
the path compiles, and its peak from torch's allocator (``max_memory_allocated`` and ``max_memory_reserved`` after
``reset_peak_memory_stats``), beside what was allocated before it (the weights, and what the path keeps across
requests) and after it. Parts:

* ``dense``: transformers' SDPA attention over a ``DynamicCache``, MLPs whole (no `fe.chunk_mlp`): what a user runs;
* ``latent``: ``fe.enable(model, cfg)`` at its defaults (its MLP chunks included), ``generate`` with a
  `LatentKVCache`;
* ``static``: the same with `StaticLatentKVCache(cfg, model=model, max_prompt_length=N)` after
  ``fe.warm_up(model, --warm-lengths, cache=cache)``: its buffers and recorded steps count in the peak;
* ``batch``: ``fe.generate_batch(model, [ids], new, rows=1, cache=...)``: the prompt prefilled alone and evicted at
  the end of each layer's attention (``decode_delay=0``), then decoded by the recorded batched step.

The dense part runs first, on the model before ``fe.enable``. ``cfg`` is the speed benchmarks' (fixed prefill budgets,
``--prefill-budget``: density ~0.09 at 128k). Each row is written to ``--out`` as it completes; a request that runs
out of memory writes a row with the error and the run goes on (``torch.cuda.empty_cache()`` between rows).
``--snapshot FILE`` records ``torch.cuda.memory``'s allocation history around one request (of ``--snapshot-part``,
default static, at ``--snapshot-length`` tokens, default its first) and writes it gzip-compressed, cut to its latest
events until it is under 16 MiB (gunzip it and open it in torch's memory_viz). ``--device cpu --tiny`` checks the
harness on a small model: the CPU allocator keeps no statistics, so its peaks are absent and only the caches' bytes
are read.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, speed_config, sync, write_json  # noqa: E402
from end_to_end import build_model  # noqa: E402

import flexentropy as fe  # noqa: E402
from flexentropy.integrations.hf import attention_modules, cache_keyword, layer_state  # noqa: E402
from flexentropy.surgery.chunked_mlp import chunked_tokens  # noqa: E402

PARTS = ("dense", "latent", "static", "batch")
GIB = 2**30
SNAPSHOT_LIMIT = 16 * 2**20
"""Most bytes of the compressed snapshot (what a device run brings back)."""


def gib(value: float | None) -> float | None:
    return None if value is None else value / GIB


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of one token's keys and values over every layer (a dense cache's growth per token)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * model.dtype.itemsize


def plan_bytes(model: Any) -> int:
    """Bytes of the prefill plans the model's attention modules keep (``fe.enable(keep_plans=True)``, the default)."""
    plans = [plan for module in attention_modules(model) for plan in layer_state(module).plans if plan is not None]
    return sum(plan.blocks.numel() * plan.blocks.element_size() for plan in plans)


def cache_bytes(cache: Any) -> int | None:
    """Bytes a cache holds after the request: a `StaticLatentKVCache`'s buffers (kept across requests) and layers,
    another flexentropy cache's own count, a transformers cache's keys and values."""
    if hasattr(cache, "static"):
        return cache.static.nbytes() + cache.dynamic.nbytes()
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    layers = getattr(cache, "layers", [])
    return sum(t.numel() * t.element_size() for layer in layers for t in (getattr(layer, "keys", None),
                                                                        getattr(layer, "values", None))
               if isinstance(t, torch.Tensor))


def clean(device: torch.device) -> None:
    """Free what the previous row left (the allocator's cache included) and start the peak statistics afresh."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


class Snapshot:
    """``torch.cuda.memory``'s allocation history around one request, written gzip-compressed to ``path``."""

    def __init__(self, path: Path | None, part: str, length: int | None, entries: int) -> None:
        self.path, self.part, self.length, self.entries, self.done = path, part, length, entries, False

    def wanted(self, part: str, n: int, device: torch.device) -> bool:
        """Whether the request of ``part`` at ``n`` tokens is the one to record (the first that matches)."""
        return (self.path is not None and not self.done and part == self.part and self.length in (None, n)
                and device.type == "cuda")

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=self.entries, stacks="python")

    def stop(self) -> dict:
        """Write what was recorded (its latest events, as many as fit `SNAPSHOT_LIMIT` compressed); the row's
        fields."""
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.done = True
        traces = snapshot.get("device_traces", [])
        kept = max((len(trace) for trace in traces), default=0)
        while True:
            data = gzip.compress(pickle.dumps({**snapshot, "device_traces": [trace[-kept:] if kept else []
                                                                             for trace in traces]}))
            if len(data) <= SNAPSHOT_LIMIT or kept == 0:
                break
            kept //= 2
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(data)
        return {"snapshot": str(self.path), "snapshot_mib": len(data) / 2**20, "snapshot_events": kept}


def measure(part: str, n: int, device: torch.device, request: Callable[[], Any], snapshot: Snapshot,
            extra: Callable[[Any], dict] | None = None) -> dict:
    """One request's row: its peak memory from a clean allocator (module docstring), what it left, its seconds; an
    out-of-memory error as the row's ``error``. ``request()`` returns the cache it ran on (``extra`` reads it)."""
    row: dict[str, Any] = {"part": part, "n": n}
    clean(device)
    before = allocated(device)
    recording = snapshot.wanted(part, n, device)
    if recording:
        snapshot.start()
    try:
        start = time.perf_counter()
        cache = request()
        sync(device)
        row["seconds"] = time.perf_counter() - start
        row.update(extra(cache) if extra is not None else {})
        row["cache_gib"] = gib(cache_bytes(cache))
        del cache
    except torch.OutOfMemoryError as err:
        row["error"] = f"out of memory: {err}"[:600]
    if recording:
        row.update(snapshot.stop())
    if device.type == "cuda":
        row.update(peak_allocated_gib=gib(torch.cuda.max_memory_allocated(device)),
                   peak_reserved_gib=gib(torch.cuda.max_memory_reserved(device)),
                   before_gib=gib(before), after_gib=gib(allocated(device)))
    clean(device)
    return row


def generate(model: Any, ids: torch.Tensor, cache: Any, new: int) -> Any:
    """A greedy ``generate`` of ``new`` tokens over ``cache`` (returned)."""
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, **{cache_keyword(model): cache})
    return cache


def rows_of(part: str, model: Any, lengths: list[int], args: argparse.Namespace, device: torch.device,
            snapshot: Snapshot) -> Any:
    """The part's rows, one per length (module docstring)."""
    from transformers import DynamicCache

    cfg = speed_config(base_budget=args.prefill_budget)
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)

    def prompt(length: int) -> torch.Tensor:
        return torch.randint(100, vocab - 1, (1, length), generator=gen).to(device)

    def flexentropy_fields(cache: Any) -> dict:
        evictions = cache.evictions if part == "static" else cache.layers[0].evictions if part == "latent" else None
        return {"mlp_chunk": chunked_tokens(model), "plans_gib": gib(plan_bytes(model)), "evictions": evictions}

    if part == "dense":
        fe.disable(model)
        model.set_attn_implementation("sdpa")
        generate(model, prompt(args.warm_lengths[0]), DynamicCache(config=model.config), 2)
        for n in lengths:
            yield {**measure(part, n, device, lambda n=n: generate(model, prompt(n), DynamicCache(config=model.config),
                                                                  args.new_tokens), snapshot),
                   "mlp_chunk": chunked_tokens(model)}
        return
    fe.enable(model, cfg)
    if part == "latent":
        for length in args.warm_lengths:
            generate(model, prompt(length), fe.LatentKVCache(cfg), 2)
        for n in lengths:
            yield measure(part, n, device, lambda n=n: generate(model, prompt(n), fe.LatentKVCache(cfg),
                                                                args.new_tokens), snapshot, flexentropy_fields)
    elif part == "static":
        for n in lengths:
            try:
                cache = fe.StaticLatentKVCache(cfg, model=model, max_prompt_length=n)
                fe.warm_up(model, args.warm_lengths, cache=cache)
            except torch.OutOfMemoryError as err:   # the prompt buffers of n tokens beside the warm-up's requests
                yield {"part": part, "n": n, "error": f"warm-up: out of memory: {err}"[:600]}
                cache = None
                clean(device)
                continue

            def request(n: int = n, cache: Any = cache) -> Any:
                cache.reset()
                return generate(model, prompt(n), cache, args.new_tokens)

            yield {**measure(part, n, device, request, snapshot, flexentropy_fields), "max_prompt_length": n}
            del cache, request
    else:
        cache = fe.StaticLatentKVCache(cfg.replace(decode_delay=0), model=model)
        fe.generate_batch(model, [prompt(args.warm_lengths[0])[0]], args.new_tokens, rows=1, cache=cache)

        def batch(n: int) -> Any:
            with torch.no_grad():
                fe.generate_batch(model, [prompt(n)[0]], args.new_tokens, rows=1, cache=cache)
            return cache

        for n in lengths:
            yield {**measure(part, n, device, lambda n=n: batch(n), snapshot, flexentropy_fields), "rows": 1}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 262144])
    p.add_argument("--new-tokens", type=int, default=64,
                   help="tokens per request (the default passes the first eviction and a recompression)")
    p.add_argument("--warm-lengths", type=int, nargs="+", default=[8192, 12345],
                   help="the untimed requests that compile (fe.warm_up's lengths for the static part)")
    p.add_argument("--prefill-budget", type=int, default=3328, help="B_0 of the fixed prefill budgets")
    p.add_argument("--snapshot", type=Path, default=None, help="write the allocation history of one request here")
    p.add_argument("--snapshot-part", default="static", choices=PARTS)
    p.add_argument("--snapshot-length", type=int, default=None, help="the request recorded (default: the first)")
    p.add_argument("--snapshot-entries", type=int, default=200000, help="most allocation events recorded")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small model of the same family, for a quick CPU check")
    p.add_argument("--out", default="docs/results/memory/memory.json")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    device, out = torch.device(args.device), Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    model = build_model(args.layers, device, args.tiny)
    fe.fuse_projections(model)
    snapshot = Snapshot(args.snapshot, args.snapshot_part, args.snapshot_length, args.snapshot_entries)
    header = {"benchmark": "memory", "model": "Llama-3.1-8B shape, random weights, bf16, fe.fuse_projections",
              "layers": args.layers, "new_tokens": args.new_tokens,
              "weights_gib": gib(sum(t.numel() * t.element_size() for t in model.parameters())),
              "kv_gib_per_1k_tokens": gib(1024 * kv_bytes_per_token(model)),
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    for part in sorted(parts, key=PARTS.index):   # dense first, on the model before fe.enable
        try:
            for row in rows_of(part, model, args.lengths, args, device, snapshot):
                rows.append({**row, "new_tokens": args.new_tokens, "kv_gib": gib(row["n"] * kv_bytes_per_token(model))})
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
                write_json(out, {**header, "environment": environment(), "rows": rows})
        except Exception as err:  # noqa: BLE001 - one failed part must not lose the others
            traceback.print_exc()
            rows.append({"part": part, "error": f"{type(err).__name__}: {err}"[:600]})
            write_json(out, {**header, "environment": environment(), "rows": rows})
        clean(device)


if __name__ == "__main__":
    main()
