"""``h2o``: heavy hitters by accumulated attention plus a recent window, evicting during decoding
(H2O, Zhang et al., NeurIPS 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexentropy._checks import check_int
from flexentropy.policies.base import CachePolicy
from flexentropy.policies.cache.common import accumulate_attention
from flexentropy.policies.layer_view import LayerView


@dataclass(frozen=True)
class H2O(CachePolicy):
    """Every entry accumulates the softmax attention it receives from every query (prompt and generated, summed over
    the group's query heads), tracked incrementally as queries are handed over. The cache keeps the ``recent`` most
    recent tokens and the entries with the largest accumulated attention, ``budget`` per KV head: the prompt is cut
    after its forward, then every ``update`` that would exceed ``budget`` evicts the lowest scorers first.

    Knobs: ``budget`` 1024, ``recent`` (default ``budget // 2``: H2O's equal heavy/recent split), ``chunk`` 256
    (prompt queries scored at a time; the prompt's accumulation costs one extra pass of ``Q K^T``).
    """

    name = "h2o"
    paper = "H2O (Zhang et al., NeurIPS 2023)"
    keeps = "`recent` most recent tokens + largest accumulated attention, `budget` per KV head"
    decides = "after the prompt's forward, then before every append once over budget"
    stats = {"attention": 0.0}
    accumulates = True

    budget: int = 1024
    recent: int | None = None
    chunk: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_int(owner, "budget", self.budget, 2)
        if self.recent is not None:
            check_int(owner, "recent", self.recent, 1)
            if self.recent >= self.budget:
                raise ValueError(f"{owner}.recent ({self.recent}) must be < budget ({self.budget})")
        check_int(owner, "chunk", self.chunk, 1)

    @property
    def recent_tokens(self) -> int:
        return self.budget // 2 if self.recent is None else self.recent

    def capacity(self) -> int:
        return self.budget

    def before_append(self, layer: LayerView, incoming: int) -> int | None:
        if layer.prompt_length is None or layer.stored + incoming <= self.budget:
            return None
        if incoming > self.recent_tokens:
            raise ValueError(f"H2O: a forward of {incoming} tokens exceeds recent={self.recent_tokens}; feed fewer "
                             f"tokens per forward")
        return self.budget - incoming

    def when_settled(self, layer: LayerView) -> int | None:
        return self.budget if layer.stored > self.budget else None

    def on_queries(self, layer: LayerView, queries: torch.Tensor, first_position: int) -> None:
        layer.stats["attention"] += accumulate_attention(layer, queries, first_position, self.chunk)

    def scores(self, layer: LayerView) -> torch.Tensor:
        return layer.stats["attention"]

    def forced(self, layer: LayerView, incoming: int) -> torch.Tensor:
        """The most recent ``recent - incoming`` stored tokens (with the incoming ones: ``recent``)."""
        return layer.positions() >= layer.seen + incoming - self.recent_tokens
