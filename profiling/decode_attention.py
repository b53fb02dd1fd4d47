"""What a captured decode step's pieces cost, kernel against kernel (issue 17): the static latent cache's attention
(one new token over ``C = decode_budget + recompress_every`` buffered entries under a validity mask) in several
formulations, and the decoder's linears (separate and fused projections), each for ``--layers`` layers of distinct
buffers captured in one CUDA graph and replayed, so launch gaps are gone and every layer reads its own bytes.

    python profiling/decode_attention.py --out docs/results/decode_static/decode_attention.json

Attention variants (all compiled, the mask a bool ``[B, Hkv, 1, C]`` as the static cache's validity gives it for an
unpadded batch: the first ``C - 26`` entries of every row, a step between two recompressions):

* ``sdpa_masked``: `flexentropy.kv.decode_attention.grouped_attention` (the GQA group folded onto the query length, one
  SDPA call with the mask): what the captured step runs today;
* ``sdpa_efficient``: the same call with SDPA held to its memory-efficient backend;
* ``matmul``: the same folded product written out, ``softmax(q k^T * scale + mask) v``, in float32;
* ``flex``: flex attention over the folded queries with the mask read in a ``score_mod``;
* ``reduced``: the same product as pointwise work and sums in float32 (no matrix-product kernel: inductor writes
  reductions that read each key and value once, in bf16);
* ``split``: ``reduced`` with the entries cut into ``--partitions`` chunks merged by their maxima (split-KV, as
  flash-decoding does), so that one token's attention over ~1k entries spreads over more of the GPU than one block
  per KV head;
* ``flash``: `flexentropy.kv.decode_attention.flash_decode`, flash-attn-4's kernel as a custom op (GQA packed, one
  split: 4.0.0b36 asserts "SplitKV not supported on SM 9.0" for more), masked by the count of valid entries per row
  (the cache's ``lengths`` counter), where flash-attn-4 is importable: what the recorded step runs when it can;
* ``flash_split``: the same kernel over ``--partitions`` equal parts of each row's entries, each a row of its own,
  merged by their log-sum-exps (`flash_decode` with ``splits``; batch 1 only);
* ``cudnn_nomask``: SDPA held to cuDNN over every entry, no mask (the strong dense decode's attention: a full
  buffer needs none).

Each row has ``us_per_layer`` and the max abs difference from ``matmul`` in float64. Linears: ``x [B, 1, hidden]``
through a Llama-3.1-8B layer's seven projections, or through four with q/k/v and gate/up fused, with the bytes
read per replay and the bandwidth reached.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, record_graph, time_ms, write_json  # noqa: E402

from flexentropy.kv.decode_attention import flash_decode, grouped_attention, split_count  # noqa: E402

_flex = torch.compile(flex_attention, dynamic=False)


def sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return grouped_attention(q, k, v, valid, None)


def sdpa_efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return grouped_attention(q, k, v, valid, None)


def matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    batch, q_heads, _, dim = q.shape
    kv_heads = k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    folded = q.reshape(batch, kv_heads, q_heads // kv_heads, dim).to(wide)
    scores = folded @ k.to(wide).transpose(-1, -2) * dim**-0.5
    weights = scores.masked_fill(~valid, float("-inf")).softmax(dim=-1)
    return (weights @ v.to(wide)).reshape(batch, q_heads, 1, dim).to(q.dtype)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    batch, q_heads, _, dim = q.shape
    kv_heads = k.shape[1]
    folded = q.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    mask = valid[:, :, 0]

    def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return torch.where(mask[b, h, kv_idx], score, float("-inf"))

    return _flex(folded, k, v, score_mod=score_mod).reshape(batch, q_heads, 1, dim)


def reduced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    batch, q_heads, _, dim = q.shape
    kv_heads = k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    folded = q.reshape(batch, kv_heads, q_heads // kv_heads, 1, dim).to(wide)
    scores = (folded * k[:, :, None].to(wide)).sum(-1) * dim**-0.5           # [B, Hkv, G, C]
    weights = scores.masked_fill(~valid, float("-inf")).softmax(dim=-1)
    out = (weights[..., None] * v[:, :, None].to(wide)).sum(-2)               # [B, Hkv, G, Dv]
    return out.reshape(batch, q_heads, 1, -1).to(q.dtype)


def split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, parts: int = 16) -> torch.Tensor:
    """``reduced`` over ``parts`` chunks of the entries, each chunk's softmax numerator and denominator summed on its
    own and the chunks merged by their maxima (split-KV)."""
    batch, q_heads, _, dim = q.shape
    kv_heads, entries = k.shape[1], k.shape[2]
    if entries % parts:
        raise ValueError(f"--capacity {entries} is not a multiple of --partitions {parts}")
    wide = torch.promote_types(q.dtype, torch.float32)
    folded = q.reshape(batch, kv_heads, q_heads // kv_heads, 1, 1, dim).to(wide)
    keys = k.reshape(batch, kv_heads, 1, parts, entries // parts, dim).to(wide)
    values = v.reshape(batch, kv_heads, 1, parts, entries // parts, v.shape[-1]).to(wide)
    mask = valid.reshape(batch, kv_heads, 1, parts, entries // parts)
    scores = ((folded * keys).sum(-1) * dim**-0.5).masked_fill(~mask, float("-inf"))   # [B, Hkv, G, P, C/P]
    peak = scores.amax(-1)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)   # a chunk with no valid entry adds 0
    numer = (scores - peak[..., None]).exp()
    chunk_out = (numer[..., None] * values).sum(-2)                       # [B, Hkv, G, P, Dv]
    weight = (peak - peak.amax(-1, keepdim=True)).exp()
    total = (numer.sum(-1) * weight).sum(-1)                              # [B, Hkv, G]
    out = (chunk_out * weight[..., None]).sum(-2) / total[..., None]
    return out.reshape(batch, q_heads, 1, -1).to(q.dtype)


BY_LENGTH = {"flash", "flash_split"}
"""Variants that take the count of valid entries per row ``[B]`` in place of the mask."""

def cudnn_nomask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa_masked": sdpa_masked, "sdpa_efficient": sdpa_efficient, "matmul": matmul, "flex": flex,
    "reduced": reduced, "split": split, "flash": flash_decode, "flash_split": flash_decode,
    "cudnn_nomask": cudnn_nomask}


def replay_ms(step: Callable[[], object], device: torch.device) -> float:
    """Median ms of one replay of a CUDA graph holding ``step`` (after warm-up calls outside the graph)."""
    return time_ms(record_graph(step, device, warmup=3), device, warmup=3, reps=20)


def attention_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    rows = []
    gen = torch.Generator(device).manual_seed(0)
    valid = args.capacity - 26
    for batch in args.batches:
        shape_q, shape_kv = (batch, args.q_heads, 1, args.dim), (batch, args.kv_heads, args.capacity, args.dim)
        layers = [(torch.randn(shape_q, generator=gen, device=device, dtype=torch.bfloat16),
                   torch.randn(shape_kv, generator=gen, device=device, dtype=torch.bfloat16),
                   torch.randn(shape_kv, generator=gen, device=device, dtype=torch.bfloat16),
                   (torch.arange(args.capacity, device=device) < valid).expand(batch, args.kv_heads, 1, -1),
                   torch.full((batch,), valid, dtype=torch.int32, device=device))
                  for _ in range(args.layers)]
        q, k, v, mask, _ = layers[0]
        exact = matmul(q.double(), k.double(), v.double(), mask).double()
        for name in args.attention:
            fn = torch.compile(ATTENTION[name], fullgraph=True, dynamic=False)
            pick = (lambda layer: (*layer[:3], layer[4])) if name in BY_LENGTH else (lambda layer: layer[:4])
            row = {"part": "attention", "variant": name, "batch": batch, "capacity": args.capacity, "valid": valid}
            try:
                error = (fn(*pick(layers[0])).double() - exact).abs().max().item()
                ms = replay_ms(lambda fn=fn, pick=pick, layers=layers: [fn(*pick(layer)) for layer in layers],
                               device)
                row.update(us_per_layer=round(ms * 1e3 / args.layers, 2), max_abs_error=error)
            except Exception as err:  # noqa: BLE001 - a failed variant is a row, the others go on
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            print(row, flush=True)
            rows.append(row)
    return rows


def linear_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    hidden, inter, kv = args.hidden, args.intermediate, args.kv_heads * args.dim
    shapes = {"separate": [hidden, kv, kv, hidden, inter, inter], "fused": [hidden + 2 * kv, hidden, 2 * inter]}
    rows = []
    for name, outs in shapes.items():
        layers = [[torch.randn(o, hidden, device=device, dtype=torch.bfloat16) for o in outs]
                  + [torch.randn(hidden, inter, device=device, dtype=torch.bfloat16)] for _ in range(args.layers)]
        nbytes = sum(w.numel() * w.element_size() for layer in layers for w in layer)
        for batch in args.batches:
            x = torch.randn(batch, 1, hidden, device=device, dtype=torch.bfloat16)
            h = torch.randn(batch, 1, inter, device=device, dtype=torch.bfloat16)

            def step(layers: list = layers, x: torch.Tensor = x, h: torch.Tensor = h) -> None:
                for layer in layers:
                    for w in layer[:-1]:
                        F.linear(x, w)
                    F.linear(h, layer[-1])

            ms = replay_ms(step, device)
            row = {"part": "linears", "variant": name, "batch": batch, "ms": round(ms, 3), "bytes": nbytes,
                   "tb_per_s": round(nbytes / ms / 1e9, 2)}
            print(row, flush=True)
            rows.append(row)
        del layers
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--capacity", type=int, default=1056, help="decode_budget + recompress_every (1024 + 32)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--partitions", type=int, default=16, help="split, flash_split: chunks of the entries")
    p.add_argument("--attention", nargs="+", default=list(ATTENTION), choices=list(ATTENTION))
    p.add_argument("--parts", default="attention,linears")
    p.add_argument("--out", default="docs/results/decode_static/decode_attention.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (CUDA graphs)")
    device = torch.device("cuda")
    ATTENTION["split"] = functools.partial(split, parts=args.partitions)
    ATTENTION["flash_split"] = functools.partial(flash_decode, splits=split_count(1, args.capacity, args.partitions))
    rows = []
    if "attention" in args.parts:
        rows += attention_rows(args, device)
    if "linears" in args.parts:
        rows += linear_rows(args, device)
    write_json(args.out, {"environment": environment(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
