"""`LatentKVCache`: latent KV-cache compression during decoding (SPEC 2; paper sec. 4.3, Appendix B Alg. 4).

A transformers 5.x layered :class:`~transformers.Cache` (one :class:`LatentLayer` per attention layer) that keeps the
full cache through prefill and the first ``decode_delay`` generated tokens, then scores every cached key with a
window of the most recent post-RoPE queries (which by then include the generated tokens' own queries), keeps the
window's own entries plus the best others up to ``decode_budget`` per KV head, and appends later tokens. Built on
the shared *score -> keep -> gather* machinery (:mod:`.scoring`, :mod:`.keep`): it is the ``latent`` policy
(:class:`~flexentropy.policies.cache.latent.LatentPolicy`, the rule) on :class:`~flexentropy.cache.base.PolicyCache`
(the storage and bookkeeping every cache policy shares).

Query hand-over. Keys and values arrive through ``update`` as in any HF cache; the queries needed for scoring do
not, so the module that owns the attention hands them over: on every forward (prefill and decode), call
``cache.observe_queries(query_states, layer_idx)`` with that forward's post-RoPE queries ``[B, Hq, q_len, D]``
(the same ``q_len`` as the ``key_states`` given to ``update``), preferably before ``cache.update(key_states,
value_states, layer_idx)``; after it is accepted too. The cache keeps the last ``decode_window`` of them per layer.
A layer never handed any query works as a plain dynamic cache until an eviction is due, which then raises.

When eviction fires. A layer's first ``update`` is its prompt (prefill); every token appended by a later ``update``
counts as generated. At the start of an ``update`` (before the new tokens are appended), once ``decode_delay``
tokens have been generated:

* the first such ``update`` evicts down to ``decode_budget`` entries per KV head if more are stored (prompts within
  budget are left alone); this is the paper's single latent eviction, scored with the window's queries: the last
  prompt queries, the ``decode_delay`` generated tokens' queries and, when handed over before ``update``, the
  current token's;
* with ``recompress_every = R`` (default 32), every later ``update`` that finds ``decode_budget + R`` entries
  stored evicts again, so that at most ``decode_budget + R`` entries per head are stored or attended to (decoding
  one token at a time); ``recompress_every=None`` evicts once, as the paper does, and the cache then grows by one
  entry per generated token.

The window's cached entries are always kept (so the cache never shrinks below the window) and kept entries stay in
their original order; the cache keeps every entry's original position. RoPE positions are never changed:
``get_seq_length()`` reports the logical length (tokens seen), ``stored_length()`` the entries actually held, and
``get_mask_sizes()`` the stored count with an offset, so HF masks and positions stay right after an eviction.

Limits. A prompt fed in several forwards (chunked prefill) counts its later chunks as generated tokens. HF padding
masks index tokens by logical position, which per-head kept entries cannot follow: with left-padded batches, a
padded entry that a head keeps is attended after the eviction (derive the mask from ``kept_positions()`` instead).
"""

from __future__ import annotations

from typing import Any

from flexentropy.cache.base import PolicyCache, PolicyLayer
from flexentropy.config import EntropyConfig
from flexentropy.policies.cache.latent import LatentPolicy


class LatentLayer(PolicyLayer):
    """One attention layer's state in a :class:`LatentKVCache` (use the cache's methods, not this directly).

    The bookkeeping is :class:`~flexentropy.cache.base.PolicyLayer`'s; the rule (when to evict, how to score) is
    :class:`~flexentropy.policies.cache.latent.LatentPolicy`'s.

    Attributes:
        keys, values: ``[B, Hkv, S, D]``, ``[B, Hkv, S, Dv]`` stored entries, per KV head.
        window: ``[B, Hq, <= decode_window, D]`` the most recent handed-over queries, or None.
        seen: tokens appended so far (the logical length). ``observed``: queries handed over so far.
        prompt_length: tokens of the first ``update`` (None before it). ``evictions``: evictions so far.
    """


class LatentKVCache(PolicyCache):
    """Latent KV-cache compression (SPEC 2, paper Alg. 4) as a transformers 5.x ``Cache``.

    Pass it as ``past_key_values=`` to a model's forward or ``generate``, or drive it from a plain attention module::

        cache.observe_queries(q, layer_idx)          # q [B, Hq, q_len, D], post-RoPE
        k, v = cache.update(k_new, v_new, layer_idx)  # [B, Hkv, S, D]: compressed, per KV head
        out = decode_attention(q, k, v)               # flexentropy.cache.decode_attention

    Eviction needs the queries: see the module docstring for the hand-over contract and exactly when eviction
    fires. Layers are created on first use; all must share batch size, KV heads and head dims.

    Args:
        config: the :class:`~flexentropy.EntropyConfig` (``decode_budget``, ``decode_window``, ``decode_delay``,
            ``decode_pool``, ``decode_score``, ``recompress_every``); default ``EntropyConfig()``.
        model, num_layers: as for :class:`~flexentropy.cache.base.PolicyCache` (optional).
    """

    layer_class = LatentLayer

    def __init__(self, config: EntropyConfig | None = None, *, model: Any = None,
                 num_layers: int | None = None) -> None:
        config = EntropyConfig() if config is None else config
        if not isinstance(config, EntropyConfig):
            raise TypeError(f"config must be an EntropyConfig, got {type(config).__name__}")
        super().__init__(LatentPolicy.from_config(config), model=model, num_layers=num_layers)
        self.config = config
