"""``snapkv``: compress the prompt's cache once, right after prefill, by the attention of its last queries
(SnapKV, Li et al., NeurIPS 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexentropy._checks import check_int, check_odd
from flexentropy.policies.base import CachePolicy
from flexentropy.policies.cache.common import check_window_budget, window_entries, window_scores
from flexentropy.policies.layer_view import LayerView


@dataclass(frozen=True)
class SnapKV(CachePolicy):
    """Keep the observation window (the prompt's last ``window`` tokens) and the entries with the highest pooled
    window attention, ``budget`` per KV head (window included); decided once, when the prompt's keys and queries
    are in (the prompt's own attention still reads the full cache). Later tokens append.

    Knobs: ``budget`` 1024 (the paper's baseline setting), ``window`` 64 and ``pool`` 5 (SnapKV's and kvpress'
    defaults; the pooling runs over the stored entries).
    """

    name = "snapkv"
    paper = "SnapKV (Li et al., NeurIPS 2024)"
    keeps = "prompt's last `window` tokens + top pooled window-attention entries, `budget` per KV head"
    decides = "once, right after the prompt's forward"

    budget: int = 1024
    window: int = 64
    pool: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_int(owner, "window", self.window, 1)
        check_window_budget(owner, self.budget, self.window)
        check_odd(owner, "pool", self.pool)

    @property
    def query_window(self) -> int:
        return self.window

    def layer_budget(self, layer: LayerView) -> int:
        """Entries per KV head this layer keeps (PyramidKV overrides it)."""
        return self.budget

    def when_settled(self, layer: LayerView) -> int | None:
        budget = self.layer_budget(layer)
        if layer.evictions == 0 and layer.generated == 0 and layer.stored > budget:
            return budget
        return None

    def scores(self, layer: LayerView) -> torch.Tensor:
        return window_scores(layer, "softmax", self.pool)

    def forced(self, layer: LayerView, incoming: int) -> int:
        return window_entries(layer)
