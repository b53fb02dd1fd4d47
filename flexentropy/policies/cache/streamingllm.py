"""``streamingllm``: attention sinks plus the most recent tokens (StreamingLLM, Xiao et al., ICLR 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexentropy._checks import check_int
from flexentropy.policies.base import CachePolicy
from flexentropy.policies.layer_view import LayerView


@dataclass(frozen=True)
class StreamingLLM(CachePolicy):
    """Keep the first ``sinks`` tokens and the most recent ones, ``budget`` per KV head in all: the prompt is cut
    right after its forward and every later ``update`` evicts before appending, so no more than ``budget`` entries
    are ever stored between forwards or attended by a decoding step. Needs no queries.

    Knobs: ``budget`` 4096 and ``sinks`` 4 (the EntropyInfer paper's baseline setting).
    """

    name = "streamingllm"
    paper = "StreamingLLM (Xiao et al., ICLR 2024)"
    keeps = "first `sinks` tokens + most recent ones, `budget` per KV head"
    decides = "after the prompt's forward, then before every append"

    budget: int = 4096
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_int(owner, "sinks", self.sinks, 0)
        check_int(owner, "budget", self.budget, self.sinks + 1,
                  minimum_is=f"sinks={self.sinks} + 1: the sinks and the newest token are always kept")

    def capacity(self) -> int:
        return self.budget

    def before_append(self, layer: LayerView, incoming: int) -> int | None:
        if layer.prompt_length is None or layer.stored + incoming <= self.budget:
            return None
        if incoming >= self.budget - self.sinks:
            raise ValueError(f"StreamingLLM: a forward of {incoming} tokens does not fit budget={self.budget} with "
                             f"{self.sinks} sinks; feed fewer tokens per forward")
        return self.budget - incoming

    def when_settled(self, layer: LayerView) -> int | None:
        return self.budget if layer.stored > self.budget else None

    def scores(self, layer: LayerView) -> torch.Tensor:
        return layer.positions().float()  # the most recent first

    def forced(self, layer: LayerView, incoming: int) -> torch.Tensor:
        row = layer.row_positions()  # a left-padded row's sinks are its first real tokens
        return (row >= 0) & (row < self.sinks)

    def select(self, layer: LayerView, target: int, incoming: int) -> torch.Tensor:
        """The same as ``keep_indices(scores, target, forced)`` without sorting: every head holds the sinks first
        (never evicted) and then its most recent tokens, so the kept slots are known (with left padding still
        stored, the general rule)."""
        if layer.real_entries() is not None:
            return super().select(layer, target, incoming)
        sinks, stored = min(self.sinks, layer.seen), layer.stored
        device = layer.keys.device
        slots = torch.cat([torch.arange(sinks, device=device), torch.arange(stored - (target - sinks), stored,
                                                                            device=device)])
        return slots.expand(*layer.keys.shape[:2], target)
