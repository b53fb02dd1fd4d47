"""Every prefill and KV-cache policy of flexentropy, selectable by name (design.md §3-4).

Two registries map a name to a policy class (a frozen dataclass of validated knobs with defaults)::

    PREFILL_POLICIES   dense, entropy, entropy_paper, critiprefill, streaming, flexprefill, xattention, vertical_slash
    CACHE_POLICIES     full, latent, snapkv, adakv, pyramidkv, streamingllm, h2o, infokv, bounded

Prefill policies map a layer's ``q``/``k`` to a `SparsePlan` run by the same FlexAttention kernel; cache policies are
rules (when to decide, how to score, how many to keep per KV head) written against `LayerView` and run by one
transformers ``Cache``, `flexentropy.caches.PolicyCache` (built by `flexentropy.make_cache`). Any prefill composes
with any cache. Adding a policy: one file under ``policies/prefill/`` or ``policies/cache/`` and one line in the
registry below. Nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from flexentropy.config import EntropyConfig, check_config
from flexentropy.policies.base import CachePolicy, PrefillPolicy
from flexentropy.policies.cache.adakv import AdaKV
from flexentropy.policies.cache.bounded import BoundedCache
from flexentropy.policies.cache.full import FullCache
from flexentropy.policies.cache.h2o import H2O
from flexentropy.policies.cache.infokv import InfoKV
from flexentropy.policies.cache.latent import LatentPolicy
from flexentropy.policies.cache.pyramidkv import PyramidKV
from flexentropy.policies.cache.snapkv import SnapKV
from flexentropy.policies.cache.streamingllm import StreamingLLM
from flexentropy.policies.layer_view import LayerView
from flexentropy.policies.prefill.critiprefill import CritiPrefill
from flexentropy.policies.prefill.dense import DensePrefill
from flexentropy.policies.prefill.entropy.policy import EntropyPaperPrefill, EntropyPrefill
from flexentropy.policies.prefill.flexprefill import FlexPrefill
from flexentropy.policies.prefill.streaming import StreamingPrefill
from flexentropy.policies.prefill.vertical_slash import VerticalSlash
from flexentropy.policies.prefill.xattention import XAttention

PREFILL_POLICIES: dict[str, type[PrefillPolicy]] = {
    "dense": DensePrefill,
    "entropy": EntropyPrefill,
    "entropy_paper": EntropyPaperPrefill,
    "critiprefill": CritiPrefill,
    "streaming": StreamingPrefill,
    "flexprefill": FlexPrefill,
    "xattention": XAttention,
    "vertical_slash": VerticalSlash,
}
"""Prefill policy name -> class."""

CACHE_POLICIES: dict[str, type[CachePolicy]] = {
    "full": FullCache,
    "latent": LatentPolicy,
    "snapkv": SnapKV,
    "adakv": AdaKV,
    "pyramidkv": PyramidKV,
    "streamingllm": StreamingLLM,
    "h2o": H2O,
    "infokv": InfoKV,
    "bounded": BoundedCache,
}
"""Cache policy name -> class."""


def _lookup(registry: dict[str, type], kind: str, name: object) -> type:
    if name not in registry:
        raise ValueError(f"unknown {kind} policy {name!r}; choose one of {', '.join(registry)}")
    return registry[name]


def unknown_knobs(kind: str, policy: str, given: Iterable[str], names: Iterable[str]) -> str | None:
    """None if every name of ``given`` is in ``names``, else the message that names the unknown ones and the
    ``kind`` (prefill or cache) policy's own knobs: ``"prefill policy 'xattention' has no knob(s) ['treshold']; its
    knobs: threshold, stride, ..."``."""
    names = tuple(names)
    unknown = sorted(set(given) - set(names), key=str)
    if not unknown:
        return None
    takes = f"its knobs: {', '.join(names)}" if names else "it takes no knobs"
    return f"{kind} policy {policy!r} has no knob(s) {unknown}; {takes}"


