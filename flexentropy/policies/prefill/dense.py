"""``dense``: plain causal attention over the whole prompt (the baseline every sparse prefill is measured against)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexentropy.policies.base import PrefillPolicy
from flexentropy.policies.prefill.fixed import dense_plan
from flexentropy.sparse.plan import SparsePlan


@dataclass(frozen=True)
class DensePrefill(PrefillPolicy):
    """Every query attends to every earlier key (causal SDPA). No knobs besides the shared ``config`` (unused)."""

    name = "dense"
    paper = "full attention (Vaswani et al., 2017)"
    keeps = "every causal key"
    always_dense = True

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor, compiled: bool | None = None) -> SparsePlan:
        """The dense plan (every causal block, ``dense=True``) of ``q [B, Hq, M, D]``, the last ``M`` positions of
        ``k``, whatever the layer (`runs_dense` says dense everywhere, so the path never asks for it)."""
        return dense_plan(q, self.config, k.shape[-2] - q.shape[-2])
