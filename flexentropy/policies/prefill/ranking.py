"""Ranking and covering of scores, row by row: the top-k and the smallest best-first set holding a share of a row's
mass, shared by the prefill rules (the entropy rule's budgets and top-k, FlexPrefill's and XAttention's cumulative
mass, the vertical-slash top counts)."""

from __future__ import annotations

import torch


def _descending_rank(scores: torch.Tensor, eligible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rank, ordered)``: each entry's place in its row sorted by descending score, eligible entries first and
    ties to the lower index, and the sorted scores (``-1`` for ineligible entries). ``scores`` non-negative."""
    ranked = scores.masked_fill(~eligible, -1.0)
    ordered, order = torch.sort(ranked, dim=-1, descending=True, stable=True)
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions), ordered


def top_k_mask(scores: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The ``k[...]`` highest ``scores`` among ``eligible`` entries of each row, ties to the lower index.

    Args:
        scores: ``[..., C]`` non-negative. eligible: bool broadcastable to ``scores``.
        k: int ``[...]``, at most the number of eligible entries per row (rows may differ).

    Returns:
        bool ``[..., C]``.
    """
    rank, _ = _descending_rank(scores, eligible.expand_as(scores))
    return rank < k[..., None]


def mass_cover(scores: torch.Tensor, free: torch.Tensor, forced: torch.Tensor, fraction: float | torch.Tensor,
               total: float | None = None) -> torch.Tensor:
    """The smallest set of ``free`` entries of each row that, added to the ``forced`` ones, holds at least
    ``fraction`` of the row's mass: free entries best first (ties to the lower index) until the kept mass reaches
    ``fraction * sum(row)`` (FlexPrefill's and XAttention's "cumulative attention reaches gamma / threshold").
    With ``total``, the row is part of a whole of that mass whose rest (``total - sum(row)``) is kept anyway: the
    kept mass, that rest included, must reach ``fraction * total``.

    ``fraction >= 1`` keeps every free entry (exactly, whatever the rounding of the sums).

    Args:
        scores: ``[..., C]`` non-negative estimated mass, 0 outside the row's support (its sum is the total).
        free: bool ``[..., C]`` (broadcastable) entries that may be chosen.
        forced: bool ``[..., C]`` (broadcastable) entries kept anyway, disjoint from ``free``; their mass counts.
        fraction: in ``[0, 1]``: a float, or a tensor broadcastable to the rows.

    Returns:
        bool ``[..., C]``: the chosen free entries (forced ones not included).
    """
    free = free.expand_as(scores)
    rank, ordered = _descending_rank(scores, free)
    if not isinstance(fraction, torch.Tensor) and fraction >= 1:
        count = free.sum(dim=-1)
    else:
        row = scores.sum(dim=-1)
        whole = row if total is None else torch.full_like(row, total)
        need = fraction * whole - (whole - row) - (scores * forced).sum(dim=-1)
        mass = ordered.clamp_min(0)
        before = torch.cumsum(mass, dim=-1) - mass                  # mass of the better free entries
        count = ((before < need[..., None]) & (ordered >= 0)).sum(dim=-1)
        if isinstance(fraction, torch.Tensor):
            count = torch.where(fraction >= 1, free.sum(dim=-1), count)
    return rank < count[..., None]