def prefill_knob_names(policy: str) -> tuple[str, ...]:
    """The names of the prefill policy ``policy``'s own knobs (its fields but ``config``; `PrefillPolicy.knobs`)."""
    return tuple(f.name for f in fields(_lookup(PREFILL_POLICIES, "prefill", policy)) if f.name != "config")


def make_prefill(policy: str | PrefillPolicy = "entropy", config: EntropyConfig | None = None,
                 **knobs: Any) -> PrefillPolicy:
    """A prefill policy by name (or a policy object, returned as is when no other argument is given).

    Args:
        policy: a name of `PREFILL_POLICIES` or a `PrefillPolicy`.
        config: the shared `EntropyConfig` (geometry, budgets, dense fallbacks); default ``EntropyConfig()``.
        knobs: the policy's own knobs (e.g. ``window=`` for ``"streaming"``) and/or `EntropyConfig` fields, which
            are applied to ``config``; a name that is neither is a `TypeError` that lists the policy's knobs.
    """
    if isinstance(policy, PrefillPolicy):
        if config is not None or knobs:
            raise TypeError("pass either a PrefillPolicy object or a name with config/knobs, not both")
        return policy
    cls = _lookup(PREFILL_POLICIES, "prefill", policy)
    own = prefill_knob_names(policy)
    wrong = unknown_knobs("prefill", policy, set(knobs) - {f.name for f in fields(EntropyConfig)}, own)
    if wrong:
        raise TypeError(f"{wrong}; EntropyConfig's fields are taken too (set on config)")
    config = check_config(config, optional=True)
    config_knobs = {k: v for k, v in knobs.items() if k not in own}
    if config_knobs:
        config = config.replace(**config_knobs)
    return cls(config=config, **{k: v for k, v in knobs.items() if k in own})


def prefill_policy(prefill: str | PrefillPolicy = "entropy", config: EntropyConfig | None = None) -> PrefillPolicy:
    """The prefill policy a front door runs (`flexentropy.enable`, `flexentropy.EntropyAttention`): a name of
    `PREFILL_POLICIES` on ``config`` (default ``EntropyConfig()``) with the rule's default knobs, or a `PrefillPolicy`
    as is (it carries its config: leave ``config`` None or pass the same one)."""
    if isinstance(prefill, PrefillPolicy):
        if config is not None and config != prefill.config:
            raise TypeError("a PrefillPolicy carries its EntropyConfig: pass config=None (or the policy's own config)")
        return prefill
    return make_prefill(prefill, check_config(config, optional=True))


def make_cache_policy(policy: str | CachePolicy, **knobs: Any) -> CachePolicy:
    """A cache policy (the rule, without storage) by name, with its knobs (or a `CachePolicy` as is)."""
    if isinstance(policy, CachePolicy):
        if knobs:
            raise TypeError("pass either a CachePolicy object or a name with knobs, not both")
        return policy
    cls = _lookup(CACHE_POLICIES, "cache", policy)
    wrong = unknown_knobs("cache", policy, knobs, cls.knob_names())
    if wrong:
        raise TypeError(wrong)
    return cls.from_knobs(**knobs)


__all__ = [
    "CACHE_POLICIES",
    "PREFILL_POLICIES",
    "AdaKV",
    "BoundedCache",
    "CachePolicy",
    "CritiPrefill",
    "DensePrefill",
    "EntropyPaperPrefill",
    "EntropyPrefill",
    "FlexPrefill",
    "FullCache",
    "H2O",
    "InfoKV",
    "LayerView",
    "LatentPolicy",
    "PrefillPolicy",
    "PyramidKV",
    "SnapKV",
    "StreamingLLM",
    "StreamingPrefill",
    "VerticalSlash",
    "XAttention",
    "make_cache_policy",
    "make_prefill",
    "prefill_policy",
]
