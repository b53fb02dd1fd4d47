"""Per-token decode latency and KV memory: dense caches vs latent eviction (design.md §2, paper sec. 4.3 / Alg. 4).

One attention layer of the Llama-3.1-8B shape by default (B=1, 32 query heads, 8 KV heads, D=128, bf16), random
N(0, 1) inputs. For each context length N the cache is filled with N prompt tokens, then every timed step appends
one token and attends (``flexentropy.decode_attention``, SDPA with GQA) over:

- ``dense-dynamic``: transformers' ``DynamicCache``, what ``generate`` uses by default (concatenates per token);
- ``dense-static``: a preallocated buffer written in place, attention over its filled prefix (dense at its best);
- ``latent``: ``LatentKVCache`` after its eviction to ``--budget`` entries per KV head (decode_delay tokens in);
  the step includes the query hand-over. ``evict_ms`` is the one step that evicts.

Per-token latency is the median over ``--steps`` (>= 100) steps after ``--warmup``, the steps running back to back
with CUDA events between them (``time.perf_counter`` on CPU). KV bytes: the stored keys and values after the timed
steps (for ``dense-static``, its whole preallocated buffers).

    python profiling/decode_latency.py --contexts 32768 131072 --out docs/results/decode_latency.json
    python profiling/decode_latency.py --device cpu --contexts 2048 4096
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from flexentropy.caches import LatentKVCache  # noqa: E402
from flexentropy.config import EntropyConfig  # noqa: E402
from flexentropy.kv import decode_attention  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_steps(steps: list[Callable[[], object]], device: torch.device) -> list[float]:
    """Milliseconds of each of ``steps``, run back to back as a decode loop runs.

    On a GPU, CUDA events are recorded between consecutive steps, so a step's time is the GPU timeline from the end
    of the previous step to its own end: its kernels, plus any launch gap when the CPU is the bottleneck. The events
    are created (recorded once) before the loop: creating one inside it can cost tens of ms on some machines.
    On CPU, ``time.perf_counter`` between steps.
    """
    if device.type != "cuda":
        marks = [time.perf_counter()]
        for step in steps:
            step()
            marks.append(time.perf_counter())
        return [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
    for event in events:
        event.record()
    torch.cuda.synchronize()
    events[0].record()
    for step, event in zip(steps, events[1:], strict=True):
        step()
        event.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in itertools.pairwise(events)]


class DenseDynamic:
    """transformers ``DynamicCache``: ``torch.cat`` of the whole cache per token."""

    name = "dense-dynamic"

    def __init__(self, args: argparse.Namespace, context: int, extra: int) -> None:
        self.cache = DynamicCache()

    def fill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.update(k, v, 0)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.cache.update(k, v, 0)
        return decode_attention(q, keys, values)

    def stored(self) -> tuple[int, int]:
        layer = self.cache.layers[0]
        return layer.keys.shape[2], layer.keys.nbytes + layer.values.nbytes


class DenseStatic:
    """Preallocated ``[B, Hkv, N + steps, D]`` buffers written in place; attention over the filled prefix."""

    name = "dense-static"

    def __init__(self, args: argparse.Namespace, context: int, extra: int) -> None:
        shape = (args.batch, args.kv_heads, context + extra, args.head_dim)
        self.keys = torch.empty(shape, dtype=DTYPES[args.dtype], device=args.device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def fill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys[:, :, : k.shape[2]] = k
        self.values[:, :, : v.shape[2]] = v
        self.length = k.shape[2]

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys[:, :, self.length : self.length + 1] = k
        self.values[:, :, self.length : self.length + 1] = v
        self.length += 1
        return decode_attention(q, self.keys[:, :, : self.length], self.values[:, :, : self.length])

    def stored(self) -> tuple[int, int]:
        return self.length, self.keys.nbytes + self.values.nbytes  # the buffers are held in full


class Latent:
    """``LatentKVCache`` (hand-over + update + attention per token), evicted to the budget."""

    name = "latent"

    def __init__(self, args: argparse.Namespace, context: int, extra: int) -> None:
        self.cache = LatentKVCache(EntropyConfig(decode_budget=args.budget, decode_window=args.window,
                                                 decode_delay=args.delay))

    def fill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.observe_queries(q, 0)
        self.cache.update(k, v, 0)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.observe_queries(q, 0)
        keys, values = self.cache.update(k, v, 0)
        return decode_attention(q, keys, values)

    def stored(self) -> tuple[int, int]:
        layer = self.cache.layers[0]
        return layer.stored, layer.keys.nbytes + layer.values.nbytes


POLICIES = (DenseDynamic, DenseStatic, Latent)


def measure(policy: type, context: int, args: argparse.Namespace) -> dict:
    """Fill ``policy``'s cache with ``context`` random tokens, then time ``args.steps`` decode steps."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    batch, q_heads, kv_heads, dim = args.batch, args.q_heads, args.kv_heads, args.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    lead = args.delay + 1  # untimed steps: up to and including the latent cache's eviction
    total = lead + args.warmup + args.steps
    runner = policy(args, context, total)
    runner.fill(randn(batch, q_heads, context, dim), randn(batch, kv_heads, context, dim),
                randn(batch, kv_heads, context, dim))
    qs, ks, vs = randn(total, batch, q_heads, 1, dim), randn(total, batch, kv_heads, 1, dim), \
        randn(total, batch, kv_heads, 1, dim)
    millis = time_steps([functools.partial(runner.step, qs[i], ks[i], vs[i]) for i in range(total)], device)
    timed = sorted(millis[lead + args.warmup :])
    stored, kv_bytes = runner.stored()
    result = {
        "context": context, "cache": policy.name, "median_ms": statistics.median(timed),
        "p10_ms": timed[len(timed) // 10], "p90_ms": timed[(9 * len(timed)) // 10], "stored": stored,
        "kv_bytes": kv_bytes,
    }
    if policy is Latent:
        result["evict_ms"] = millis[lead - 1]
        result["evictions"] = runner.cache.layers[0].evictions
        result["cache_nbytes"] = runner.cache.nbytes()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--budget", type=int, default=1024, help="decode_budget B_d")
    parser.add_argument("--window", type=int, default=32, help="decode_window N_W")
    parser.add_argument("--delay", type=int, default=16, help="decode_delay N_D")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps (>= 100)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 100:
        parser.error(f"--steps must be >= 100, got {args.steps}")

    device = torch.device(args.device)
    measure(Latent, 2 * args.budget, args)  # untimed: first-use kernel loading stays out of the first evict_ms
    results = []
    for context in args.contexts:
        for policy in POLICIES:
            results.append(measure(policy, context, args))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the previous cache is gone: give its memory back before the next fill
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "shape": {"batch": args.batch, "q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
        "latent": {"decode_budget": args.budget, "decode_window": args.window, "decode_delay": args.delay},
        "steps": args.steps,
        "warmup": args.warmup,
        "timing": "CUDA events between back-to-back steps" if device.type == "cuda" else "perf_counter per step",
        "results": results,
    }
    print(f"{report['device']}, torch {report['torch']}, {args.dtype}, B={args.batch} Hq={args.q_heads} "
          f"Hkv={args.kv_heads} D={args.head_dim}, budget {args.budget}")
    print(f"{'context':>8} {'cache':>14} {'median ms':>10} {'p90 ms':>8} {'stored':>8} {'KV MiB':>9}  note")
    for r in results:
        note = f"evict step {r['evict_ms']:.2f} ms" if "evict_ms" in r else ""
        print(f"{r['context']:>8} {r['cache']:>14} {r['median_ms']:>10.3f} {r['p90_ms']:>8.3f} {r['stored']:>8} "
              f"{r['kv_bytes'] / 2**20:>9.1f}  {note}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
