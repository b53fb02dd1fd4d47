"""``adakv``: SnapKV scores with per-head budgets from one top-k across the heads of a layer, stored per head
without padding (Ada-KV, Feng et al., NeurIPS 2025)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexentropy._checks import check_number
from flexentropy.kv.keep import keep_indices
from flexentropy.policies.cache.snapkv import SnapKV
from flexentropy.policies.layer_view import LayerView


def adaptive_keep(scores: torch.Tensor, budget: int, window: int, safeguard: float) -> torch.Tensor:
    """Ada-KV's allocation: bool keep mask ``[B, Hkv, S]`` with per-head counts.

    Every head first keeps its last ``window`` entries and its best entries up to ``guaranteed =
    max(window, floor(safeguard * budget))`` (the safeguard: no head starves); the rest of the layer's
    ``Hkv * budget`` entries per batch row go to the highest scores across all heads (a head with concentrated
    attention gives its share to a head with dispersed attention). Ties go to the lower (head, entry) index.

    Args:
        scores: ``[B, Hkv, S]`` comparable across heads (SnapKV's mean window attention sums to 1 per head).
        budget: mean entries per head (``<= S``).
    """
    batch, heads, length = scores.shape
    guaranteed = min(max(window, math.floor(safeguard * budget)), budget)
    protected_idx = keep_indices(scores, guaranteed, forced=window)
    protected = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, protected_idx, True)
    flat = keep_indices(scores.reshape(batch, 1, heads * length), heads * budget,
                        forced=protected.reshape(batch, 1, heads * length))
    keep = torch.zeros(batch, 1, heads * length, dtype=torch.bool, device=scores.device).scatter_(-1, flat, True)
    return keep.view(batch, heads, length)


@dataclass(frozen=True)
class AdaKV(SnapKV):
    """SnapKV's window scoring and schedule; the layer's ``Hkv * budget`` entries per batch row are shared out
    across its KV heads by `adaptive_keep`, and each head's entries are stored without padding (real memory saved:
    ``cache.nbytes()`` counts the bytes held). Knobs: SnapKV's plus ``safeguard`` (0.2: each head keeps at least
    20% of the uniform budget, as Ada-KV's released code)."""

    name = "adakv"
    paper = "Ada-KV (Feng et al., NeurIPS 2025)"
    keeps = "SnapKV scores; per-head counts from a top-k across the layer's heads (>= safeguard * budget each)"
    decides = "once, right after the prompt's forward"
    per_head = True
    ragged = True

    safeguard: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(type(self).__name__, "safeguard", self.safeguard, 0.0, 1.0)

    def select_ragged(self, layer: LayerView, target: int) -> torch.Tensor:
        return adaptive_keep(self.ranked_scores(layer), target, self.forced(layer, 0), self.safeguard)
