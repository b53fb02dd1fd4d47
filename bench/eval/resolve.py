"""Policies named by string, resolved at run time through `flexentropy.policies` (``PREFILL_POLICIES``,
``CACHE_POLICIES``), and how a run's budget maps onto each policy's knobs.

A policy spec is ``name`` or ``name:knob=value,knob=value`` (e.g. ``latent:delay=4``); values are read as JSON where
they parse (``4``, ``0.5``, ``true``, ``null``) and as strings otherwise. Prefill knobs that are `EntropyConfig`
fields (``entropy:observation=critiprefill``) go to the shared config. The budget of a run is a separate axis: the
prefill budget ``B_0`` (key tokens per segment) is ``EntropyConfig.base_budget`` (the top-k of ``entropy_paper``
and ``critiprefill``; ``entropy`` at its default coverage rule does not read it: sweep ``entropy:coverage=C``),
the local window of ``streaming``, the least tokens of columns and of diagonals ``min_budget`` of ``flexprefill``,
whose ``gamma`` then adds what the input needs); the cache budget ``B_d`` (entries per KV head) is
the cache policy's ``budget``. ``xattention`` (a mass threshold) and ``vertical_slash`` (fixed counts of columns and
diagonals) have no budget axis: they run once, at their knobs. The cache ``static_latent`` is the ``latent`` policy
in a `flexentropy.StaticLatentKVCache` (the captured-decode cache), with the same knobs.
"""

from __future__ import annotations

import json
from typing import Any

from flexentropy.config import EntropyConfig

UNBUDGETED_PREFILL = ("dense", "xattention", "vertical_slash")
"""Prefill policies without a budget (a run of them has ``prefill_budget=None``)."""


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name:k=v,k2=v2"`` -> ``("name", {"k": v, "k2": v2})``."""
    name, _, rest = spec.partition(":")
    knobs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"policy spec {spec!r}: expected knob=value, got {item!r}")
        try:
            knobs[key] = json.loads(raw)
        except json.JSONDecodeError:
            knobs[key] = raw
    if not name:
        raise ValueError(f"policy spec {spec!r} has no name")
    return name, knobs


def spec_label(spec: str) -> str:
    """A file-name-safe label of a spec: ``latent:delay=4`` -> ``latent_delay4``."""
    name, knobs = parse_spec(spec)
    return "_".join([name, *(f"{k}{v}" for k, v in knobs.items())]).replace("/", "-").replace(" ", "")


STATIC_LATENT = "static_latent"
"""Cache spec name of the ``latent`` policy stored in a `flexentropy.StaticLatentKVCache`."""


def _registries() -> tuple[dict[str, type], dict[str, type]]:
    from flexentropy.policies import CACHE_POLICIES, PREFILL_POLICIES

    return PREFILL_POLICIES, CACHE_POLICIES


def prefill_has_budget(spec: str) -> bool:
    return parse_spec(spec)[0] not in UNBUDGETED_PREFILL


def cache_has_budget(spec: str) -> bool:
    """Whether the cache policy has a ``budget`` knob (``full`` has none)."""
    name, _ = parse_spec(spec)
    name = "latent" if name == STATIC_LATENT else name
    caches = _registries()[1]
    if name not in caches:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(caches)}")
    return "budget" in caches[name].knob_names()


def make_prefill_policy(spec: str, config: EntropyConfig, budget: float | None) -> Any:
    """The `PrefillPolicy` of ``spec`` over ``config``, with ``budget`` (``B_0``) applied where it goes."""
    from flexentropy.policies import make_prefill

    name, knobs = parse_spec(spec)
    return make_prefill(name, config if budget is None else config.replace(base_budget=budget), **knobs)


def apply_prefill(model: Any, policy: Any) -> None:
    """Switch ``model`` to flexentropy attention running prefill ``policy``, its own knobs included
    (`flexentropy.enable`)."""
    from flexentropy.integrations.hf import enable

    enable(model, prefill=policy)


def make_run_cache(model: Any, spec: str, budget: int | None) -> Any:
    """A fresh transformers ``Cache`` of cache policy ``spec`` (``budget`` = ``B_d`` where it has one)."""
    from flexentropy.caches import StaticLatentKVCache, make_cache
    from flexentropy.policies import LatentPolicy

    name, knobs = parse_spec(spec)
    if budget is not None:
        knobs = {"budget": int(budget), **knobs}
    if name == STATIC_LATENT:
        return StaticLatentKVCache(LatentPolicy.from_knobs(**knobs).config, model=model)
    return make_cache(name, model=model, **knobs)
