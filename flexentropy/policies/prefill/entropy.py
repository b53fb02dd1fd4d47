"""``entropy``: entropy-guided sparse prefill (design.md §1; EntropyInfer, paper sec. 4.2, Alg. 1-3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexentropy.policies.base import PrefillPolicy
from flexentropy.prefill.plan import SparsePlan
from flexentropy.prefill.selection import select_blocks


@dataclass(frozen=True)
class EntropyPrefill(PrefillPolicy):
    """Per-head, per-segment budgets from the entropy of the observation attention; every knob is in ``config``."""

    name = "entropy"
    paper = "EntropyInfer (From Rigid to Dynamic, 2026), sec. 4.2"
    keeps = "own segment, sink/local blocks, top-k blocks by A_obs with k per (head, segment) from entropy"
    per_head = True

    def plan(self, q: torch.Tensor, k: torch.Tensor, layer_idx: int = 1) -> SparsePlan:
        """`select_blocks` (design.md §1.1-1.5)."""
        return select_blocks(q, k, self.config, layer_idx)
