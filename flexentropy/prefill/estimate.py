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


def last_queries_attention(q: torch.Tensor, k: torch.Tensor, count: int) -> torch.Tensor:
    """Causal softmax attention (scale ``1/sqrt(D)``) of the last ``count`` queries over every key.

    Args:
        q: ``[B, Hq, N, D]``. k: ``[B, Hkv, N, D]``, query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        count: queries taken from the end, at most N.

    Returns:
        ``[B, Hq, count, N]`` in `compute_dtype`: row ``i`` is query ``N - count + i``; keys after it are 0.
        Memory ``O(B * Hq * count * N)``.
    """
    n, dtype = q.shape[-2], compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    last = rearrange(q[..., n - count:, :].to(dtype), "b (h g) i d -> b h g i d", g=group)
    logits = torch.einsum("bhgid,bhjd->bhgij", last, k.to(dtype)) / math.sqrt(q.shape[-1])
    position = torch.arange(n - count, n, device=q.device)
    causal = torch.arange(n, device=q.device)[None, :] <= position[:, None]
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    return rearrange(probs, "b h g i j -> b (h g) i j")


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
