"""What a model serves with, in one place: its `Settings` (the `EntropyConfig`, the prefill policy's name and that
policy's own knobs).

`flexentropy.enable` puts one `Settings` on the model (`SETTINGS_ATTR`) and hands the same object to every attention
module's `LayerState`; the decode engine reads it there (`model_settings`) for the defaults of its loops. The dict on
``model.config.flexentropy`` (`CONFIG_ATTR`, written by `settings_dict`) is a record for ``save_pretrained``: it is
read (`parse_settings`) only for a model that `enable` did not switch, e.g. one loaded with
``attn_implementation="flexentropy"``. Nothing here imports transformers.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, NamedTuple

from flexentropy.config import EntropyConfig
from flexentropy.policies import PREFILL_POLICIES

PREFILL_MODES = tuple(PREFILL_POLICIES)
"""Names of `flexentropy.PREFILL_POLICIES`: ``"entropy"`` (sparse prefill, design.md §1) and the other sparse policies
(design.md §3, issue 15) on the layers that go sparse; ``"dense"``: SDPA everywhere."""

CONFIG_ATTR = "flexentropy"
"""Attribute of the model config holding ``{"prefill": mode, **EntropyConfig fields}`` (the record)."""

KNOBS_KEY = "prefill_knobs"
"""Key of ``model.config.flexentropy`` holding the prefill policy's own knobs (when set)."""

SETTINGS_ATTR = "flexentropy_settings"
"""Attribute of a model switched by `flexentropy.enable` holding its `Settings`."""


class Settings(NamedTuple):
    """A model's flexentropy settings (equal to the tuple ``(config, prefill, knobs)``).

    Attributes:
        config: the `EntropyConfig`: the prefill's geometry and budgets, and the decode defaults of the engine's loops.
        prefill: one of `PREFILL_MODES`.
        knobs: the prefill policy's own knobs (`PrefillPolicy.knobs`; empty: its defaults).
    """

    config: EntropyConfig
    prefill: str
    knobs: dict[str, Any]


def check_prefill(prefill: object) -> None:
    """Raise ``ValueError`` unless ``prefill`` names one of `PREFILL_MODES`."""
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")


def settings_dict(config: EntropyConfig, prefill: str, knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON-safe ``{"prefill": prefill, "prefill_knobs": knobs, **fields of config}`` as recorded on the model config
    (``"prefill_knobs"`` only when the policy has knobs set)."""
    own = {KNOBS_KEY: dict(knobs)} if knobs else {}
    return {"prefill": prefill, **own, **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}}


def parse_settings(value: object) -> Settings:
    """`Settings` from a model config's ``flexentropy`` attribute (the record).

    Accepts None (defaults), an `EntropyConfig`, or a dict of `EntropyConfig` fields plus optional ``"prefill"``
    and ``"prefill_knobs"`` keys (lists are read as tuples).
    """
    if value is None:
        return Settings(EntropyConfig(), "entropy", {})
    if isinstance(value, EntropyConfig):
        return Settings(value, "entropy", {})
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
    return Settings(EntropyConfig(**knobs), prefill, own)


def model_settings(model: Any) -> Settings:
    """The `Settings` ``model`` serves with: those `flexentropy.enable` put on it, else the record on its config (a
    model loaded with ``attn_implementation="flexentropy"``), else the defaults."""
    settings = getattr(model, SETTINGS_ATTR, None)
    if settings is not None:
        return settings
    return parse_settings(getattr(getattr(model, "config", None), CONFIG_ATTR, None))
