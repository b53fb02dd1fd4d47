"""What a model serves with, in one place: its `Settings`, the prefill policy object (its rule and knobs, on the
`EntropyConfig` that also holds the decode defaults), built or parsed once per model or engine and held as is.

`flexentropy.enable` puts one `Settings` on the model (`SETTINGS_ATTR`) and hands the same object to every attention
module's `LayerState`, whose layers run its policy; the decode engine reads it there (`model_settings`) for the
defaults of its loops. The dict on ``model.config.flexentropy`` (`CONFIG_ATTR`, written by `settings_dict`) is a record
for ``save_pretrained``: it is read (`parse_settings`, the one reader of the configuration from plain values, vLLM's
plugin's included; `read_settings` once per value and process) only for a model that `enable` did not switch, e.g.
one loaded with ``attn_implementation="flexentropy"``. Nothing here imports transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any, NamedTuple

from flexentropy.config import EntropyConfig
from flexentropy.policies import PREFILL_POLICIES, PrefillPolicy, make_prefill, prefill_knob_names, unknown_knobs

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
    """A model's (or a vLLM engine's) flexentropy settings: its prefill policy, whose `EntropyConfig` holds the
    prefill's geometry and budgets and the decode defaults of the engine's loops.

    Attributes:
        policy: the `PrefillPolicy` every attention layer runs (its rule, one of `PREFILL_MODES`, with its own
            knobs), built once (`flexentropy.enable`, `parse_settings`) and held as is.
    """

    policy: PrefillPolicy

    @property
    def config(self) -> EntropyConfig:
        """The policy's `EntropyConfig`."""
        return self.policy.config

    @property
    def prefill(self) -> str:
        """The policy's name (one of `PREFILL_MODES`)."""
        return self.policy.name

    @property
    def knobs(self) -> dict[str, Any]:
        """The policy's own knobs (`PrefillPolicy.knobs`)."""
        return self.policy.knobs


def check_prefill(prefill: object, where: str = "prefill") -> None:
    """Raise ``ValueError`` unless ``prefill`` names one of `PREFILL_MODES` (``where``: what the message calls it)."""
    if prefill not in PREFILL_MODES:
        raise ValueError(f"{where} must be one of {PREFILL_MODES}, got {prefill!r}")


def settings_dict(config: EntropyConfig, prefill: str, knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON-safe ``{"prefill": prefill, "prefill_knobs": knobs, **fields of config}`` as recorded on the model config
    (``"prefill_knobs"`` only when the policy has knobs set)."""
    own = {KNOBS_KEY: dict(knobs)} if knobs else {}
    return {"prefill": prefill, **own, **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}}


def parse_settings(value: object, where: str = f"config.{CONFIG_ATTR}") -> Settings:
    """`Settings` from plain values: the one reader of flexentropy's configuration from JSON, be it the record on a
    model's config (``model.config.flexentropy``), vLLM's ``additional_config["flexentropy"]`` or a lab's file. The
    prefill policy is built here, once, its knobs checked with it.

    Accepts None (defaults), an `EntropyConfig`, or a mapping of `EntropyConfig` fields plus optional ``"prefill"``
    (one of `PREFILL_MODES`, default ``"entropy"``) and ``"prefill_knobs"`` keys; lists are read as tuples (JSON has
    no tuples: ``"coverage": [0.8, 0.6]``). A field left out keeps its default.

    Raises:
        TypeError, ValueError: a value that is not such a mapping, an unknown field, an unknown prefill policy, a
            knob that policy does not have or a value `EntropyConfig` or the policy refuses; the message starts with
            ``where`` (what the caller calls the value).
    """
    if value is None:
        return Settings(make_prefill("entropy"))
    if isinstance(value, EntropyConfig):
        return Settings(make_prefill("entropy", value))
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a mapping of EntropyConfig fields (plus optional 'prefill' and "
                        f"'{KNOBS_KEY}'), e.g. {{\"dense_prefix\": 8192, \"coverage\": [0.8, 0.6]}}, or an "
                        f"EntropyConfig; got {type(value).__name__} {value!r}")
    values = dict(value)
    prefill = values.pop("prefill", "entropy")
    knobs = values.pop(KNOBS_KEY, None) or {}
    check_prefill(prefill, f"{where}['prefill']")
    if not isinstance(knobs, Mapping):
        raise TypeError(f"{where}['{KNOBS_KEY}'] must be a mapping of the prefill policy's knobs, got "
                        f"{type(knobs).__name__} {knobs!r}")
    names = {f.name for f in fields(EntropyConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected EntropyConfig's fields {sorted(names)}, "
                         f"'prefill' or '{KNOBS_KEY}'")
    wrong = unknown_knobs("prefill", prefill, knobs, prefill_knob_names(prefill))
    if wrong:
        raise ValueError(f"{where}['{KNOBS_KEY}']: {wrong} (EntropyConfig's fields go beside 'prefill', not in "
                         f"'{KNOBS_KEY}')")
    try:
        config = EntropyConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
        policy = make_prefill(prefill, config, **knobs)   # the knobs' values, checked here, once
    except (TypeError, ValueError) as err:
        raise type(err)(f"{where}: {err}") from None
    return Settings(policy)


_READ: dict[str, Settings] = {}
"""`read_settings`' values read so far (a canonical JSON text of each), and their settings."""


def read_settings(value: object, where: str = f"config.{CONFIG_ATTR}") -> Settings:
    """`parse_settings`, once per value and process: the layers of a model loaded with
    ``attn_implementation="flexentropy"`` read one record, a vLLM engine's backend classes, metadata builders and
    layers one ``additional_config`` entry, and each gets the same `Settings` (one policy object). A value that has no
    canonical JSON text (a mapping with keys of several types) is parsed on each call."""
    try:
        key = json.dumps(value, sort_keys=True, default=repr)
    except TypeError:
        return parse_settings(value, where)
    if key not in _READ:
        _READ[key] = parse_settings(value, where)
    return _READ[key]


def model_settings(model: Any) -> Settings:
    """The `Settings` ``model`` serves with: those `flexentropy.enable` put on it, else the record on its config (a
    model loaded with ``attn_implementation="flexentropy"``), else the defaults."""
    settings = getattr(model, SETTINGS_ATTR, None)
    if settings is not None:
        return settings
    return read_settings(getattr(getattr(model, "config", None), CONFIG_ATTR, None))
