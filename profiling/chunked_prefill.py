"""One attention layer prefilled in chunks (chunked prefill, design.md §1.7) against the whole prompt in one call.

Llama-3.1-8B attention shape by default (32 q heads, 8 kv heads, D 128, bf16, B 1), structured inputs
(`common.attention_inputs`), the default `EntropyConfig` (coverage budgets: a chunk cannot run the fluctuation rule).
For every chunk size the prompt's queries go through ``sparse_prefill_attention(q[a:b], k[:b], v[:b], q_start=a)``
chunk by chunk, as a serving engine's chunked prefill feeds them, and are compared with:

- the whole prompt in one ``sparse_prefill_attention`` call;
- dense cuDNN SDPA over the whole prompt (``is_causal``);
- dense SDPA for every chunk, bottom-right causal (``torch.nn.attention.bias.causal_lower_right``);
- flexentropy's own dense fallback for every chunk (the layer in ``dense_layers``: the flex kernel over every causal
  block, with the chunk's offset).

Times are medians of CUDA events after a warm-up (the warm-up compiles; no chunk start or length compiles again).
Each row reports the densities (whole prompt, each chunk) and the relative L2 differences of the outputs.

    python profiling/chunked_prefill.py --n 131072 --chunks 8192 8189 --out docs/results/chunked_prefill.json
    python profiling/chunked_prefill.py --device cpu --tiny --out /tmp/chunked_prefill.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import attention_inputs, environment, time_ms, write_json  # noqa: E402

import flexentropy as fe  # noqa: E402

TINY = {"n": 2048, "hq": 4, "hkv": 2, "dim": 32, "dtype": "float32", "chunks": [512, 509], "dense_prefix": 512,
        "reps": 2}
"""``--tiny``: a CPU-sized run of every code path (sparse and dense chunks, aligned and unaligned)."""


def bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """``(q_start, end)`` of the chunks of ``chunk`` tokens covering ``n`` tokens (the last one shorter)."""
    return [(start, min(start + chunk, n)) for start in range(0, n, chunk)]


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def dense_sdpa(device: torch.device) -> contextlib.AbstractContextManager:
    """cuDNN SDPA on the GPU (the dense baseline of the other benchmarks), the default SDPA elsewhere."""
    return sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if device.type == "cuda" else contextlib.nullcontext()


def bench_chunk(chunk: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: fe.EntropyConfig,
                whole: torch.Tensor, dense: torch.Tensor, args: argparse.Namespace, device: torch.device) -> dict:
    """One chunk size: the chunked sparse prefill and the chunked dense one, timed and compared."""
    spans = bounds(q.shape[-2], chunk)
    gqa = q.shape[1] != k.shape[1]

    def chunked() -> list[torch.Tensor]:
        return [fe.sparse_prefill_attention(q[..., a:b, :], k[..., :b, :], v[..., :b, :], cfg, args.layer, q_start=a)
                for a, b in spans]

    def dense_chunked() -> list[torch.Tensor]:
        return [F.scaled_dot_product_attention(q[..., a:b, :], k[..., :b, :], v[..., :b, :],
                                               attn_mask=causal_lower_right(b - a, b), enable_gqa=gqa)
                for a, b in spans]

    dense_layer = cfg.replace(dense_layers=(args.layer,))

    def flex_dense_chunked() -> list[torch.Tensor]:
        return [fe.sparse_prefill_attention(q[..., a:b, :], k[..., :b, :], v[..., :b, :], dense_layer, args.layer,
                                            q_start=a) for a, b in spans]

    out = torch.cat(chunked(), dim=-2)
    densities = [fe.select_blocks(q[..., a:b, :], k[..., :b, :], cfg, args.layer, q_start=a).density
                 for a, b in spans]
    row = {"chunk": chunk, "chunks": len(spans), "aligned_to_segments": chunk % cfg.segment_size == 0,
           "chunk_densities": densities, "chunked_ms": time_ms(chunked, device, reps=args.reps),
           "rel_l2_chunked_vs_whole": rel_l2(out, whole), "rel_l2_chunked_vs_dense": rel_l2(out, dense),
           "flex_dense_chunked_ms": time_ms(flex_dense_chunked, device, reps=args.reps),
           "rel_l2_flex_dense_chunked_vs_dense": rel_l2(torch.cat(flex_dense_chunked(), dim=-2), dense),
           "dense_chunked_ms": None, "rel_l2_dense_chunked_vs_dense": None}
    try:
        row["dense_chunked_ms"] = time_ms(dense_chunked, device, reps=args.reps)
        row["rel_l2_dense_chunked_vs_dense"] = rel_l2(torch.cat(dense_chunked(), dim=-2), dense)
    except RuntimeError as err:              # no SDPA kernel takes a lower-right mask for this shape/device
        row["dense_chunked_error"] = str(err).splitlines()[0]
    print(f"chunk {chunk}: {row['chunks']} chunks, chunked {row['chunked_ms']:.1f} ms, dense chunked "
          f"{row['dense_chunked_ms']} ms, flex dense chunked {row['flex_dense_chunked_ms']:.1f} ms, "
          f"rel L2 vs whole {row['rel_l2_chunked_vs_whole']:.2e}")
    return row


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    q, k, v = attention_inputs(1, args.hq, args.hkv, args.n, args.dim, dtype, device, kind=args.inputs)
    cfg = fe.EntropyConfig() if args.dense_prefix is None else fe.EntropyConfig(dense_prefix=args.dense_prefix)
    gqa = args.hq != args.hkv

    def whole_fn() -> torch.Tensor:
        return fe.sparse_prefill_attention(q, k, v, cfg, args.layer)

    def dense_fn() -> torch.Tensor:
        with dense_sdpa(device):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    timed: dict[str, Callable[[], object]] = {"whole_ms": whole_fn, "dense_ms": dense_fn}
    shared = {name: time_ms(fn, device, reps=args.reps) for name, fn in timed.items()}
    whole, dense = whole_fn(), dense_fn()
    shared["whole_density"] = fe.select_blocks(q, k, cfg, args.layer).density
    shared["rel_l2_whole_vs_dense"] = rel_l2(whole, dense)
    print(f"n {args.n}: whole {shared['whole_ms']:.1f} ms (density {shared['whole_density']:.3f}), dense SDPA "
          f"{shared['dense_ms']:.1f} ms")
    rows = [{"n": args.n, **shared, **bench_chunk(chunk, q, k, v, cfg, whole, dense, args, device)}
            for chunk in args.chunks]
    return {"args": vars(args), "environment": environment(), "config": repr(cfg), "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=131072, help="prompt length")
    parser.add_argument("--chunks", type=int, nargs="+", default=[8192, 8189],
                        help="chunk sizes (vLLM's default, and one off the segment grid)")
    parser.add_argument("--hq", type=int, default=32)
    parser.add_argument("--hkv", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--inputs", default="structured", choices=["structured", "random"])
    parser.add_argument("--layer", type=int, default=1, help="layer index (layer 0 is dense by default)")
    parser.add_argument("--dense-prefix", type=int, default=None, help="EntropyConfig.dense_prefix (default: its)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help=f"small CPU-sized shapes: {TINY}")
    parser.add_argument("--out", default="docs/results/chunked_prefill.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
    with torch.inference_mode():
        write_json(args.out, run(args))


if __name__ == "__main__":
    main()
