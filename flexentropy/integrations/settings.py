"""Where flexentropy's settings live on a transformers model, and what each attention module keeps of its prefills.

The record on ``model.config.flexentropy`` (`CONFIG_ATTR`: a JSON-safe dict, so ``save_pretrained`` keeps it;
`settings_dict` writes it, `parse_settings` reads it) and, on every attention module, a `LayerState` parsed from it
once (`layer_state`), which also keeps the module's last prefill plans and densities (`prefill_density` reads them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from flexentropy.config import EntropyConfig
from flexentropy.policies import PREFILL_POLICIES, PrefillPolicy, make_prefill
from flexentropy.prefill import SparsePlan

PREFILL_MODES = tuple(PREFILL_POLICIES)
"""Names of `flexentropy.PREFILL_POLICIES`: ``"entropy"`` (sparse prefill, design.md §1) and the other sparse policies
(design.md §3, issue 15) on the layers that go sparse; ``"dense"``: SDPA everywhere."""

CONFIG_ATTR = "flexentropy"
"""Attribute of the model config holding ``{"prefill": mode, **EntropyConfig fields}``."""

STATE_ATTR = "flexentropy_state"
"""Attribute of each attention module holding its parsed `LayerState`."""

KNOBS_KEY = "prefill_knobs"
"""Key of ``model.config.flexentropy`` holding the prefill policy's own knobs (when set)."""

PlanEdit = Callable[[int, torch.Tensor, torch.Tensor, SparsePlan], SparsePlan]
"""``(layer_idx, query [B, Hq, N, D], key [B, Hkv, N, D], plan) -> plan``: applied to each sparse prefill plan before
the kernel runs it (`LayerState.plan_edit`; diagnostics such as hybrid dense/sparse runs)."""


@dataclass
class LayerState:
    """What :func:`attention_forward` knows about one attention module.

    Attributes:
        config: the `EntropyConfig`.
        prefill: one of `PREFILL_MODES`.
        knobs: the prefill policy's own knobs (`PrefillPolicy.knobs`; empty: its defaults).
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

    config: EntropyConfig
    prefill: str
    knobs: dict[str, Any] = field(default_factory=dict)
    plans: list[SparsePlan | None] = field(default_factory=list)
    keep_plans: bool = True
    densities: list[torch.Tensor | None] = field(default_factory=list)
    plan_edit: PlanEdit | None = None
    policy: PrefillPolicy = field(init=False, repr=False)
    """The prefill policy named ``prefill``, on ``config``, with its own ``knobs``."""

    def __post_init__(self) -> None:
        self.policy = make_prefill(self.prefill, self.config, **self.knobs)

    @property
    def density(self) -> float | None:
        """Computed / causal key blocks of the layer's last prefill (mean over batch rows; 1.0 when dense)."""
        if not self.densities:
            return None
        return sum(1.0 if d is None else float(d) for d in self.densities) / len(self.densities)


def settings_dict(config: EntropyConfig, prefill: str, knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON-safe ``{"prefill": prefill, "prefill_knobs": knobs, **fields of config}`` as stored on the model config
    (``"prefill_knobs"`` only when the policy has knobs set)."""
    own = {KNOBS_KEY: dict(knobs)} if knobs else {}
    return {"prefill": prefill, **own, **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}}


def parse_settings(value: object) -> tuple[EntropyConfig, str, dict[str, Any]]:
    """``(config, prefill, knobs)`` from a model config's ``flexentropy`` attribute.

    Accepts None (defaults), an `EntropyConfig`, or a dict of `EntropyConfig` fields plus optional ``"prefill"``
    and ``"prefill_knobs"`` keys (lists are read as tuples).
    """
    if value is None:
        return EntropyConfig(), "entropy", {}
    if isinstance(value, EntropyConfig):
        return value, "entropy", {}
    if not isinstance(value, dict):
        raise TypeError(f"config.{CONFIG_ATTR} must be a dict of EntropyConfig fields or an EntropyConfig, "
                        f"got {type(value).__name__}")
    knobs = dict(value)
    prefill = knobs.pop("prefill", "entropy")
    own = dict(knobs.pop(KNOBS_KEY, None) or {})
    check_prefill(prefill)
    unknown = set(knobs) - {f.name for f in fields(EntropyConfig)}
    if unknown:
        raise ValueError(f"config.{CONFIG_ATTR} has unknown EntropyConfig field(s) {sorted(unknown)}")
    knobs = {k: tuple(v) if isinstance(v, list) else v for k, v in knobs.items()}
    return EntropyConfig(**knobs), prefill, own


def check_prefill(prefill: object) -> None:
    """Raise ``ValueError`` unless ``prefill`` names one of `PREFILL_MODES`."""
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")


def layer_state(module: nn.Module) -> LayerState:
    """The module's `LayerState`, parsed from ``module.config.flexentropy`` on first use."""
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        state = LayerState(*parse_settings(getattr(module.config, CONFIG_ATTR, None)))
        setattr(module, STATE_ATTR, state)
    return state


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a supported model (``...layers.<i>.self_attn``), in layer order."""
    return [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "layer_idx")]


def prefill_density(model: nn.Module) -> float | None:
    """Mean density of the last prefill over the layers that recorded one (None if none did).

    Density is computed / causal key blocks; dense layers count 1.0, sliding-window layers are left out. Under tensor
    parallelism it is over this rank's heads (`local_heads`).
    """
    densities = [s.density for m in attention_modules(model)
                 if (s := getattr(m, STATE_ATTR, None)) is not None and s.density is not None]
    return sum(densities) / len(densities) if densities else None
