"""`PolicyCache`: one transformers ``Cache`` for every KV-cache policy (SPEC 2-3).

A :class:`~flexentropy.policies.base.CachePolicy` is a rule (when to decide, how to score, how many to keep per KV
head); this module is everything else, shared: per-layer storage per KV head, logical positions after evictions, the
rolling window of handed-over queries, per-entry statistics gathered with the entries, the hand-over of queries and
model signals, HF mask sizes, beam reordering, memory accounting, and decode attention (rectangular or ragged).

Hand-over. Keys and values arrive through ``update`` as in any HF cache. Policies that score with queries need the
attention to call ``cache.observe_queries(query_states, layer_idx)`` on every forward with its post-RoPE queries
``[B, Hq, q_len, D]`` (before or after ``update``; flexentropy's HF attention does it). InfoKV-style policies also need
each decoder layer's hidden states and the predictive distribution: `flexentropy.cache.signals.attach_signals` (called
when the cache is built with ``model=``) registers forward hooks that call ``observe_hidden`` and ``finish_forward``.

Decision points (per layer):

* ``update``: ``policy.before_append(layer, q_len)``, before the new tokens are appended (decode-time eviction, so the
  stored count never exceeds the policy's capacity);
* *settled*: once the layer's stored keys, handed-over queries and (signal policies) signals all cover the same
  tokens, ``policy.when_settled(layer)``: compression right after the prompt's forward (SnapKV & co.; the attention
  of that forward still reads the full keys ``update`` returned), or every so many tokens (InfoKV).

Positions. Evictions never renumber: ``get_seq_length()`` is the logical length (the next RoPE position),
``stored_length()`` the entries held, ``kept_positions()`` each entry's token position, and ``get_mask_sizes()`` the
stored count with an offset, so HF masks stay right.

Ragged layers. After a ragged decision (AdaKV) a layer stores its kept entries flat, without padding
(`flexentropy.cache.ragged`), plus a rectangular tail of later tokens. HF attention code cannot read that layout:
``update`` then returns a zero-memory NaN placeholder of the padded shape (so a reader that does not know the layout
fails loudly), and attention must go through ``cache.attend(query, layer_idx, ...)`` (flexentropy's attention does).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from flexentropy._checks import check_layer_idx
from flexentropy.cache.attention import decode_attention, grouped_attention, kept_columns
from flexentropy.cache.keep import gather_kv
from flexentropy.cache.ragged import _segment_ids, ragged_decode_attention
from flexentropy.policies.base import CachePolicy


class RaggedKV(NamedTuple):
    """Per-head kept entries without padding: ``keys [T, D]``, ``values [T, Dv]``, ``positions [T]`` (int64), head
    ``(b, h)``'s ``counts[b, h]`` entries contiguous, heads in row-major ``(b, h)`` order."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    counts: torch.Tensor


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class PolicyLayer(CacheLayerMixin):
    """One attention layer's state in a :class:`PolicyCache` (use the cache's methods, not this directly).

    Attributes:
        keys, values: ``[B, Hkv, S, D]``, ``[B, Hkv, S, Dv]`` stored entries per KV head (for a ragged layer: the
            rectangular tail appended after its ragged part).
        ragged: the ragged part (`RaggedKV`) of a ragged layer, else None.
        window: ``[B, Hq, <= policy.query_window, D]`` the most recent handed-over queries, or None.
        stats: per-entry statistics ``[B, Hkv, S]`` (``policy.stats``), gathered with the entries.
        seen: tokens appended so far (the logical length). ``observed``: queries handed over so far.
        prompt_length: tokens of the first ``update`` (None before it). ``evictions``: decisions applied so far.
        previous_generated: tokens generated before the previous ``update`` (None before the first after the prompt).
        signals_until: tokens whose model signals are recorded (signal policies).
    """

    is_compileable = False
    is_croppable = False  # an eviction cannot be rolled back

    def __init__(self, policy: CachePolicy, layer_idx: int, owner: str = "PolicyCache",
                 num_layers: int | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.layer_idx = layer_idx
        self.owner = owner
        self.num_layers = num_layers
        self._clear()

    def _clear(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        # Positions of the rectangular entries: those kept by the last decision ([B, Hkv, K] int64, None before any),
        # then the tokens appended since, at positions _evicted_at .. seen - 1 (nothing to update per token).
        self._kept: torch.Tensor | None = None
        self._evicted_at = 0
        self.ragged: RaggedKV | None = None
        self._longest = 0  # entries of the longest head of the ragged part (kept on the host: no sync per step)
        self.window: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[torch.Tensor, int]] = []
        self.seen = 0
        self.observed = 0
        self.prompt_length: int | None = None
        self.previous_generated: int | None = None
        self.evictions = 0
        self.signals_until = 0
        self.padding: torch.Tensor | None = None  # [B] int64 left-padding tokens of each row's prompt, or None
        self.sliding_window: int | None = None  # a sliding-window layer keeps its last window - 1 tokens, no policy

    # -- views -------------------------------------------------------------------------------------------------
    @property
    def is_sliding(self) -> bool:
        """Whether the layer attends a sliding window (`PolicyCache.observe_sliding`): HF sizes its masks by it."""
        return self.sliding_window is not None

    @property
    def stored(self) -> int:
        """Entries held per KV head (a ragged layer: its longest head)."""
        if not self.is_initialized:
            return 0
        return self.keys.shape[-2] + self._longest

    @property
    def generated(self) -> int:
        """Tokens appended after the prompt (the first ``update``)."""
        return 0 if self.prompt_length is None else self.seen - self.prompt_length

    def head_lengths(self) -> torch.Tensor:
        """int64 ``[B, Hkv]`` entries held by every (batch row, KV head)."""
        if not self.is_initialized:
            raise ValueError(f"layer {self.layer_idx} of the {self.owner} holds nothing yet")
        tail = torch.full(self.keys.shape[:2], self.keys.shape[-2], dtype=torch.long, device=self.keys.device)
        return tail if self.ragged is None else tail + self.ragged.counts

    def positions(self) -> torch.Tensor:
        """``[B, Hkv, S]`` int64 logical position of every rectangular entry, ascending along ``S``."""
        if not self.is_initialized:
            raise ValueError(f"layer {self.layer_idx} of the {self.owner} holds nothing yet")
        appended = torch.arange(self._evicted_at, self.seen, device=self.keys.device)
        appended = appended.expand(*self.keys.shape[:2], self.seen - self._evicted_at)
        return appended if self._kept is None else torch.cat([self._kept, appended], dim=-1)

    def row_positions(self) -> torch.Tensor:
        """``[B, Hkv, S]`` `positions` counted from each row's first real token: a left-padded row's padding entries
        are negative (equal to `positions` when no padding was handed over)."""
        positions = self.positions()
        return positions if self.padding is None else positions - self.padding[:, None, None]

    def real_entries(self) -> torch.Tensor | None:
        """``[B, Hkv, S]`` bool, False at the stored entries of left-padding tokens; None when there are none."""
        return None if self.padding is None else self.row_positions() >= 0

    def key_positions(self) -> torch.Tensor:
        """Positions for scoring: ``[S]`` before any decision (every head holds ``0 .. S-1``), else ``[B, Hkv, S]``."""
        if self._kept is None and self._evicted_at == 0:
            return torch.arange(self.stored, device=self.keys.device)
        return self.positions()

    def window_positions(self) -> torch.Tensor:
        """``[W']`` positions of the queries in ``window`` (the last ``W'`` handed over)."""
        return torch.arange(self.observed - self.window.shape[-2], self.observed, device=self.window.device)

    # -- hand-over ---------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_empty(batch, heads, 0, key_states.shape[-1])
        self.values = value_states.new_empty(batch, heads, 0, value_states.shape[-1])
        dtype = torch.promote_types(key_states.dtype, torch.float32)
        self.stats = {name: key_states.new_empty(batch, heads, 0, dtype=dtype) for name in self.policy.stats}
        self.is_initialized = True

    def observe(self, query_states: torch.Tensor) -> None:
        """Hand over one forward's queries ``[B, Hq, q_len, D]``: the rolling window keeps the last
        ``policy.query_window`` (a copy), accumulating policies get them once their keys are stored."""
        size = self.policy.query_window
        if size:
            tail = query_states[:, :, -size:]
            if self.window is None:
                parts = [tail]
            else:
                parts = [self.window[:, :, max(0, self.window.shape[2] + tail.shape[2] - size) :], tail]
            self.window = torch.cat(parts, dim=2)  # a copy: never a view of a whole prompt's queries
        if self.policy.accumulates:
            self._pending.append((query_states, self.observed))
        self.observed += query_states.shape[-2]
        self.settle()

    def record_signal(self, signal: torch.Tensor) -> None:
        """Store ``signal [B, L]`` (one value per token of the last forward, positions ``seen - L .. seen - 1``) in
        ``stats["signal"]`` at the entries of those positions."""
        length = signal.shape[-1]
        first = self.seen - length
        positions = self.positions()
        offset = positions - first
        inside = offset >= 0
        values = signal.to(self.stats["signal"].dtype)[:, None, :].expand(*positions.shape[:2], length)
        values = values.gather(-1, offset.clamp(0, max(length - 1, 0)))
        self.stats["signal"] = torch.where(inside, values, self.stats["signal"])
        self.signals_until = self.seen
        self.settle()

    # -- the cache API -----------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide if due (``policy.before_append``), append, settle; returns what the attention reads:
        ``(keys, values)`` ``[B, Hkv, S, D]`` (a ragged layer: a NaN placeholder, see the module docstring)."""
        q_len = key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        policy = self.policy
        if policy.uses_queries and self.observed and self.observed not in (self.seen, self.seen + q_len):
            raise ValueError(
                f"{self.owner} layer {self.layer_idx}: {self.observed} queries were handed over for {self.seen} "
                f"cached tokens and {q_len} new ones; observe_queries(query_states, layer_idx) must receive every "
                f"forward's post-RoPE queries [B, Hq, q_len={q_len}, D], with the same q_len as update()'s key_states"
            )
        if self.prompt_length is not None:
            if policy.uses_queries and self.observed == 0:
                self.missing_queries()
            if policy.needs_signals and self.signals_until < self.seen:
                raise RuntimeError(
                    f"{self.owner} layer {self.layer_idx} ({policy.name}) needs the model's hidden states and "
                    f"predictive distribution, which were not handed over: build the cache with the model "
                    f"(make_cache(name, model=model) or policy.build(model)), which attaches forward hooks"
                )
        if self.sliding_window is not None:
            self._keep_last(self.sliding_window - 1)
        else:
            target = policy.before_append(self, q_len)
            if target is not None:
                self._decide(target, q_len)
        self.previous_generated = self.generated if self.prompt_length is not None else None
        if self.prompt_length is None:
            self.prompt_length = q_len
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        for name, fill in policy.stats.items():
            new = self.stats[name].new_full((*key_states.shape[:2], q_len), fill)
            self.stats[name] = torch.cat([self.stats[name], new], dim=-1)
        self.seen += q_len
        result = self._readable()
        self.settle()
        return result

    def missing_queries(self) -> None:
        """Raise: the layer stored a forward's keys but was handed none of its queries."""
        raise RuntimeError(
            f"{self.owner} layer {self.layer_idx} ({self.policy.name}) scores cache entries with the model's queries, "
            f"but none were handed over: call flexentropy.enable(model) before running the model with this cache "
            f"(its attention hands them over), or, from your own attention, call cache.observe_queries(query_states, "
            f"layer_idx) with the post-RoPE queries on every forward"
        )

    def settle(self) -> None:
        """Fold pending queries and apply ``policy.when_settled`` once keys, queries and signals cover the same
        tokens (module docstring)."""
        policy = self.policy
        if not self.is_initialized or (policy.uses_queries and self.observed != self.seen):
            return
        pending, self._pending = self._pending, []
        for queries, first in pending:
            policy.on_queries(self, queries, first)
        if (policy.needs_signals and self.signals_until < self.seen) or self.sliding_window is not None:
            return
        target = policy.when_settled(self)
        if target is not None:
            self._decide(target, 0)

    def _decide(self, target: int, incoming: int) -> None:
        """Keep ``target`` entries per KV head (score -> keep -> gather), or per-head counts for ragged policies."""
        policy = self.policy
        if policy.query_window and self.window is None:
            raise RuntimeError(
                f"{self.owner} layer {self.layer_idx} must evict ({self.stored} entries -> {target}) but no queries "
                f"were handed over: the attention must call cache.observe_queries(query_states, layer_idx) with its "
                f"post-RoPE queries on every forward"
            )
        if self.ragged is not None:
            raise RuntimeError(f"{self.owner} layer {self.layer_idx}: a ragged layer is compressed once")
        if policy.ragged:
            self._make_ragged(policy.select_ragged(self, target))
        else:
            indices = (policy.select(self, target, incoming) if target > 0
                       else torch.zeros(*self.keys.shape[:2], 0, dtype=torch.long, device=self.keys.device))
            kept = gather_kv(self.keys, self.values, indices, self.positions())
            self.keys, self.values, self._kept = kept
            self.stats = {name: stat.gather(-1, indices) for name, stat in self.stats.items()}
        self._evicted_at = self.seen
        self.evictions += 1

    def _keep_last(self, count: int) -> None:
        """Keep the last ``count`` stored entries (a sliding-window layer, before it appends: as HF's
        ``DynamicSlidingWindowLayer``, attention then reads the window's ``count`` entries plus the new tokens)."""
        if self.stored <= count:
            return
        self._kept = self.positions()[..., -count:]
        self.keys, self.values = self.keys[..., -count:, :], self.values[..., -count:, :]
        self.stats = {name: stat[..., -count:] for name, stat in self.stats.items()}
        self._evicted_at = self.seen

    def _make_ragged(self, keep: torch.Tensor) -> None:
        """Store the entries of the bool mask ``keep [B, Hkv, S]`` flat, without padding (fresh, compact tensors)."""
        positions = self.positions()
        self.ragged = RaggedKV(self.keys[keep], self.values[keep], positions[keep], keep.sum(dim=-1))
        self._longest = int(self.ragged.counts.max()) if self.ragged.counts.numel() else 0
        self.keys = self.keys.new_empty(*self.keys.shape[:2], 0, self.keys.shape[-1])
        self.values = self.values.new_empty(*self.values.shape[:2], 0, self.values.shape[-1])
        self.stats = {name: stat[..., :0] for name, stat in self.stats.items()}
        self._kept = None

    def _readable(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ragged is None:
            return self.keys, self.values
        shape = (*self.keys.shape[:2], self.stored)
        nan = float("nan")
        return (self.keys.new_full((1, 1, 1, 1), nan).expand(*shape, self.keys.shape[-1]),
                self.values.new_full((1, 1, 1, 1), nan).expand(*shape, self.values.shape[-1]))

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
        """Attention of the ``L`` newest tokens (whose keys are stored last) over what the layer holds.

        Args:
            query: ``[B, Hq, L, D]`` post-RoPE.
            attention_mask: optional bool ``[B, 1, L, T]`` over *logical* key positions ``0 .. T-1`` (True: attend),
                e.g. a padding mask; the columns of the kept entries are read at their positions.
            scale: softmax scale (default ``1 / sqrt(D)``).

        Returns:
            ``[B, Hq, L, Dv]`` in the query's dtype.
        """
        if self.ragged is None:
            if attention_mask is None:
                return decode_attention(query, self.keys, self.values, scale=scale)
            return grouped_attention(query, self.keys, self.values, kept_columns(attention_mask, self.positions()),
                                     scale)
        ragged_allowed = tail_allowed = None
        if attention_mask is not None:
            mask = attention_mask[:, 0].transpose(1, 2)                                       # [B, T, L]
            row = _segment_ids(self.ragged.counts) // self.keys.shape[1]
            ragged_allowed = mask[row, self.ragged.positions]                                 # [T_kept, L]
            tail = self.positions()[:, :1]                                                   # [B, 1, t]
            tail_allowed = mask.gather(1, tail[:, 0, :, None].expand(-1, -1, mask.shape[-1]))  # [B, t, L]
            tail_allowed = tail_allowed.transpose(1, 2)[:, None].expand(-1, self.keys.shape[1], -1, -1)
        return ragged_decode_attention(query, self.ragged.keys, self.ragged.values, self.ragged.counts, self.keys,
                                       self.values, ragged_allowed=ragged_allowed, tail_allowed=tail_allowed,
                                       scale=scale)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for HF masks: what the next ``update`` returns, after any due decision.

        Stored entries all precede the new tokens, so numbering them ``seen - stored .. seen - 1`` keeps the causal
        mask right; the new tokens get their true positions ``seen ..``.
        """
        stored = self.stored
        if self.is_initialized:
            target = (self.sliding_window - 1 if self.sliding_window is not None
                      else self.policy.before_append(self, query_length))
            if target is not None:
                stored = min(stored, target)
        return stored + query_length, self.seen - stored

    def get_seq_length(self) -> int:
        """Logical length: tokens seen, evicted ones included (the next token's RoPE position)."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows ``beam_idx`` (beam search)."""
        for name in ("keys", "values", "_kept", "window", "padding"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, beam_idx.to(tensor.device)))
        self.stats = {name: stat.index_select(0, beam_idx.to(stat.device)) for name, stat in self.stats.items()}
        self._pending = [(q.index_select(0, beam_idx.to(q.device)), first) for q, first in self._pending]
        if self.ragged is not None:
            counts = self.ragged.counts
            beam_idx = beam_idx.to(counts.device)
            starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view_as(counts)[beam_idx].reshape(-1)
            lengths = counts[beam_idx].reshape(-1)
            offsets = lengths.cumsum(0) - lengths
            index = torch.repeat_interleave(starts - offsets, lengths) + torch.arange(int(lengths.sum()),
                                                                                      device=counts.device)
            self.ragged = RaggedKV(self.ragged.keys[index], self.ragged.values[index], self.ragged.positions[index],
                                   counts[beam_idx])
            self._longest = int(self.ragged.counts.max()) if self.ragged.counts.numel() else 0

    def reset(self) -> None:
        """Drop everything, as before the first forward."""
        self._clear()

    def nbytes(self) -> int:
        """Bytes held: stored keys and values (ragged part included), their positions and statistics, the query
        window."""
        ragged = () if self.ragged is None else tuple(self.ragged)
        return _nbytes(self.keys, self.values, self._kept, self.window, *self.stats.values(), *ragged)


class PolicyCache(Cache):
    """A transformers 5.x ``Cache`` running a :class:`~flexentropy.policies.base.CachePolicy` on every layer.

    Build one with ``flexentropy.policies.make_cache(name, model=model, **knobs)`` (or ``policy.build(model)``) and
    pass it as ``past_key_values`` to ``generate`` or a forward. From a plain attention module::

        cache.observe_queries(q, layer_idx)          # q [B, Hq, q_len, D], post-RoPE (policies that score with q)
        k, v = cache.update(k_new, v_new, layer_idx)  # [B, Hkv, S, D]: compressed, per KV head
        out = cache.attend(q, layer_idx)              # decode attention (also over a ragged layer)

    Args:
        policy: the rule.
        model: the HF model served (its layer count; signal policies attach their hooks to it).
        num_layers: layer count when no model is given (PyramidKV needs it).
    """

    layer_class: type[PolicyLayer] = PolicyLayer

    def __init__(self, policy: CachePolicy, *, model: Any = None, num_layers: int | None = None) -> None:
        if not isinstance(policy, CachePolicy):
            raise TypeError(f"policy must be a CachePolicy, got {type(policy).__name__}")
        super().__init__(layers=[])
        self.policy = policy
        if num_layers is None and model is not None:
            config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            num_layers = config.num_hidden_layers
        if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                       or num_layers < 1):
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        self.num_layers = num_layers
        self._dims: dict[str, tuple[int, str]] = {}  # name -> (size, the call that fixed it)
        self._hidden: dict[int, torch.Tensor] = {}
        if model is not None and policy.needs_signals:
            from flexentropy.cache.signals import attach_signals

            attach_signals(model)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.policy!r}, layers={len(self.layers)})"

    def _layer(self, layer_idx: int) -> PolicyLayer:
        check_layer_idx(layer_idx)
        while len(self.layers) <= layer_idx:
            self.layers.append(self.layer_class(self.policy, len(self.layers), type(self).__name__, self.num_layers))
        return self.layers[layer_idx]

    def _check_dims(self, where: str, **sizes: int) -> None:
        """Every layer and call must agree on batch size, heads and head dims; GQA needs Hq % Hkv == 0."""
        for name, size in sizes.items():
            expected, origin = self._dims.setdefault(name, (size, where))
            if size != expected:
                raise ValueError(f"{where}: expected {name} {expected} (as in {origin}), got {size}; every layer of "
                                 f"a {type(self).__name__} must share batch size, heads and head dims")
        if "query_heads" in self._dims and "kv_heads" in self._dims:
            (q_heads, _), (kv_heads, _) = self._dims["query_heads"], self._dims["kv_heads"]
            if q_heads % kv_heads:
                raise ValueError(f"{where}: query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")

    # -- hand-over -----------------------------------------------------------------------------------------------
    def observe_queries(self, query_states: torch.Tensor, layer_idx: int) -> None:
        """Hand over one forward's post-RoPE queries ``[B, Hq, q_len, D]`` of layer ``layer_idx`` (every forward)."""
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

    def observe_padding(self, real_tokens: torch.Tensor, layer_idx: int) -> None:
        """Hand over which prompt tokens are real, ``real_tokens [B, N]`` bool (before `observe_queries`).

        A left-padded row's padding entries are then never attended by the scores, rank below every real entry
        when entries are evicted, and are not sinks, so each row keeps what it would keep alone. Only left padding
        (each row's real tokens last and contiguous, as ``generate`` pads) is read; other patterns are ignored.
        """
        if not isinstance(real_tokens, torch.Tensor) or real_tokens.dtype != torch.bool or real_tokens.dim() != 2:
            got = (f"{real_tokens.dtype} {list(real_tokens.shape)}" if isinstance(real_tokens, torch.Tensor)
                   else type(real_tokens).__name__)
            raise ValueError(f"observe_padding expects a bool [B, N] mask of real tokens, got {got}")
        layer = self._layer(layer_idx)
        pads = (~real_tokens).sum(dim=-1)
        left = torch.arange(real_tokens.shape[-1], device=real_tokens.device) >= pads[:, None]
        layer.padding = pads if bool(pads.any()) and torch.equal(left, real_tokens) else None

    def observe_sliding(self, window: int, layer_idx: int) -> None:
        """Mark layer ``layer_idx`` as a sliding-window layer of ``window`` tokens (before its first ``update``): it
        then keeps only its last ``window - 1`` tokens, as transformers' own cache does, and the policy does not
        apply to it (flexentropy's HF attention calls this for Gemma3's local layers and the like)."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"observe_sliding expects a window of >= 1 tokens, got {window!r}")
        self._layer(layer_idx).sliding_window = window

    @property
    def wants_signals(self) -> bool:
        """Whether the policy needs ``observe_hidden``/``finish_forward`` (the hooks of `attach_signals`)."""
        return self.policy.needs_signals

    def observe_hidden(self, layer_idx: int, hidden_states: torch.Tensor) -> None:
        """Hand over decoder layer ``layer_idx``'s output hidden states ``[B, L, d]`` of the current forward (kept
        unit-normalised until `finish_forward`)."""
        self._hidden[layer_idx] = F.normalize(hidden_states.detach().float(), dim=-1).to(hidden_states.dtype)

    def finish_forward(self, last_hidden: torch.Tensor, logits_fn: Any, *, chunk: int = 1024) -> None:
        """End of a forward: the predictive entropy ``H [B, L]`` of its tokens, then every handed-over layer's signal
        ``policy.signal(h_l, h_L, H)`` recorded at its tokens' entries (and the layers settled).

        Args:
            last_hidden: the last decoder layer's output ``[B, L, d]`` (the final norm's input).
            logits_fn: maps ``[B, l, d]`` last-layer states to next-token logits ``[B, l, V]`` (final norm and LM
                head); applied in chunks of ``chunk`` tokens, so ``[B, L, V]`` is never built for long prompts.
        """
        from flexentropy.cache.signals import restricted_entropy

        hidden, self._hidden = self._hidden, {}
        if not hidden:
            return
        with torch.no_grad():
            last_hidden = last_hidden.detach()
            unit_last = F.normalize(last_hidden.float(), dim=-1)
            entropy = torch.cat([restricted_entropy(logits_fn(part), self.policy.top_k)
                                 for part in last_hidden.split(chunk, dim=1)], dim=1)
            for layer_idx, states in hidden.items():
                self.layers[layer_idx].record_signal(self.policy.signal(states, unit_last, entropy))

    # -- the cache API -------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states [B, Hkv, q_len, D]``, ``value_states [B, Hkv, q_len, Dv]`` to layer ``layer_idx``
        (deciding first when due) and return the layer's stored ``(keys, values)``, ``[B, Hkv, S, D]``."""
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
        previous = self.layers[layer_idx - 1] if 0 < layer_idx <= len(self.layers) else None
        if self.policy.uses_queries and previous is not None and previous.seen and not previous.observed:
            previous.missing_queries()  # its attention ran without handing over queries: fail at the first forward
        return self._layer(layer_idx).update(key_states, value_states)

    def attend(self, query: torch.Tensor, layer_idx: int, attention_mask: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
        """Decode attention of layer ``layer_idx``'s newest tokens over what it holds (`PolicyLayer.attend`)."""
        return self.layers[layer_idx].attend(query, attention_mask, scale)

    def is_ragged(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` stores per-head counts without padding (read it through `attend`)."""
        return layer_idx < len(self.layers) and self.layers[layer_idx].ragged is not None

    def stored_length(self, layer_idx: int = 0) -> int:
        """Entries held per KV head in layer ``layer_idx`` (ragged: the longest head; ``get_seq_length`` is the
        logical length)."""
        return self.layers[layer_idx].stored if layer_idx < len(self.layers) else 0

    def head_lengths(self, layer_idx: int = 0) -> torch.Tensor:
        """int64 ``[B, Hkv]`` entries held by every (batch row, KV head) of layer ``layer_idx``."""
        return self.layers[layer_idx].head_lengths()

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor:
        """``[B, Hkv, S]`` int64 original token position of each stored entry of layer ``layer_idx``."""
        if layer_idx >= len(self.layers):
            raise ValueError(f"layer {layer_idx} of the {type(self).__name__} holds nothing yet "
                             f"({len(self.layers)} layers)")
        if self.layers[layer_idx].ragged is not None:
            raise ValueError(f"layer {layer_idx} is ragged (per-head counts): read it through attend()")
        return self.layers[layer_idx].positions()

    def nbytes(self, layer_idx: int | None = None) -> int:
        """Real bytes held by layer ``layer_idx`` (all layers when None): keys, values, positions, statistics and
        the query window."""
        layers = self.layers if layer_idx is None else self.layers[layer_idx : layer_idx + 1]
        return sum(layer.nbytes() for layer in layers)
