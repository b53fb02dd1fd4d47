"""`LatentKVCache`: latent KV-cache compression during decoding (SPEC 2; paper sec. 4.3, Appendix B Alg. 4).

A transformers 5.x layered :class:`~transformers.Cache` (one :class:`LatentLayer` per attention layer) that keeps the
full cache through prefill and the first ``decode_delay`` generated tokens, then scores every cached key with a
window of the most recent post-RoPE queries (which by then include the generated tokens' own queries), keeps the
window's own entries plus the best others up to ``decode_budget`` per KV head, and appends later tokens. Built on
the shared *score -> keep -> gather* machinery (:mod:`.scoring`, :mod:`.keep`).

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
* with ``recompress_every = R``, every later ``update`` that finds ``decode_budget + R`` entries stored evicts
  again, so that at most ``decode_budget + R`` entries per head are stored or attended to (decoding one token at
  a time).

The window's cached entries are always kept (so the cache never shrinks below the window) and kept entries stay in
their original order; the cache keeps every entry's original position. RoPE positions are never changed:
``get_seq_length()`` reports the logical length (tokens seen), ``stored_length()`` the entries actually held, and
``get_mask_sizes()`` the stored count with an offset, so HF masks and positions stay right after an eviction.

Limits. A prompt fed in several forwards (chunked prefill) counts its later chunks as generated tokens. HF padding
masks index tokens by logical position, which per-head kept entries cannot follow: with left-padded batches, a
padded entry that a head keeps is attended after the eviction (derive the mask from ``kept_positions()`` instead).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from flexentropy._checks import check_layer_idx
from flexentropy.cache.keep import gather_kv, keep_indices
from flexentropy.cache.scoring import pool_scores, window_attention_scores
from flexentropy.config import EntropyConfig


class LatentLayer(CacheLayerMixin):
    """One attention layer's state in a :class:`LatentKVCache` (use the cache's methods, not this directly).

    Attributes:
        keys, values: ``[B, Hkv, S, D]``, ``[B, Hkv, S, Dv]`` stored entries, per KV head.
        window: ``[B, Hq, <= decode_window, D]`` the most recent handed-over queries, or None.
        seen: tokens appended so far (the logical length). ``observed``: queries handed over so far.
        prompt_length: tokens of the first ``update`` (None before it). ``evictions``: evictions so far.
    """

    is_compileable = False
    is_croppable = False  # an eviction cannot be rolled back
    is_sliding = False

    def __init__(self, config: EntropyConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self._clear()

    def _clear(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        # Positions of the stored entries: those kept by the last eviction ([B, Hkv, K] int64, None before any),
        # then the tokens appended since, at positions _evicted_at .. seen - 1 (nothing to update per token).
        self._kept: torch.Tensor | None = None
        self._evicted_at = 0
        self.window: torch.Tensor | None = None
        self.seen = 0
        self.observed = 0
        self.prompt_length: int | None = None
        self.evictions = 0
        self._delay_reached = False

    @property
    def stored(self) -> int:
        """Entries held per KV head."""
        return self.keys.shape[-2] if self.is_initialized else 0

    @property
    def generated(self) -> int:
        """Tokens appended after the prompt (the first ``update``)."""
        return 0 if self.prompt_length is None else self.seen - self.prompt_length

    def positions(self) -> torch.Tensor:
        """``[B, Hkv, S]`` int64 logical position of every stored entry, ascending along ``S``."""
        if not self.is_initialized:
            raise ValueError(f"layer {self.layer_idx} of the LatentKVCache holds nothing yet")
        appended = torch.arange(self._evicted_at, self.seen, device=self.keys.device)
        appended = appended.expand(*self.keys.shape[:2], self.seen - self._evicted_at)
        return appended if self._kept is None else torch.cat([self._kept, appended], dim=-1)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_empty(batch, heads, 0, key_states.shape[-1])
        self.values = value_states.new_empty(batch, heads, 0, value_states.shape[-1])
        self.is_initialized = True

    def observe(self, query_states: torch.Tensor) -> None:
        """Append ``query_states [B, Hq, q_len, D]`` to the window, keeping the last ``decode_window``."""
        size = self.config.decode_window
        tail = query_states[:, :, -size:]
        if self.window is None:
            parts = [tail]
        else:
            parts = [self.window[:, :, max(0, self.window.shape[2] + tail.shape[2] - size) :], tail]
        self.window = torch.cat(parts, dim=2)  # a copy: never a view of a whole prompt's queries
        self.observed += query_states.shape[-2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Evict if due (module docstring), then append; returns ``(keys, values)``, ``[B, Hkv, S, D]``."""
        q_len = key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.observed and self.observed not in (self.seen, self.seen + q_len):
            raise ValueError(
                f"LatentKVCache layer {self.layer_idx}: {self.observed} queries were handed over for {self.seen} "
                f"cached tokens and {q_len} new ones; observe_queries(query_states, layer_idx) must receive every "
                f"forward's post-RoPE queries [B, Hq, q_len={q_len}, D], with the same q_len as update()'s key_states"
            )
        if self._eviction_due():
            self._evict()
        self._delay_reached = self.prompt_length is not None and self.generated >= self.config.decode_delay
        if self.prompt_length is None:
            self.prompt_length = q_len
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.seen += q_len
        return self.keys, self.values

    def _eviction_due(self) -> bool:
        """Whether the next ``update`` evicts before appending (module docstring, "When eviction fires")."""
        config = self.config
        if self.prompt_length is None or self.generated < config.decode_delay:
            return False
        if not self._delay_reached:
            return self.stored > config.decode_budget
        return config.recompress_every is not None and self.stored >= config.decode_budget + config.recompress_every

    def _evict(self) -> None:
        """Score -> keep -> gather down to ``decode_budget`` entries per KV head (paper Alg. 4 steps 1-4)."""
        config = self.config
        if self.window is None:
            raise RuntimeError(
                f"LatentKVCache layer {self.layer_idx} must evict ({self.stored} entries > decode_budget="
                f"{config.decode_budget}) but no queries were handed over: the attention must call "
                f"cache.observe_queries(query_states, layer_idx) with its post-RoPE queries on every forward"
            )
        # Step 1: the window is the last W' handed-over queries, at positions first .. observed - 1.
        first = self.observed - self.window.shape[-2]
        device = self.keys.device
        key_positions = torch.arange(self.stored, device=device) if self._kept is None else self.positions()
        # Step 2: global importance of every cached key, per KV head.
        scores = window_attention_scores(
            self.window, self.keys, query_positions=torch.arange(first, self.observed, device=device),
            key_positions=key_positions, kind=config.decode_score,
        )
        scores = pool_scores(scores, config.decode_pool)
        # Step 3: the window's cached positions (first .. seen - 1) are the last stored entries: always kept, since
        # every earlier eviction kept its own window and later tokens were appended after it.
        indices = keep_indices(scores, config.decode_budget, forced=max(0, self.seen - first))
        # Step 4: compressed cache, original order.
        self.keys, self.values, self._kept = gather_kv(self.keys, self.values, indices, key_positions)
        self._evicted_at = self.seen
        self.evictions += 1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for HF masks: what the next ``update`` returns, after any due eviction.

        Stored entries all precede the new tokens, so numbering them ``seen - stored .. seen - 1`` keeps the causal
        mask right; the new tokens get their true positions ``seen ..``.
        """
        stored = min(self.stored, self.config.decode_budget) if self._eviction_due() else self.stored
        return stored + query_length, self.seen - stored

    def get_seq_length(self) -> int:
        """Logical length: tokens seen, evicted ones included (the next token's RoPE position)."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows ``beam_idx`` (beam search)."""
        for name in ("keys", "values", "_kept", "window"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, beam_idx.to(tensor.device)))

    def reset(self) -> None:
        """Drop everything, as before the first forward."""
        self._clear()

    def nbytes(self) -> int:
        """Bytes held: stored keys and values, kept positions and the query window."""
        tensors = (self.keys, self.values, self._kept, self.window)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class LatentKVCache(Cache):
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
    """

    def __init__(self, config: EntropyConfig | None = None) -> None:
        config = EntropyConfig() if config is None else config
        if not isinstance(config, EntropyConfig):
            raise TypeError(f"config must be an EntropyConfig, got {type(config).__name__}")
        super().__init__(layers=[])
        self.config = config
        self._dims: dict[str, tuple[int, str]] = {}  # name -> (size, the call that fixed it)

    def _layer(self, layer_idx: int) -> LatentLayer:
        check_layer_idx(layer_idx)
        while len(self.layers) <= layer_idx:
            self.layers.append(LatentLayer(self.config, len(self.layers)))
        return self.layers[layer_idx]

    def _check_dims(self, where: str, **sizes: int) -> None:
        """Every layer and call must agree on batch size, heads and head dims; GQA needs Hq % Hkv == 0."""
        for name, size in sizes.items():
            expected, origin = self._dims.setdefault(name, (size, where))
            if size != expected:
                raise ValueError(f"{where}: expected {name} {expected} (as in {origin}), got {size}; every layer of "
                                 f"a LatentKVCache must share batch size, heads and head dims")
        if "query_heads" in self._dims and "kv_heads" in self._dims:
            (q_heads, _), (kv_heads, _) = self._dims["query_heads"], self._dims["kv_heads"]
            if q_heads % kv_heads:
                raise ValueError(f"{where}: query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")

    def observe_queries(self, query_states: torch.Tensor, layer_idx: int) -> None:
        """Hand over one forward's post-RoPE queries ``[B, Hq, q_len, D]`` of layer ``layer_idx`` (every forward).

        Only the last ``decode_window`` queries are kept (a copy). See the module docstring for the contract.
        """
        if not isinstance(query_states, torch.Tensor) or query_states.dim() != 4 or query_states.shape[2] == 0:
            got = list(query_states.shape) if isinstance(query_states, torch.Tensor) else type(query_states).__name__
            raise ValueError(f"observe_queries expects post-RoPE query_states [B, Hq, q_len >= 1, D], got {got}")
        batch, q_heads, _, dim = query_states.shape
        where = f"observe_queries(layer_idx={layer_idx}) query_states {list(query_states.shape)}"
        self._check_dims(where, batch_size=batch, query_heads=q_heads, head_dim=dim)
        layer = self._layer(layer_idx)
        if layer.is_initialized and query_states.device != layer.keys.device:
            raise ValueError(f"{where} is on {query_states.device}, expected {layer.keys.device} like the keys")
        layer.observe(query_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states [B, Hkv, q_len, D]``, ``value_states [B, Hkv, q_len, Dv]`` to layer ``layer_idx``
        (evicting first when due) and return the layer's stored ``(keys, values)``, ``[B, Hkv, S, D]``."""
        for name, tensor in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 or tensor.shape[2] == 0:
                got = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"update expects {name} [B, Hkv, q_len >= 1, D], got {got}")
        where = f"update(layer_idx={layer_idx}) key_states {list(key_states.shape)}"
        if value_states.shape[:3] != key_states.shape[:3]:
            raise ValueError(f"{where}: expected value_states [B, Hkv, q_len, Dv] = {list(key_states.shape[:3])} "
                             f"+ [Dv], got {list(value_states.shape)}")
        batch, kv_heads, _, dim = key_states.shape
        self._check_dims(where, batch_size=batch, kv_heads=kv_heads, head_dim=dim, value_dim=value_states.shape[-1])
        return self._layer(layer_idx).update(key_states, value_states)

    def stored_length(self, layer_idx: int = 0) -> int:
        """Entries held per KV head in layer ``layer_idx`` (``get_seq_length`` is the logical length)."""
        return self.layers[layer_idx].stored if layer_idx < len(self.layers) else 0

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor:
        """``[B, Hkv, S]`` int64 original token position of each stored entry of layer ``layer_idx``."""
        if layer_idx >= len(self.layers):
            raise ValueError(f"layer {layer_idx} of the LatentKVCache holds nothing yet ({len(self.layers)} layers)")
        return self.layers[layer_idx].positions()

    def nbytes(self, layer_idx: int | None = None) -> int:
        """Bytes held by layer ``layer_idx`` (all layers when None): keys, values, kept positions, query window."""
        layers = self.layers if layer_idx is None else self.layers[layer_idx : layer_idx + 1]
        return sum(layer.nbytes() for layer in layers)
