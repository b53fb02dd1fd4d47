"""Segment and block representatives (paper Alg. 1, design.md §1.1)."""

from __future__ import annotations

import torch
from einops import rearrange


def chunk_extrema(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise max and min of ``x`` over consecutive chunks of ``size`` tokens.

    Reads ``x`` in its own dtype (max/min are exact) through views: no upcast copy or padding of the full tensor,
    and no branch on whether ``size`` divides N (one compiled graph serves every length).

    Args:
        x: ``[B, H, N, D]``.
        size: tokens per chunk; the last chunk may be partial.

    Returns:
        ``(xmax, xmin)``, each float32 ``[B, H, ceil(N / size), D]`` (paper Alg. 1: Q_Rep / K_Rep).
    """
    n = x.shape[-2]
    if n == 0:
        empty = x.new_empty(*x.shape[:-2], 0, x.shape[-1], dtype=torch.float32)
        return empty, empty.clone()
    head = (-(-n // size) - 1) * size          # whole chunks before the last (possibly partial) one
    body = rearrange(x[..., :head, :], "b h (c s) d -> b h c s d", s=size)
    tail = x[..., head:, :]
    xmax = torch.cat([body.amax(dim=-2), tail.amax(dim=-2, keepdim=True)], dim=-2)
    xmin = torch.cat([body.amin(dim=-2), tail.amin(dim=-2, keepdim=True)], dim=-2)
    return xmax.float(), xmin.float()
