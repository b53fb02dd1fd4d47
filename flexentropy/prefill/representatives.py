"""Segment and block representatives (paper Alg. 1, SPEC 1.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange


def chunk_extrema(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise max and min of ``x`` over consecutive chunks of ``size`` tokens.

    Args:
        x: ``[B, H, N, D]``.
        size: tokens per chunk; the last chunk may be partial.

    Returns:
        ``(xmax, xmin)``, each ``[B, H, ceil(N / size), D]`` in float32 (paper Alg. 1: Q_Rep / K_Rep).
    """
    n = x.shape[-2]
    pad = -n % size
    x = x.float()
    hi = F.pad(x, (0, 0, 0, pad), value=float("-inf")) if pad else x
    lo = F.pad(x, (0, 0, 0, pad), value=float("inf")) if pad else x
    xmax = rearrange(hi, "b h (c s) d -> b h c s d", s=size).amax(dim=-2)
    xmin = rearrange(lo, "b h (c s) d -> b h c s d", s=size).amin(dim=-2)
    return xmax, xmin
