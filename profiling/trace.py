"""``torch.profiler`` traces of one sparse prefill and one latent-cache decode step (one attention layer).

    python profiling/trace.py --device cuda --n 131072 --out docs/results/traces
    tensorboard --logdir docs/results/traces        # needs torch-tb-profiler (the `profiling` extra)

Writes one TensorBoard trace per phase (``prefill``, ``decode``) and prints the top operators by self time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import attention_inputs, sync  # noqa: E402

import flexentropy as fe  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", type=int, default=131072)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="docs/results/traces")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    q, k, v = attention_inputs(1, args.hq, args.hkv, args.n, args.dim, dtype, device, kind="structured")
    cfg = fe.EntropyConfig(decode_delay=1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    fe.sparse_prefill_attention(q, k, v, cfg)          # warm-up: compile the selection and kernel graphs
    sync(device)
    with profile(activities=activities, on_trace_ready=tensorboard_trace_handler(f"{args.out}/prefill", use_gzip=True),
                 record_shapes=True) as prof, record_function("flexentropy.sparse_prefill"):
        fe.sparse_prefill_attention(q, k, v, cfg)
        sync(device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total" if device.type == "cpu"
                                    else "self_device_time_total", row_limit=12))

    cache = fe.LatentKVCache(cfg)
    cache.observe_queries(q, 0)
    cache.update(k, v, 0)
    step = torch.randn(1, args.hq, 1, args.dim, device=device, dtype=dtype)
    step_kv = torch.randn(1, args.hkv, 1, args.dim, device=device, dtype=dtype)
    for _ in range(2):                                   # first step appends, second evicts to decode_budget
        cache.observe_queries(step, 0)
        keys, values = cache.update(step_kv, step_kv, 0)
    fe.decode_attention(step, keys, values)
    sync(device)
    with profile(activities=activities, on_trace_ready=tensorboard_trace_handler(f"{args.out}/decode", use_gzip=True),
                 record_shapes=True) as prof, record_function("flexentropy.decode_step"):
        cache.observe_queries(step, 0)
        keys, values = cache.update(step_kv, step_kv, 0)
        fe.decode_attention(step, keys, values)
        sync(device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total" if device.type == "cpu"
                                    else "self_device_time_total", row_limit=12))
    print(f"stored entries after eviction: {cache.stored_length(0)} of {cache.get_seq_length(0)} tokens")


if __name__ == "__main__":
    main()
