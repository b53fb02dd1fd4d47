"""GPU check of the probe observation's flex kernel (opt-in) against its scored path: the masses must agree.

    python profiling/quality/probe_kernel_check.py [cpu]   # cpu: eager flex, a smoke run of the script

Session 8 found rows summing to 0.715 on the H200 (float32) where the scored path and eager flex on CPU sum to 1.
The second part looks for the cause: per (key chunk, probe row), how much of the probe's mass the kernel's output
holds (it must be 1 wherever the chunk is visible) and how far its log-sum-exp is from the true one, with the
hand-built BlockMask on strided key chunks (the kernel before session 8) and on contiguous ones (since), and with a
BlockMask built by ``create_block_mask`` from the same ``mask_mod``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from einops import rearrange
from torch.nn import functional as F
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flexentropy.prefill import estimate  # noqa: E402

N, SEGMENT, BLOCK, PROBES = 20000, 512, 128, 16
DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
gen = torch.Generator(device=DEVICE).manual_seed(0)
q = torch.randn(1, 8, N, 128, device=DEVICE, generator=gen)
k = torch.randn(1, 2, N, 128, device=DEVICE, generator=gen)
fast = estimate.probe_block_mass(q, k, SEGMENT, BLOCK, PROBES, kernel=True)
slow = estimate.probe_block_mass(q, k, SEGMENT, BLOCK, PROBES, kernel=False)
print(f"float32: max |kernel - scored| = {float((fast - slow).abs().max()):.3g}, "
      f"row sums {float(fast.sum(-1).min()):.4f}..{float(fast.sum(-1).max()):.4f}", flush=True)

# per chunk: the kernel's output mass of every probe row that sees the chunk
width = 128 * BLOCK
chunks = -(-N // width)
strided_chunks = rearrange(F.pad(k, (0, 0, 0, chunks * width - N)), "b h (c w) d -> (b c) h w d", w=width)
key_chunks = strided_chunks.contiguous()                            # what probe_mass_kernel passes since session 8
one_hot = (torch.arange(width, device=DEVICE)[:, None] // BLOCK == torch.arange(128, device=DEVICE)).float()
positions = estimate.probe_positions(N, SEGMENT, PROBES, DEVICE).flatten()
rows_q = q[:, :, positions]
row0 = torch.tensor(0, device=DEVICE)
stride = SEGMENT // PROBES
hand = estimate._probe_block_mask(positions.shape[0], row0, chunks, width, SEGMENT, stride, N - 1, 1)


def mask_mod(b, h, q_idx, kv_idx):
    return estimate.probe_row_position(q_idx, PROBES, SEGMENT, stride, N - 1) >= b * width + kv_idx


built = create_block_mask(mask_mod, chunks, None, positions.shape[0], width, device=DEVICE)
seen = positions[None, :] >= torch.arange(chunks, device=DEVICE)[:, None] * width               # [C, R]
run = torch.compile(flex_attention, dynamic=False) if DEVICE == "cuda" else flex_attention
values = one_hot.expand(chunks, 2, -1, -1).contiguous()
queries = rows_q.repeat_interleave(chunks, dim=0)
# the true log-sum-exp of every probe row over each chunk's visible keys (dense scores: [Hq, R, N], 0.4 GB)
scores = torch.einsum("hrd,hnd->hrn", rows_q[0], k[0].repeat_interleave(4, dim=0)) / math.sqrt(128)
scores = scores.masked_fill(torch.arange(N, device=DEVICE) > positions[:, None], float("-inf"))
true_lse = torch.stack([scores[..., c * width:(c + 1) * width].logsumexp(-1) for c in range(chunks)])   # [C, Hq, R]
options = {"BACKEND": "TRITON"} if DEVICE == "cuda" else None     # the backend probe_mass_kernel runs on CUDA
for name, block_mask, keys in (("hand-built, strided K", hand, strided_chunks), ("hand-built", hand, key_chunks),
                               ("create_block_mask", built, key_chunks)):
    out, aux = run(queries, keys, values, block_mask=block_mask, scale=1 / math.sqrt(128),
                   return_aux=AuxRequest(lse=True), enable_gqa=True, kernel_options=options)
    held = out.float().sum(-1)                                                                # [C, Hq, R]
    for c in range(chunks):
        rows = held[c][:, seen[c]]
        bad = (rows - 1).abs() > 1e-3
        where = positions[seen[c]][bad.any(0)]
        print(f"{name:21s} chunk {c}: output mass {float(rows.min()):.4f}..{float(rows.max()):.4f}, "
              f"{int(bad.any(0).sum())} of {rows.shape[1]} rows off; max |lse - true| "
              f"{float((aux.lse[c].float() - true_lse[c])[:, seen[c]].abs().max()):.3g}; positions "
              f"{where[:6].tolist()}..{where[-3:].tolist()}; lse of unseen rows "
              f"{aux.lse[c][:, ~seen[c]].float().unique()[:4].tolist()}", flush=True)
