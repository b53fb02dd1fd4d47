"""``critiprefill``: segment-wise criticality with one budget for every head (CritiPrefill, Lv et al., ICASSP 2025).

design.md §3: design.md §1.1-1.5 with ``observation="critiprefill"`` (one softmax over ``max(mean(S1, S3), mean(S2,
S4))``) and
the same ``k = floor(B_0 / L_B)`` blocks for every head and segment. That is EntropyInfer's selection with every head
rigid, so the plan reuses `select_blocks` (and its compiled graph on CUDA) with an entropy threshold above any
entropy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from flexentropy.config import OBSERVATIONS
from flexentropy.policies.base import PrefillPolicy
from flexentropy.policies.prefill.entropy.selection import plan_blocks
from flexentropy.sparse.plan import SparsePlan

EVERY_HEAD_RIGID = 1e30
"""An entropy threshold above any segment entropy (rows of A_obs sum to at most 2, so entropies are below
2 ln C_B): every head is rigid."""


@dataclass(frozen=True)
class CritiPrefill(PrefillPolicy):
    """Top ``floor(base_budget / block_size)`` blocks per segment by observation attention, the same for every head.

    Knobs: ``observation`` (default ``"critiprefill"``, the released code's single softmax; ``"paper"`` for Alg. 2);
    budget, geometry and dense fallbacks come from ``config`` (``base_budget`` = B_0, 2048 as in the paper's
    baseline setting).
    """

    name = "critiprefill"
    paper = "CritiPrefill (Lv et al., ICASSP 2025)"
    keeps = "own segment, sink/local blocks, top floor(B_0/L_B) blocks by A_obs, same k for every head"

    observation: Literal["paper", "critiprefill"] = "critiprefill"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.observation not in OBSERVATIONS:
            raise ValueError(f"CritiPrefill.observation must be one of {OBSERVATIONS}, got {self.observation!r}")

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor, compiled: bool | None = None) -> SparsePlan:
        """`select_blocks`'s plan with every head rigid: budgets ``B_0`` everywhere (``plan.rigid`` all True)."""
        config = self.config.replace(observation=self.observation, budget_rule="fluctuation",
                                     entropy_threshold=EVERY_HEAD_RIGID)
        return plan_blocks(q, k, config, compiled=compiled)
