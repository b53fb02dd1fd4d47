"""``entropy``: entropy-guided sparse prefill (design.md §1; EntropyInfer, paper sec. 4.2, Alg. 1-3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexentropy.policies.base import PrefillPolicy
from flexentropy.policies.prefill.entropy.selection import plan_blocks
from flexentropy.sparse.plan import SparsePlan


@dataclass(frozen=True)
class EntropyPrefill(PrefillPolicy):
    """Per-head, per-segment budgets from the observation attention; every knob is in ``config`` (default: the probe
    observation with coverage budgets, design.md §1.2b/§1.4b; `EntropyConfig.paper` or ``entropy_paper``: the
    paper's Alg. 2-3)."""

    name = "entropy"
    paper = "EntropyInfer (From Rigid to Dynamic, 2026), sec. 4.2"
    keeps = "own segment, sink/local blocks, top-k blocks by A_obs with k per (head, segment) from entropy"
    per_head = True

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor) -> SparsePlan:
        """`select_blocks`'s plan (design.md §1.1-1.5)."""
        return plan_blocks(q, k, self.config)


@dataclass(frozen=True)
class EntropyPaperPrefill(EntropyPrefill):
    """The paper's method as published, whatever ``config`` says of the observation and the budget rule: Alg. 2's
    representatives and Alg. 3's fluctuation budgets from ``base_budget`` (`EntropyConfig.paper`)."""

    name = "entropy_paper"
    keeps = "own segment, sink/local blocks, top-k blocks by Alg. 2's A_obs with k per (head, segment) from Alg. 3"

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor) -> SparsePlan:
        """`select_blocks`'s plan with ``observation="paper"`` and ``budget_rule="fluctuation"``."""
        return plan_blocks(q, k, self.config.replace(observation="paper", budget_rule="fluctuation"))
