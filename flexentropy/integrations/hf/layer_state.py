"""What each attention module of a switched transformers model keeps: its `LayerState` (the model's `Settings`, whose
prefill policy the module runs, and the module's last prefill plans and densities), `layer_state` to read it, and
`prefill_density`, the last prefill's density over the layers.

The `Settings` are `enable`'s (one object, one policy, for the whole model, `flexentropy.settings`); a model loaded
with ``attn_implementation="flexentropy"`` and never enabled gets them read from the record on its config on first
use, once for all its modules (`read_settings`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from flexentropy._checks import check_has
from flexentropy.config import EntropyConfig
from flexentropy.integrations.hf.tensor_parallel import ATTENTION_MODULE
from flexentropy.policies import PrefillPolicy
from flexentropy.policies.base import PlanEdit
from flexentropy.settings import CONFIG_ATTR, Settings, read_settings
from flexentropy.sparse.plan import SparsePlan

STATE_ATTR = "flexentropy_state"
"""Attribute of each attention module holding its `LayerState`."""


@dataclass
class LayerState:
    """What :func:`attention_forward` knows about one attention module.

    Attributes:
        settings: the model's `Settings` (its prefill policy, on its config; `policy`, `config` and `prefill` read
            them).
        plans: the last prefill's plans, one per batch row run sparse (None for a row or layer run densely);
            empty before any prefill, for sliding-window layers, under ``torch.compile``, and when ``keep_plans`` is
            False. Kept as tensors so the prefill path never waits on the GPU.
        keep_plans: whether to keep ``plans``. A plan's block table is ``Hq * C_Q * C_B`` bools per row: 1 GiB per
            layer at 1M tokens with 16 query heads, held for every layer until the next prefill; False keeps only
            ``densities``.
        densities: the last prefill's `SparsePlan.density` per row, as 0-d tensors (None: run densely); empty
            when ``plans`` is (``keep_plans`` aside). `density` reads them on request.
        plan_edit: None, or a `PlanEdit` that replaces each sparse plan of this layer before it runs (the recorded
            plans are the edited ones); `enable` resets it.
    """

    settings: Settings
    plans: list[SparsePlan | None] = field(default_factory=list)
    keep_plans: bool = True
    densities: list[torch.Tensor | None] = field(default_factory=list)
    plan_edit: PlanEdit | None = None

    @property
    def policy(self) -> PrefillPolicy:
        """The model's prefill policy, which this module's prefill runs."""
        return self.settings.policy

    @property
    def config(self) -> EntropyConfig:
        return self.settings.config

    @property
    def prefill(self) -> str:
        return self.settings.prefill

    @property
    def density(self) -> float | None:
        """Computed / causal key blocks of the layer's last prefill (mean over batch rows; 1.0 when dense); None
        before any prefill, NaN after a sparse one on meta tensors (shapes without data)."""
        if not self.densities:
            return None
        rows = [1.0 if d is None else math.nan if d.is_meta else float(d) for d in self.densities]
        return sum(rows) / len(rows)


def layer_state(module: nn.Module) -> LayerState:
    """The module's `LayerState`: `enable`'s, or on first use one parsed from the record on its config."""
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        check_has("layer_state", "module", module, ("config", "layer_idx"), ATTENTION_MODULE)
        state = LayerState(read_settings(getattr(module.config, CONFIG_ATTR, None)))
        setattr(module, STATE_ATTR, state)
    return state


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a supported model (``...layers.<i>.self_attn``), in layer order."""
    return [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "layer_idx")]


def prefill_density(model: nn.Module) -> float | None:
    """Mean density of the last prefill over the layers that recorded one (None if none did).

    Density is computed / causal key blocks; dense layers count 1.0, sliding-window layers are left out; NaN when a
    layer ran sparse on meta tensors (shapes without data). Under tensor parallelism it is over this rank's heads
    (`local_heads`).
    """
    check_has("prefill_density", "model", model, ("named_modules",), "a transformers model (an nn.Module)")
    densities = [s.density for m in attention_modules(model)
                 if (s := getattr(m, STATE_ATTR, None)) is not None and s.density is not None]
    return sum(densities) / len(densities) if densities else None
