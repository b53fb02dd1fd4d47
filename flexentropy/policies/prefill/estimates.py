"""Cheap attention estimates shared by the peers' prefill policies (FlexPrefill, XAttention, MInference).

Nothing here builds an ``N x N`` tensor: the true attention is taken for the last few queries only
(`last_queries_attention`, ``[B, Hq, n, N]``), and block statistics are sums or means over ``size`` tokens.
Computation runs in ``compute_dtype`` (float32, float64 for float64 inputs). The entropy method's probe observation
(`flexentropy.policies.prefill.entropy.probe_mass`) takes its probes' causal logits from here too (`causal_logits`).
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
                        input_dtype_logits: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention (logits ``q.k / (sqrt(D) / scale)``) of the queries at ``positions`` over the keys
    ``k`` (key ``j`` at position ``j``).

    Args:
        q: ``[B, Hq, N, D]``. k: ``[B, Hkv, M, D]`` (the first ``M`` keys), query head ``h`` reads KV head
            ``h // (Hq // Hkv)``. positions: int64 ``[R]``, each below ``N``.
        rows: the rows of ``q`` holding those queries (default ``positions``: ``q`` from position 0; a chunk's
            queries: ``positions - (its first position)``).
        input_dtype_logits: take the logits in the input dtype (16-bit on GPU) and only then cast; else in
            `compute_dtype` throughout.

    Returns:
        ``[B, Hq, R, M]`` in `compute_dtype`; keys after a query's position are 0. Memory ``O(B * Hq * R * M)``.
    """
    rows = positions if rows is None else rows
    probs = torch.softmax(causal_logits(q, k, positions, rows, scale, input_dtype_logits), dim=-1)
    return rearrange(probs, "b h g i j -> b (h g) i j")


def causal_logits(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, scale: float,
                   input_dtype_logits: bool) -> torch.Tensor:
    """Logits ``[B, Hkv, G, R, M]`` in `compute_dtype` of `positions_attention`, ``-inf`` after each query: the
    queries ``q[:, :, rows]`` at ``positions`` (``rows = positions - (N - len(q))`` for a chunk's queries)."""
    dtype = compute_dtype(q.dtype)
    rows = rearrange(q[:, :, rows], "b (h g) i d -> b h g i d", g=q.shape[1] // k.shape[1])
    if not input_dtype_logits:
        rows, k = rows.to(dtype), k.to(dtype)
    logits = torch.einsum("bhgid,bhjd->bhgij", rows, k).to(dtype) / (math.sqrt(q.shape[-1]) / scale)
    causal = torch.arange(k.shape[-2], device=q.device)[None, :] <= positions[:, None]
    return logits.masked_fill_(~causal, float("-inf"))


def last_queries_attention(q: torch.Tensor, k: torch.Tensor, count: int) -> torch.Tensor:
    """Causal softmax attention (scale ``1/sqrt(D)``) of the last ``count`` queries over every key (the logits of
    `positions_attention`).

    Args:
        q: ``[B, Hq, M, D]``, the last ``M`` positions of ``k [B, Hkv, N, D]`` (a whole prompt: ``M = N``; a chunk:
            its own queries), query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        count: queries taken from the end, at most M.

    Returns:
        ``[B, Hq, count, N]`` in `compute_dtype`: row ``i`` is the query at position ``N - count + i``; keys after
        it are 0. Memory ``O(B * Hq * count * N)``.
    """
    m, n = q.shape[-2], k.shape[-2]
    rows = torch.arange(m - count, m, device=q.device)
    return positions_attention(q, k, rows + (n - m), rows=rows)


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
