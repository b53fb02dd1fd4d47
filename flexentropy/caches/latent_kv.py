"""`LatentKVCache`: the paper's latent KV-cache eviction (design.md §2; paper sec. 4.3, Alg. 4) as a transformers
``Cache``: the ``latent`` policy (`flexentropy.policies.LatentPolicy`, the rule) on `PolicyCache` (the storage),
configured by an `EntropyConfig`'s ``decode_*`` fields."""

from __future__ import annotations

from typing import Any

from flexentropy.caches.policy_cache import PolicyCache
from flexentropy.config import EntropyConfig, check_config
from flexentropy.policies.cache.latent import LatentPolicy


class LatentKVCache(PolicyCache):
    """Latent KV-cache compression as a transformers 5.x ``Cache``; pass it as ``cache=`` (``past_key_values=``
    before transformers 5.24) to a forward or ``generate`` of a model switched by `flexentropy.enable`.

    The full cache is kept through prefill and the first ``decode_delay`` generated tokens; then every cached key is
    scored by the last ``decode_window`` post-RoPE queries and each KV head keeps the window's own entries plus the
    best others, ``decode_budget`` in all; with ``recompress_every = R`` again whenever ``decode_budget + R`` are
    stored (None: once, as the paper). A prompt fed in several forwards counts its later chunks as generated tokens.
    Driving it from your own attention module (the hand-over contract: design.md §3.2)::

        cache.observe_queries(q, layer_idx)          # q [B, Hq, q_len, D], post-RoPE, on every forward
        k, v = cache.update(k_new, v_new, layer_idx)  # [B, Hkv, S, D]: compressed, per KV head
        out = cache.attend(q, layer_idx)              # decode attention over what is kept

    Args:
        config: the `EntropyConfig` (its ``decode_*`` fields and ``recompress_every``); default ``EntropyConfig()``.
        model, num_layers: as for `PolicyCache` (optional).
    """

    def __init__(self, config: EntropyConfig | None = None, *, model: Any = None,
                 num_layers: int | None = None) -> None:
        config = check_config(config, optional=True)
        super().__init__(LatentPolicy(config), model=model, num_layers=num_layers)
        self.config = config
