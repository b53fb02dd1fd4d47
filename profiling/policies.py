"""Every policy of `flexentropy.policies` at the layer level, by name: prefill plan + kernel, cache decode steps.

One attention layer of the Llama-3.1-8B shape by default (B=1, 32 query heads, 8 KV heads, D=128, bf16).

- prefill: for each ``--prefill`` policy and context N, the plan's time, its density (computed / causal blocks)
  and the attention time (plan + kernel; compiled flex, dense plans by SDPA), on ``--inputs`` random or structured
  q/k/v (`common.attention_inputs`);
- cache: for each ``--cache`` policy, an N-token prompt through the cache (update + query hand-over + random model
  signals for InfoKV/bounded), then ``--steps`` decode steps of one token (hand-over, update with any eviction,
  ``cache.attend``); median per-token ms, the slowest step (an eviction), entries per KV head and the real bytes
  held (``cache.nbytes()``).

    python profiling/policies.py --contexts 32768 --out docs/results/policies_h200.json
    python profiling/policies.py --device cpu --dtype fp32 --contexts 4096 --q-heads 8 --kv-heads 2 --steps 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from common import attention_inputs, environment, speed_config, sync, time_ms, write_json  # noqa: E402

from flexentropy.caches import make_cache  # noqa: E402
from flexentropy.config import EntropyConfig  # noqa: E402
from flexentropy.policies import CACHE_POLICIES, PREFILL_POLICIES, make_prefill  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def prefill_row(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: EntropyConfig,
                device: torch.device) -> dict:
    policy = make_prefill(name, config)
    plan = policy.plan(q, k, 1)
    return {"policy": name, "context": q.shape[2], "density": plan.density,
            "plan_ms": time_ms(lambda: policy.plan(q, k, 1), device),
            "attention_ms": time_ms(lambda: policy.attention(q, k, v, 1), device, warmup=1, reps=3)}


def cache_row(name: str, args: argparse.Namespace, context: int, device: torch.device) -> dict:
    dtype = DTYPES[args.dtype]
    shape = (args.batch, args.kv_heads, 1, args.head_dim)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    knobs = {"full": {}, "bounded": {"anchors": args.budget // 2, "recent": args.budget // 2}}
    cache = make_cache(name, num_layers=32, **knobs.get(name, {"budget": args.budget}))
    signals = cache.policy.needs_signals
    q, k, v = attention_inputs(args.batch, args.q_heads, args.kv_heads, context, args.head_dim, dtype, device,
                               args.inputs)
    cache.update(k, v, 0)
    cache.observe_queries(q, 0)
    if signals:
        cache.layers[0].record_signal(torch.rand(args.batch, context, generator=gen, device=device))

    def step() -> None:
        query = randn(args.batch, args.q_heads, 1, args.head_dim)
        cache.update(randn(*shape), randn(*shape), 0)
        cache.observe_queries(query, 0)
        if signals:
            cache.layers[0].record_signal(torch.rand(args.batch, 1, generator=gen, device=device))
        cache.attend(query, 0)

    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return {"policy": name, "context": context, "median_ms": statistics.median(times), "max_ms": max(times),
            "stored_per_head": cache.stored_length(0), "nbytes": cache.nbytes(),
            "evictions": cache.layers[0].evictions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", nargs="*", default=list(PREFILL_POLICIES), choices=list(PREFILL_POLICIES))
    parser.add_argument("--cache", nargs="*", default=list(CACHE_POLICIES), choices=list(CACHE_POLICIES))
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--inputs", choices=("random", "structured"), default="structured")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--budget", type=int, default=1024, help="cache entries per KV head (mean, for PyramidKV)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = speed_config()
    rows: dict[str, list[dict]] = {"prefill": [], "cache": []}
    for context in args.contexts:
        q, k, v = attention_inputs(args.batch, args.q_heads, args.kv_heads, context, args.head_dim,
                                   DTYPES[args.dtype], device, args.inputs)
        for name in args.prefill:
            rows["prefill"].append(prefill_row(name, q, k, v, config, device))
            print(rows["prefill"][-1], flush=True)
        for name in args.cache:
            rows["cache"].append(cache_row(name, args, context, device))
            print(rows["cache"][-1], flush=True)
    if args.out is not None:
        write_json(args.out, {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()},
                              **rows})


if __name__ == "__main__":
    main()
