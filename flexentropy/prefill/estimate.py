"""Cheap attention estimates shared by the peers' prefill policies (FlexPrefill, XAttention, MInference).

Nothing here builds an ``N x N`` tensor: the true attention is taken for the last few queries only
(`last_queries_attention`, ``[B, Hq, n, N]``), and block statistics are sums or means over ``size`` tokens.
Computation runs in ``compute_dtype`` (float32, float64 for float64 inputs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs (so the float64 reference twins can be matched exactly)."""
    return torch.promote_types(dtype, torch.float32)


def positions_attention(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, *, scale: float = 1.0,
                        input_dtype_logits: bool = False) -> torch.Tensor:
    """Causal softmax attention (logits ``q.k / (sqrt(D) / scale)``) of the queries at ``positions`` over the keys
    ``k`` (key ``j`` at position ``j``).

    Args:
        q: ``[B, Hq, N, D]``. k: ``[B, Hkv, M, D]`` (the first ``M`` keys), query head ``h`` reads KV head
            ``h // (Hq // Hkv)``. positions: int64 ``[R]``, each below ``N``.
        input_dtype_logits: take the logits in the input dtype (16-bit on GPU) and only then cast; else in
            `compute_dtype` throughout.

    Returns:
        ``[B, Hq, R, M]`` in `compute_dtype`; keys after a query's position are 0. Memory ``O(B * Hq * R * M)``.
    """
    dtype = compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    rows = rearrange(q[:, :, positions], "b (h g) i d -> b h g i d", g=group)
    if not input_dtype_logits:
        rows, k = rows.to(dtype), k.to(dtype)
    logits = torch.einsum("bhgid,bhjd->bhgij", rows, k).to(dtype) / (math.sqrt(q.shape[-1]) / scale)
    causal = torch.arange(k.shape[-2], device=q.device)[None, :] <= positions[:, None]
    probs = torch.softmax(logits.masked_fill_(~causal, float("-inf")), dim=-1)
    return rearrange(probs, "b h g i j -> b (h g) i j")


def last_queries_attention(q: torch.Tensor, k: torch.Tensor, count: int) -> torch.Tensor:
    """Causal softmax attention (scale ``1/sqrt(D)``) of the last ``count`` queries over every key
    (`positions_attention`).

    Args:
        q: ``[B, Hq, N, D]``. k: ``[B, Hkv, N, D]``, query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        count: queries taken from the end, at most N.

    Returns:
        ``[B, Hq, count, N]`` in `compute_dtype`: row ``i`` is query ``N - count + i``; keys after it are 0.
        Memory ``O(B * Hq * count * N)``.
    """
    n = q.shape[-2]
    return positions_attention(q, k, torch.arange(n - count, n, device=q.device))


def block_sums(x: torch.Tensor, size: int) -> torch.Tensor:
    """Sums of consecutive chunks of ``size`` entries along the last dim (the last chunk may be partial).
    ``[..., N] -> [..., ceil(N / size)]``."""
    pad = -x.shape[-1] % size
    return rearrange(F.pad(x, (0, pad)), "... (c s) -> ... c s", s=size).sum(dim=-1)


def block_means(x: torch.Tensor, size: int) -> torch.Tensor:
    """Means over consecutive chunks of ``size`` tokens (a partial last chunk over its real tokens), in
    `compute_dtype`. ``[B, H, N, D] -> [B, H, ceil(N / size), D]``."""
    n = x.shape[-2]
    pad = -n % size
    sums = rearrange(F.pad(x.to(compute_dtype(x.dtype)), (0, 0, 0, pad)), "b h (c s) d -> b h c s d",
                     s=size).sum(dim=-2)
    counts = torch.clamp(n - torch.arange(sums.shape[-2], device=x.device) * size, max=size)
    return sums / counts[:, None].to(sums.dtype)


PROBE_CHUNK_SCORES = 2**26
"""Most probe scores alive at once (256 MiB in float32): probe rows are scored in chunks."""


def probe_positions(seq_len: int, segment_size: int, probes: int, device: torch.device | str | None = None
                    ) -> torch.Tensor:
    """The probe queries of every segment: ``probes`` evenly strided positions, each the last of its stride
    (``s L_S + (i + 1) L_S / probes - 1``), clamped to the last token. int64 ``[C_S, probes]``."""
    stride = segment_size // probes
    s = torch.arange(-(-seq_len // segment_size), device=device)
    i = torch.arange(probes, device=device)
    return torch.clamp(s[:, None] * segment_size + (i[None, :] + 1) * stride - 1, max=seq_len - 1)


def probe_block_mass(q: torch.Tensor, k: torch.Tensor, segment_size: int, block_size: int, probes: int,
                     scale: float = 1.0) -> torch.Tensor:
    """Mean causal attention mass of each segment's probe queries (`probe_positions`) on each key block.

    A probe's attention is the layer's own softmax over every key up to it, logits ``scale * q.k / sqrt(D)``
    (``scale = 1``: the model's attention); its mass is summed per key block and averaged over the segment's probes.
    Rows are not renormalised: a row sums to 1 over all blocks up to the segment's last probe (own segment included).

    Probe rows are scored in chunks, each against the keys up to its last probe: at most `PROBE_CHUNK_SCORES` scores
    live at once (no ``N x N`` tensor). Compute ``~N^2 D probes / (2 L_S)`` multiply-adds per head (``probes / L_S``
    of dense ``QK^T``, half of it masked). Logits in the input dtype (16-bit on GPU, as XAttention's estimate),
    softmax and sums in `compute_dtype`.

    Args:
        q: ``[B, Hq, N, D]``. k: ``[B, Hkv, N, D]``. probes: a divisor of ``segment_size``.

    Returns:
        ``[B, Hq, C_S, C_B]`` in `compute_dtype`.
    """
    batch, q_heads, n, _ = q.shape
    positions = probe_positions(n, segment_size, probes, q.device).flatten()         # [C_S * probes]
    num_blocks = -(-n // block_size)
    per_chunk = max(probes, PROBE_CHUNK_SCORES // (batch * q_heads * n) // probes * probes)
    masses = []
    for start in range(0, positions.shape[0], per_chunk):   # chunks of whole segments (a few at 32k, batch 1)
        stop = min(start + per_chunk, positions.shape[0])
        keys_seen = min(n, stop // probes * segment_size)   # every key up to the chunk's last probe
        probs = positions_attention(q, k[..., :keys_seen, :], positions[start:stop], scale=scale,
                                    input_dtype_logits=True)
        mass = block_sums(probs, block_size)
        masses.append(F.pad(mass, (0, num_blocks - mass.shape[-1])))
    mass = rearrange(torch.cat(masses, dim=-2), "b h (s p) c -> b h s p c", p=probes)
    return mass.mean(dim=-2)
