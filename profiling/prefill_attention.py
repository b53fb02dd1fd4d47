"""One attention layer's prefill: flexentropy sparse prefill vs dense baselines, stage by stage.

Llama-3.1-8B attention shape by default (32 q heads, 8 kv heads, D 128, bf16, causal, B 1).

    python profiling/prefill_attention.py --contexts 32768 131072 --out docs/results/prefill_attention.json

Times (median, CUDA events, after warm-up): cuDNN SDPA, SDPA flash, compiled dense flex; flexentropy's stages
(observation attention, entropy, budgets, block table, BlockMask tensors, sparse kernel) and the whole
`sparse_prefill_attention` call. Reports density and TFLOP/s on the blocks actually computed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from unittest.mock import patch

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PROBE_KERNEL,
    attention_inputs,
    causal_block_mask,
    dense_flex,
    environment,
    speed_config,
    time_ms,
    write_json,
)

import flexentropy as fe  # noqa: E402
from flexentropy import observation_attention  # noqa: E402
from flexentropy.policies.base import attend  # noqa: E402
from flexentropy.policies.prefill.entropy import probe_mass  # noqa: E402
from flexentropy.policies.prefill.entropy.budgets import allocate_budgets  # noqa: E402
from flexentropy.policies.prefill.entropy.entropies import segment_entropy  # noqa: E402
from flexentropy.policies.prefill.fixed import block_table, candidate_blocks  # noqa: E402
from flexentropy.sparse.kernel import kernel_options  # noqa: E402
from flexentropy.sparse.plan import SparsePlan, block_mask_tensors, causal_blocks  # noqa: E402


def causal_flops(n: int, hq: int, d: int, b: int = 1) -> float:
    """FLOPs of causal attention forward: 2 matmuls x 2 flop/MAC x N^2/2 x D per head."""
    return 4.0 * b * hq * d * n * n / 2


def bench_context(n: int, args: argparse.Namespace, device: torch.device) -> dict:
    dtype = getattr(torch, args.dtype)
    q, k, v = attention_inputs(1, args.hq, args.hkv, n, args.dim, dtype, device, kind=args.inputs)
    cfg = speed_config(base_budget=args.budget, backend=args.backend, observation=args.observation,
                       probe_kernel=PROBE_KERNEL[args.probe_kernel], probes=args.probes)
    row: dict = {"n": n, "inputs": args.inputs, "base_budget": args.budget, "observation": args.observation,
                 "probes": args.probes, "probe_kernel": args.probe_kernel}
    gqa = args.hq != args.hkv

    def sdpa(backend: SDPBackend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return run

    reps = 5 if n >= 100_000 else 10
    for name, backend in (("sdpa_cudnn_ms", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash_ms", SDPBackend.FLASH_ATTENTION)):
        row[name] = None
        if name.split("_")[1] not in args.baselines:
            continue
        try:
            row[name] = time_ms(sdpa(backend), device, reps=reps)
        except RuntimeError as err:          # backend unavailable for this shape/device
            print(f"{name}: {str(err).splitlines()[0]}")
    row["flex_dense_ms"] = None
    if "flex" in args.baselines:
        causal = causal_block_mask(n, device)
        opts = kernel_options(args.backend, device, 128, dtype)
        row["flex_dense_ms"] = time_ms(lambda: dense_flex(q, k, v, block_mask=causal, enable_gqa=gqa,
                                                           kernel_options=opts), device, reps=reps)

    # Stages of the sparse path, each timed eagerly on its own (inputs from the previous stage); the library runs
    # them as one compiled graph on CUDA (`select_compiled_ms`), the BlockMask indices inside the kernel's graph.
    a_obs = observation_attention(q, k, cfg.segment_size, cfg.block_size, observation=cfg.observation,
                                  scale=cfg.observation_scale, probes=cfg.probes)
    entropy = segment_entropy(a_obs)
    budgets = allocate_budgets(entropy, cfg)
    blocks = block_table(a_obs, budgets, cfg, n)
    plan = SparsePlan(blocks, n, cfg.block_size)
    stages = {
        "observation_ms": lambda: observation_attention(q, k, cfg.segment_size, cfg.block_size,
                                                        observation=cfg.observation, scale=cfg.observation_scale,
                                                        probes=cfg.probes),
        "entropy_ms": lambda: segment_entropy(a_obs),
        "budgets_ms": lambda: allocate_budgets(entropy, cfg),
        "block_table_ms": lambda: block_table(a_obs, budgets, cfg, n),
        "mask_tensors_ms": lambda: block_mask_tensors(blocks, n, cfg.block_size),
        "select_compiled_ms": lambda: fe.select_blocks(q, k, cfg),
        "sparse_kernel_ms": lambda: attend(q, k, v, plan, cfg),
    }
    if cfg.observation == "probe":   # the probe kernel (probe_mass_kernel) against the compiled scored path
        def probe(kernel: bool, constant: str | None = None, value: int | None = None) -> Callable[[], torch.Tensor]:
            """The probe observation by the kernel or the compiled scored path, with ``probe_mass.<constant>`` set."""
            def run() -> torch.Tensor:
                with patch.object(probe_mass, constant, value) if constant else contextlib.nullcontext():
                    mass = probe_mass.probe_block_mass(q, k, cfg.segment_size, cfg.block_size, cfg.probes,
                                                       cfg.observation_scale, kernel=kernel, compiled=True)
                    return mass.float() * candidate_blocks(*mass.shape[-2:], cfg.segment_size, cfg.block_size,
                                                           q.device)
            return run

        for exponent in args.probe_chunks:   # the compiled scored chunks (what selection runs on CUDA) per chunk size
            stages[f"observation_compiled_2^{exponent}_ms"] = probe(False, "PROBE_CHUNK_SCORES_COMPILED", 2**exponent)
        kernels = {"": probe(True)} | {f"_v{width}": probe(True, "PROBE_VALUE_DIM", width)   # narrower one-hot values
                                       for width in args.probe_value_dims}
        for suffix, kernel in kernels.items():
            stages[f"observation_kernel{suffix}_ms"] = kernel
            row[f"probe_kernel{suffix}_max_abs_diff"] = float((a_obs - kernel()).abs().max())
    for name, fn in stages.items():
        row[name] = time_ms(fn, device, reps=reps)
    row["sparse_total_ms"] = time_ms(lambda: fe.sparse_prefill_attention(q, k, v, cfg), device, reps=reps)
    row["selection_ms"] = row["sparse_total_ms"] - row["sparse_kernel_ms"]
    row["density"] = plan.density
    computed = float(blocks.sum()) / float(causal_blocks(n, cfg.block_size, device).sum() * args.hq)
    row["tflops_on_computed_blocks"] = causal_flops(n, args.hq, args.dim) * computed / row["sparse_kernel_ms"] / 1e9
    row["dense_tflops_cudnn"] = (causal_flops(n, args.hq, args.dim) / row["sdpa_cudnn_ms"] / 1e9
                                 if row["sdpa_cudnn_ms"] else None)
    row["rigid_head_share"] = float((entropy[..., 1:].amax(-1) < cfg.entropy_threshold).float().mean())
    dense_times = [t for t in (row["sdpa_cudnn_ms"], row["sdpa_flash_ms"], row["flex_dense_ms"]) if t]
    row["speedup_vs_best_dense"] = min(dense_times) / row["sparse_total_ms"] if dense_times else None
    row["speedup_vs_cudnn"] = row["sdpa_cudnn_ms"] / row["sparse_total_ms"] if row["sdpa_cudnn_ms"] else None
    out = fe.sparse_prefill_attention(q, k, v, cfg)
    row["output_finite"] = bool(torch.isfinite(out).all())
    if n <= 32768:      # accuracy against dense on a slice of query heads (dense reference in float32)
        ref = F.scaled_dot_product_attention(q[:, :8].float(), k[:, :2].float(), v[:, :2].float(), is_causal=True,
                                             enable_gqa=True)
        row["rel_l2_vs_dense_8_heads"] = float((out[:, :8].float() - ref).norm() / ref.norm())
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budget", type=float, default=2048)
    p.add_argument("--observation", choices=["probe", "pooled", "paper"], default="probe",
                   help="probe: the default's observation; pooled: the probes against one mean key per block; paper: "
                        "Alg. 2's representatives (budgets fixed either way)")
    p.add_argument("--probes", type=int, default=fe.EntropyConfig().probes,
                   help="probe queries per segment of the probe and pooled observations (EntropyConfig.probes)")
    p.add_argument("--inputs", choices=["random", "structured"], nargs="+", default=["random", "structured"])
    p.add_argument("--backend", choices=["auto", "triton", "flash"], default="auto")
    p.add_argument("--baselines", nargs="*", choices=["cudnn", "flash", "flex"], default=["cudnn", "flash", "flex"],
                   help="dense baselines to time")
    p.add_argument("--probe-chunks", type=int, nargs="*", default=[28],
                   help="probe observation: time its compiled scored path with chunks of 2^E scores, per E "
                        "(the library's PROBE_CHUNK_SCORES_COMPILED is 2^28)")
    p.add_argument("--probe-value-dims", type=int, nargs="*", default=[],
                   help="probe observation: also time its kernel with one-hot values of these widths "
                        "(probe_mass.PROBE_VALUE_DIM; the library's is the head dim)")
    p.add_argument("--probe-kernel", choices=list(PROBE_KERNEL), default="auto",
                   help="EntropyConfig.probe_kernel of the library's path (select_compiled_ms, sparse_total_ms)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="docs/results/prefill_attention.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for kind in args.inputs:
        for n in args.contexts:
            ns = argparse.Namespace(**{**vars(args), "inputs": kind})
            rows.append(bench_context(n, ns, device))
            print({key: (round(val, 3) if isinstance(val, float) else val) for key, val in rows[-1].items()},
                  flush=True)
            write_json(args.out, {"benchmark": "prefill_attention", "shape": {"hq": args.hq, "hkv": args.hkv,
                                  "dim": args.dim, "dtype": args.dtype}, "backend": args.backend,
                                  "segment_size": speed_config().segment_size,
                                  "environment": environment(), "rows": rows})   # after every row: a cut run keeps them
    print(f"\n{'inputs':>10} {'N':>7} {'cuDNN':>8} {'flash':>8} {'flexD':>8} {'sparse':>8} {'kernel':>8} "
          f"{'select':>7} {'density':>7} {'xcuDNN':>6}")
    for r in rows:
        print(f"{r['inputs']:>10} {r['n']:>7} {r['sdpa_cudnn_ms'] or float('nan'):8.2f} "
              f"{r['sdpa_flash_ms'] or float('nan'):8.2f} {r['flex_dense_ms'] or float('nan'):8.2f} "
              f"{r['sparse_total_ms']:8.2f} "
              f"{r['sparse_kernel_ms']:8.2f} {r['selection_ms']:7.2f} {r['density']:7.3f} "
              f"{r['speedup_vs_cudnn'] or float('nan'):6.2f}")


if __name__ == "__main__":
    main()
