"""`make_cache`: a fresh transformers ``Cache`` running a cache policy chosen by name."""

from __future__ import annotations

from typing import Any

from flexentropy.caches.latent_kv import LatentKVCache
from flexentropy.caches.policy_cache import PolicyCache
from flexentropy.policies import CachePolicy, LatentPolicy, make_cache_policy


def make_cache(policy: str | CachePolicy = "full", *, model: Any = None, num_layers: int | None = None,
               **knobs: Any) -> PolicyCache:
    """A fresh transformers ``Cache`` running a cache policy; pass it as the cache of ``generate`` or a forward.

    Args:
        policy: a name of `flexentropy.CACHE_POLICIES` or a `CachePolicy`.
        model: the HF model it will serve (its layer count).
        num_layers: layer count when no model is given (PyramidKV).
        knobs: the policy's knobs (e.g. ``budget=512``).

    Returns:
        a `PolicyCache`; for ``"latent"`` a `LatentKVCache` configured by the equivalent `EntropyConfig`.
    """
    rule = make_cache_policy(policy, **knobs)
    if isinstance(rule, LatentPolicy):
        return LatentKVCache(rule.config, model=model, num_layers=num_layers)
    return PolicyCache(rule, model=model, num_layers=num_layers)
