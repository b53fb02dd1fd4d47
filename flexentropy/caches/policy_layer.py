"""`PolicyLayer`: one attention layer's storage in a `PolicyCache`, implementing `LayerView` for its policy.

It holds the entries per KV head (rectangular, or ragged after a per-head decision: `flexentropy.caches.layout`),
their logical positions after evictions, the rolling window of handed-over queries, the per-entry statistics and its
counters (a `Progress`), and applies the policy's decisions at the two points the policy declares (design.md §3.2):
``before_append`` at the start of ``update``, ``when_settled`` once keys, queries and signals of a forward cover the
same tokens. Where its appends go (buffers with free slots, its own or lent) is `AppendBuffers`'.

Positions. Evictions never renumber: ``seen`` is the logical length (the next RoPE position), ``stored`` the entries
held, `positions` each entry's token position; ``get_mask_sizes`` gives HF the stored count with an offset.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers.cache_utils import CacheLayerMixin

from flexentropy.caches.append_buffers import AppendBuffers
from flexentropy.caches.layout import attend_entries, head_lengths, nan_entries
from flexentropy.caches.progress import Counted, Progress
from flexentropy.kv.keep import gather_kv
from flexentropy.kv.ragged import RaggedKV
from flexentropy.policies.base import CachePolicy


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by ``tensors`` (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class PolicyLayer(Counted, CacheLayerMixin):
    """One attention layer's state in a :class:`PolicyCache` (use the cache's methods, not this directly).

    Attributes:
        keys, values: ``[B, Hkv, S, D]``, ``[B, Hkv, S, Dv]`` stored entries per KV head (for a ragged layer: the
            rectangular tail appended after its ragged part).
        ragged: the ragged part (`RaggedKV`) of a ragged layer, else None.
        window: ``[B, Hq, <= policy.query_window, D]`` the most recent handed-over queries, or None.
        stats: per-entry statistics ``[B, Hkv, S]`` (``policy.stats``), gathered with the entries.
        progress: the counters (`Progress`): ``seen``, ``observed``, ``stored``, ``prompt_length`` (tokens of the
            first ``update``), ``previous_generated`` (tokens generated before the previous ``update``), ``evictions``
            (decisions applied), read under their own names (`Counted`).
        signals_until: tokens whose model signals are recorded (signal policies).
        appends: where the appends go (`AppendBuffers`).

    Args:
        reserve: slots allocated past the stored entries, so that the next appends write in place; 0: every append
            copies the stored entries (``torch.cat``).
    """

    is_compileable = False
    is_croppable = False  # an eviction cannot be rolled back

    def __init__(self, policy: CachePolicy, layer_idx: int, owner: str = "PolicyCache",
                 num_layers: int | None = None, *, reserve: int = 0) -> None:
        super().__init__()
        self.policy = policy
        self.layer_idx = layer_idx
        self.owner = owner
        self.num_layers = num_layers
        self.appends = AppendBuffers(reserve)
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
        self.window: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}
        self.appends.clear()
        self._pending: list[tuple[torch.Tensor, int]] = []
        self.progress = Progress()  # a new one: a static phase may hold the previous one (`StaticPhase`)
        self.signals_until = 0
        self.padding: torch.Tensor | None = None  # [B] int64 left-padding tokens of each row's prompt, or None
        self.sliding_window: int | None = None  # a sliding-window layer keeps its last window - 1 tokens, no policy

    # -- views -------------------------------------------------------------------------------------------------
    @property
    def is_sliding(self) -> bool:
        """Whether the layer attends a sliding window (`PolicyCache.observe_sliding`): HF sizes its masks by it."""
        return self.sliding_window is not None

    def head_lengths(self) -> torch.Tensor:
        """int64 ``[B, Hkv]`` entries held by every (batch row, KV head)."""
        if not self.is_initialized:
            raise ValueError(f"layer {self.layer_idx} of the {self.owner} holds nothing yet")
        return head_lengths(self.keys, self.ragged)

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
        self.progress.observe(query_states.shape[-2])
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
        ``(keys, values)`` ``[B, Hkv, S, D]`` (a ragged layer: a NaN placeholder, `flexentropy.caches.layout`)."""
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
                    f"predictive distribution, which were not handed over: switch the model with fe.enable(model), "
                    f"which installs the forward hooks that hand them over"
                )
        if self.sliding_window is not None:
            self._keep_last(self.sliding_window - 1)
        else:
            target = policy.before_append(self, q_len)
            if target is not None:
                self.decide(target, q_len)
        prompt = self.appends.reserve > 0 and self.seen == 0     # its attention reads its own (contiguous) keys
        self.keys = self.appends.append("keys", self.keys, key_states)
        self.values = self.appends.append("values", self.values, value_states)
        for name, fill in policy.stats.items():
            new = self.stats[name].new_full((*key_states.shape[:2], q_len), fill)
            self.stats[name] = torch.cat([self.stats[name], new], dim=-1)
        progress = self.progress
        progress.append(q_len)
        if progress.prompt_length is None:
            progress.prompt_length = q_len
        result = (key_states, value_states) if prompt else self._readable()
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
            self.decide(target, 0)

    def decide(self, target: int, incoming: int) -> None:
        """Keep ``target`` entries per KV head (score -> keep -> gather), or per-head counts for ragged policies,
        before ``incoming`` tokens are appended (the policy's decision points call it)."""
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
            keep = policy.select_ragged(self, target)
            self.ragged = RaggedKV.from_mask(self.keys, self.values, self.positions(), keep)
            self.keys = self.keys.new_empty(*self.keys.shape[:2], 0, self.keys.shape[-1])
            self.values = self.values.new_empty(*self.values.shape[:2], 0, self.values.shape[-1])
            self.stats = {name: stat[..., :0] for name, stat in self.stats.items()}
            self._kept = None
            kept = self.ragged.longest   # a host int, read once per decision (none per step)
        else:
            indices = (policy.select(self, target, incoming) if target > 0
                       else torch.zeros(*self.keys.shape[:2], 0, dtype=torch.long, device=self.keys.device))
            self.keys, self.values, self._kept = gather_kv(self.keys, self.values, indices, self.positions())
            self.stats = {name: stat.gather(-1, indices) for name, stat in self.stats.items()}
            kept = indices.shape[-1]
        self._evicted_at = self.seen
        self.progress.keep(kept)

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, window: torch.Tensor,
              padding: torch.Tensor | None, progress: Progress) -> None:
        """Hold ``keys [B, Hkv, S, D]``, ``values`` at positions ``kept [B, Hkv, S]`` with the query ``window`` and
        ``padding``, counted on from a copy of ``progress`` (its ``stored`` is ``S``), as after a decision at its last
        token (a static phase hands its entries back for a later turn's forward)."""
        self.is_initialized = True
        self.keys, self.values, self._kept, self.window, self.padding, self.stats = keys, values, kept, window, \
            padding, {}
        self.progress = replace(progress)
        self._evicted_at = self.seen

    def _keep_last(self, count: int) -> None:
        """Keep the last ``count`` stored entries (a sliding-window layer, before it appends: as HF's
        ``DynamicSlidingWindowLayer``, attention then reads the window's ``count`` entries plus the new tokens)."""
        if self.stored <= count:
            return
        self._kept = self.positions()[..., -count:]
        self.keys, self.values = self.keys[..., -count:, :], self.values[..., -count:, :]
        self.stats = {name: stat[..., -count:] for name, stat in self.stats.items()}
        self._evicted_at = self.seen
        self.progress.stored = count

    def _readable(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ragged is None:
            return self.keys, self.values
        return nan_entries(self.keys, self.values, self.stored)

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
        """Attention of the ``L`` newest tokens, ``query [B, Hq, L, D]``, over what the layer holds, under an optional
        bool ``attention_mask [B, 1, L, T]`` over logical key positions -> ``[B, Hq, L, Dv]``
        (`flexentropy.caches.layout.attend_entries`)."""
        positions = None if attention_mask is None else self.positions()
        return attend_entries(query, self.keys, self.values, self.ragged, attention_mask, positions, scale)

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
        """-1: no maximum (transformers' ``CacheLayerMixin`` declares it abstract, and ``Cache.get_max_length``
        reads it)."""
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
            self.ragged = self.ragged.select_rows(beam_idx)
            self.progress.stored = self.keys.shape[-2] + self.ragged.longest

    def reset(self) -> None:
        """Drop everything, as before the first forward."""
        self._clear()

    def nbytes(self) -> int:
        """Bytes held: stored keys and values (ragged part included), their positions and statistics, the query
        window."""
        ragged = () if self.ragged is None else tuple(self.ragged)
        return tensor_bytes(self.keys, self.values, self._kept, self.window, *self.stats.values(), *ragged)
