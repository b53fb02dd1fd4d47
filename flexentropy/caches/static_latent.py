"""`StaticLatentKVCache`: the latent cache (`LatentKVCache`) with static shapes after its first eviction, so that
decode steps can be captured (CUDA graphs) and replayed with no host work but the decisions.

Phases (design.md §2):

1. the prompt and the first ``decode_delay`` generated tokens run on the dynamic path, one `PolicyLayer` per layer
   (the prompt's whole KV is held; its length varies from request to request); or, for a cache with
   ``max_prompt_length``, the phase-1 steps run in the prompt buffers (a `StaticBuffers` of ``max_prompt_length +
   decode_delay`` entries per KV head), static like phase 2;
2. from the first decision point on, the buffers (``decode_budget + recompress_every`` entries per KV head).

In a static phase the entries live in preallocated buffers (`StaticBuffers`: per layer ``keys [B, Hkv, C, D]`` and
so on) with a query window ``[B, Hq, W, D]`` per layer, and the step's counters are tensors: the slot the token is
written to, the entries each row reads (``lengths``) and the token's position. A step writes, attends and
advances those counters inside its own graph (`advance`: the last layer's `attend`, or, where each layer's step runs
on its `StepLayer` by `step_attention`, the step driver after the last layer), so the host does nothing between
steps but `prepare`: it counts the step and, on the steps where the latent policy decides (the first
eviction, each recompression), runs the decision for every layer at once on a `StackedView` of the buffers (score ->
keep -> gather, as `LatentKVCache` decides each layer), in chunks of layers where the scores of a long prompt would
not fit in memory together.

`prepare(q_len)` runs before every forward, once: on a model switched by `flexentropy.enable` the decoder's
pre-hook runs it; the step driver (`flexentropy.engine.driver`: what ``generate``'s compiled path,
`flexentropy.greedy_generate` and `flexentropy.generate_batch` run) calls it itself and replays the recorded step of
the stage, with ``driven`` set so that the hook does nothing; a loop over modules without the hook
(`EntropyAttention`) calls it before each forward.
Decisions are thus taken before the step's queries are handed over (transformers' order: ``update`` before the
queries), so for an attention that hands its queries over before ``update`` (`EntropyAttention`) the window of a
decision ends one step earlier than with `LatentKVCache`.

A cache serves one conversation at a time, or, `open` for batch rows, one request per row: each request prefilled on
its own into a one-row cache and put in a row (`insert`), each row counting and deciding on its own (`groups`: the
rows that share a count), a finished row freed for the next (`free`). A forward of several tokens after decoding
began is the conversation's next turn: the entries go back to the layers for that forward (the dynamic path appends
it) and the next step enters the buffers again, at the same addresses. ``reset()`` empties the cache for a new
request and keeps its buffers. Padding of a left-padded batch is read from the prompt (``observe_padding``); decode
steps ignore the logical attention mask and attend with the cache's own validity. Beam search is not supported.
"""

from __future__ import annotations

from typing import Any

import torch

from flexentropy._checks import check_int
from flexentropy._compile import eager
from flexentropy.caches.latent_kv import LatentKVCache
from flexentropy.caches.policy_cache import PolicyCache
from flexentropy.caches.policy_layer import PolicyLayer, nan_entries
from flexentropy.caches.static_buffers import (
    Progress,
    StackedView,
    StaticBuffers,
    StepLayer,
    attend_step,
    observe_step,
    static_buffer,
    write_step,
)
from flexentropy.config import EntropyConfig
from flexentropy.kv.decode_attention import decode_attention, flash_decode_usable, grouped_attention
from flexentropy.kv.keep import gather_kv

SCORE_ELEMENTS = 1 << 27
"""Most window scores (float32) one decision holds at once: the layers of a long prompt are decided in chunks."""


class PhaseOneLayer(PolicyLayer):
    """A `PolicyLayer` whose first ``decode_delay`` appends after its prompt write in place, into slots reserved past
    the prompt's entries (a phase-1 step on the dynamic path then copies nothing of the prompt)."""

    def __init__(self, policy: Any, *args: Any) -> None:
        super().__init__(policy, *args)
        self.reserve = policy.delay


class StaticLatentKVCache(LatentKVCache):
    """`LatentKVCache` with static shapes after the first eviction, for captured decoding (module docstring).

    Same decisions as `LatentKVCache` (taken before each step's queries are handed over), same configuration;
    ``recompress_every`` must be set (the buffers hold ``decode_budget + recompress_every`` entries per KV head).
    transformers' ``generate`` decodes over it with flexentropy's step driver (the cache is ``is_compileable``); pass
    ``model=``::

        cache = fe.StaticLatentKVCache(cfg, model=model)
        out = model.generate(ids, cache=cache, max_new_tokens=256)   # past_key_values= before transformers 5.24

    Serve a server's requests with one cache and ``cache.reset()`` before each new prompt: the cache owns its buffers
    and `reset` keeps them, so the recorded steps replay at the addresses they were recorded with. Another batch
    size after ``reset()`` allocates new buffers (and records the steps again).

    With ``max_prompt_length``, phase 1 is static too: its first step copies the prompt's entries into prompt buffers
    of ``max_prompt_length + decode_delay`` entries per KV head, kept across requests, and the ``decode_delay`` steps
    before the first eviction run there as one more recorded step; a longer prompt runs its phase 1 on the dynamic
    path. The decisions, and so the tokens, are the same either way; the prompt buffers hold as much as a dense
    static cache of that length.

    Args:
        config: the `EntropyConfig` (its ``decode_*`` fields and ``recompress_every``).
        model: the HF model served: its layer count.
        num_layers: the layer count without a model (a plain loop then calls `prepare` itself).
        max_prompt_length: the longest prompt whose phase 1 runs static (None: phase 1 on the dynamic path).

    Attributes:
        main: the static phase's buffers (`StaticBuffers`, `capacity` entries).
        prompt: the captured phase 1's buffers, or None.
        stage: the buffers the steps use now (``main`` or ``prompt``), None on the dynamic path.
        progress: the static phase's counters (`Progress`).
        driven: set by the step driver while it runs a step (the model's pre-hook then leaves `prepare` to it).
    """

    layer_class = PhaseOneLayer

    def __init__(self, config: EntropyConfig | None = None, *, model: Any = None,
                 num_layers: int | None = None, max_prompt_length: int | None = None) -> None:
        super().__init__(config, model=model, num_layers=num_layers)
        if max_prompt_length is not None:
            check_int(type(self).__name__, "max_prompt_length", max_prompt_length, 1)
        if self.config.recompress_every is None:
            raise ValueError("StaticLatentKVCache needs EntropyConfig.recompress_every (its buffers hold "
                             "decode_budget + recompress_every entries per KV head); None grows without bound")
        if self.num_layers is None:
            raise ValueError("StaticLatentKVCache needs model= or num_layers= (its layers exist before the prompt, "
                             "so that transformers sees a compileable cache)")
        self._layer(self.num_layers - 1)
        self.max_prompt_length = max_prompt_length
        delay = self.config.decode_delay
        self.main = StaticBuffers(self.config.decode_budget + self.config.recompress_every)
        self.prompt = StaticBuffers(max_prompt_length + delay) if max_prompt_length is not None and delay else None
        self.window: list[torch.Tensor] = []
        self.counters: dict[str, torch.Tensor] = {}
        self.flash = False
        self.driven = False
        self._clear_static()

    def _clear_static(self) -> None:
        self.stage: StaticBuffers | None = None
        self.groups: list[tuple[Progress, slice | torch.Tensor]] = []
        self._rows: list[Progress] = []
        self.padding: torch.Tensor | None = None
        self._pending = 0   # tokens of the step prepared and not yet run (`get_seq_length` does not count them)

    def reset(self) -> None:
        """Empty the cache for a new request; the buffers stay (their addresses with them)."""
        super().reset()
        self._clear_static()

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def capacity(self) -> int:
        """``C``: entries per KV head of the static phase's buffers."""
        return self.main.capacity

    @property
    def is_static(self) -> bool:
        """Whether the cache is in its static phase proper (the next one-token step reads ``main``)."""
        return self.stage is self.main

    @property
    def evictions(self) -> int:
        """Decisions that evicted so far (the first eviction, then the recompressions)."""
        return self.progress.evictions if self.stage is not None else self.layers[0].evictions

    @property
    def progress(self) -> Progress:
        """The static phase's counters, when every row shares them (one request, or a left-padded batch of
        requests taken together); rows served one by one (`insert`) have their own."""
        if len(self.groups) != 1 or not isinstance(self.groups[0][1], slice):
            raise ValueError(f"the rows of this {type(self).__name__} progress one by one (insert): no one count "
                             f"holds for all of them")
        return self.groups[0][0]

    def _share(self, progress: Progress) -> None:
        """Every row counted by ``progress`` (one request, or a batch taken together)."""
        self._rows = [progress] * self.window[0].shape[0]
        self.groups = [(progress, slice(None))]

    # -- the host's part of a step ---------------------------------------------------------------------------------
    def prepare(self, q_len: int) -> None:
        """The host's work before a forward of ``q_len`` tokens (module docstring): nothing for a prompt or a step on
        the dynamic path; entering the prompt buffers or the buffers when due; the latent policy's decision for every
        layer when due; counting the step. A second call before the step has run does nothing (a loop may prepare a
        step that the model's pre-hook prepares too)."""
        if self._pending:
            return
        first = self.layers[0]
        if self.stage is None:
            if first.prompt_length is None:
                return   # the prompt (or nothing yet)
            self._check_layers()
            if q_len != 1:   # a later turn before the static phase: the dynamic path appends it
                self._decide_turn(q_len)
                return
            if first.generated >= self.config.decode_delay:
                self._decide_from_layers(self.policy.before_append(first, 1))
            elif self._prompt_fits(first):
                self._enter_prompt()
            else:
                return   # a phase-1 step on the dynamic path
        elif q_len != 1:
            self._leave(q_len)
            return
        else:
            for progress, rows in self.groups:
                if progress.prompt_length is None:   # idle rows (`free`): their slot starts over before the end
                    if progress.stored + 1 >= self.capacity:
                        progress.start_over()
                        self._set_counters(progress, rows)
                    continue
                target = self.policy.before_append(progress, 1)
                leaving_prompt = self.stage is self.prompt and progress.generated >= self.config.decode_delay
                if leaving_prompt or target is not None:
                    self._evict(target, progress, rows)
        for progress, _ in self.groups:
            progress.advance(q_len)
        self._pending = q_len

    def end_step(self) -> None:
        """The host's end of a static step (after its `advance`; the step driver calls it after replaying one): the
        step is counted."""
        self._pending = 0

    def _check_layer_idx(self, layer_idx: int) -> None:
        if layer_idx >= len(self.layers):
            raise ValueError(f"{type(self).__name__} was built for {len(self.layers)} layers, got layer_idx "
                             f"{layer_idx}: pass model= (or num_layers= the model's count of attention layers)")

    def _check_layers(self) -> None:
        missing = [layer.layer_idx for layer in self.layers if layer.prompt_length is None]
        if missing:
            raise RuntimeError(f"{type(self).__name__} was built for {len(self.layers)} layers, but layers {missing} "
                               f"saw no prompt: pass model= (or num_layers= the model's count of attention layers)")
        sliding = [layer.layer_idx for layer in self.layers if layer.is_sliding]
        if sliding:
            raise ValueError(f"{type(self).__name__} stores global-attention layers only; layers {sliding} attend a "
                             f"sliding window: use LatentKVCache")

    def _prompt_fits(self, first: PolicyLayer) -> bool:
        delay = self.config.decode_delay
        return (self.prompt is not None and first.evictions == 0 and first.ragged is None
                and first.stored + delay - first.generated <= self.prompt.capacity)

    # -- entering and leaving the static phase ---------------------------------------------------------------------
    def _take_layers(self) -> None:
        """Adopt the layers' counters, padding and query windows (the layers' own state is dropped after)."""
        first = self.layers[0]
        if first.window is None:
            raise RuntimeError(f"{type(self).__name__} holds entries but no queries were handed over: the attention "
                               f"must call cache.observe_queries(query_states, layer_idx) on every forward")
        self._allocate_rows(first.window.shape[0], first.window)
        size, held = self.config.decode_window, first.window.shape[2]
        torch._foreach_copy_([window[:, :, size - held:] for window in self.window],
                             [layer.window for layer in self.layers])
        self._share(layer_progress(first))
        self.padding = first.padding

    def _allocate_rows(self, rows: int, window: torch.Tensor) -> None:
        """The query windows (shaped like ``window [B, Hq, *, D]``) and the step's counters for ``rows`` batch rows;
        the existing ones are kept when they fit (their addresses with them)."""
        shape = (rows, window.shape[1], self.config.decode_window, window.shape[-1])
        kept = self.window[0] if self.window else None
        if kept is not None and kept.shape == shape and kept.dtype == window.dtype and kept.device == window.device:
            return
        device = window.device
        self.window = [static_buffer(shape, window.dtype, device) for _ in self.layers]
        self.counters = {name: static_buffer((rows,), dtype, device) for name, dtype in
                         (("slot", torch.long), ("lengths", torch.int32), ("position", torch.long))}
        self.row_index = torch.arange(rows, device=device)

    def _enter(self, stage: StaticBuffers) -> None:
        """Make ``stage`` the one the steps use, its counters at the stored entries; drop the layers' state."""
        self.stage = stage
        self.flash = flash_decode_usable(self.config.decode_kernel, stage.keys[0], padded=self.padding is not None)
        self._set_counters(self.progress, slice(None))
        for layer in self.layers:
            layer.reset()

    def _set_counters(self, progress: Progress, rows: slice | torch.Tensor) -> None:
        """The device counters of batch rows ``rows`` (all: ``slice(None)``) at ``progress``'s count."""
        values = {"slot": progress.stored, "lengths": progress.stored + 1, "position": progress.seen}
        for name, value in values.items():
            counter = self.counters[name]
            if isinstance(rows, slice):
                counter[rows].fill_(value)
            else:
                counter.index_fill_(0, rows, value)

    def _real(self, positions: torch.Tensor, layers: int, rows: slice | torch.Tensor = slice(None)
              ) -> torch.Tensor | None:
        """Which of the entries at ``positions [layers * b, Hkv, S]`` (batch rows ``rows`` of ``layers`` layers) are
        real tokens (None: no padding)."""
        if self.padding is None:
            return None
        return positions - self.padding[rows].repeat(layers)[:, None, None] >= 0

    def _enter_prompt(self) -> None:
        """The first step of a captured phase 1: the layers' entries into the prompt buffers."""
        first = self.layers[0]
        self.prompt.allocate(len(self.layers), first.keys, first.values)
        self._take_layers()
        for index, layer in enumerate(self.layers):
            positions = layer.positions()
            self.prompt.store(range(index, index + 1), layer.keys, layer.values, positions, self._real(positions, 1))
        self._enter(self.prompt)

    def _decide_from_layers(self, target: int | None) -> None:
        """The first decision point on the dynamic path: each layer's kept entries (all of them when ``target`` is
        None) into the buffers, one layer at a time (its prompt-sized entries are freed as it goes)."""
        first = self.layers[0]
        self.main.allocate(len(self.layers), first.keys, first.values)
        self._take_layers()
        for index, layer in enumerate(self.layers):
            keys, values, positions = layer.keys, layer.values, layer.positions()
            if target is not None:
                keys, values, positions = gather_kv(keys, values, self.policy.select(layer, target, 1), positions)
            self.main.store(range(index, index + 1), keys, values, positions, self._real(positions, 1))
            layer.reset()
        self.progress.keep(target)
        self._enter(self.main)

    def _evict(self, target: int | None, progress: Progress, rows: slice | torch.Tensor) -> None:
        """A decision in a static stage for batch rows ``rows`` (counted by ``progress``): every layer keeps
        ``target`` entries per KV head (all of them when None, at the end of a captured phase 1 whose entries fit
        the buffers), from the stage into the buffers."""
        source = self.stage
        if source is self.prompt:
            self.main.allocate(len(self.layers), source.keys[0], source.values[0])
        layers = len(self.layers)
        held = min(self.config.decode_window, progress.observed)
        heads, size = self.window[0].shape[1:3]
        batch = len(self.row_index[rows])
        chunk = max(1, min(layers, SCORE_ELEMENTS // (batch * heads * held * max(progress.stored, 1))))
        padding = None if self.padding is None else self.padding[rows]
        for start in range(0, layers, chunk):
            part = range(start, min(start + chunk, layers))
            window = torch.cat([self.window[index][rows, :, size - held:] for index in part])
            view = StackedView(source, part, progress, window, padding, type(self).__name__, rows)
            keys, values, positions = view.keys, view.values, view.positions()
            if target is not None:
                keys, values, positions = gather_kv(keys, values, self.policy.select(view, target, 1), positions)
            self.main.store(part, keys, values, positions, self._real(positions, len(part), rows), rows)
        progress.keep(target)
        if source is self.main:
            self._set_counters(progress, rows)
        else:
            self._enter(self.main)

    def _leave(self, q_len: int) -> None:
        """A later turn (``q_len`` tokens after decoding began): the entries and windows back to the layers, for the
        dynamic path; a decision due now is taken before the turn's queries are handed over, as for every step."""
        stage, progress, held = self.stage, self.progress, min(self.config.decode_window, self.progress.observed)
        stored, size = progress.stored, self.config.decode_window
        for index, layer in enumerate(self.layers):
            layer.load_decision_state({
                "is_initialized": True, "keys": stage.keys[index][:, :, :stored].clone(),
                "values": stage.values[index][:, :, :stored].clone(),
                "window": self.window[index][:, :, size - held:].clone(),
                "kept": stage.positions[index][:, :, :stored].clone(), "padding": self.padding, "stats": {},
                "seen": progress.seen, "observed": progress.observed, "prompt_length": progress.prompt_length,
                "previous_generated": progress.previous_generated, "evictions": progress.evictions,
                "evicted_at": progress.seen})
        self.stage = None
        self._decide_turn(q_len)

    def _decide_turn(self, q_len: int) -> None:
        """A decision due at a later turn of ``q_len`` tokens on the dynamic path, taken before the turn's queries
        are handed over (each layer's `PolicyLayer.update` would take it after them)."""
        for layer in self.layers:
            target = self.policy.before_append(layer, q_len)
            if target is not None:
                layer.decide(target, q_len)

    # -- rows served one by one ----------------------------------------------------------------------------------------
    def open(self, rows: int, source: LatentKVCache) -> None:
        """Serve ``rows`` requests at once, each entered on its own (`insert`): buffers for ``rows`` batch rows shaped
        like ``source``'s (a one-row cache after its prompt), every row idle; the rows then decode together, each
        deciding on its own count."""
        check_int(type(self).__name__, "rows", rows, 1)
        first = source.layers[0]
        if first.window is None or first.keys.shape[0] != 1:
            raise ValueError(f"open needs a one-row cache that holds a prompt and its queries, got "
                             f"{'no queries' if first.window is None else f'{first.keys.shape[0]} rows'}")
        self.reset()
        self.main.allocate(len(self.layers), first.keys.expand(rows, -1, -1, -1),
                           first.values.expand(rows, -1, -1, -1))
        self._allocate_rows(rows, first.window)
        self._rows = [Progress()] * rows
        self._regroup()
        self.stage = self.main
        self.flash = flash_decode_usable(self.config.decode_kernel, self.main.keys[0], padded=False)
        self._set_counters(self._rows[0], slice(None))

    def insert(self, row: int, source: LatentKVCache) -> None:
        """Put the request that ``source`` holds (a one-row latent cache after its prompt, evicted to the budget:
        ``decode_delay=0``) in batch row ``row`` of an `open` cache; the row's next step is that request's."""
        self._check_row(row)
        first = source.layers[0]
        if first.stored >= self.capacity:
            raise ValueError(f"insert: the request holds {first.stored} entries per KV head, more than the buffers' "
                             f"{self.capacity - 1}: evict it first (decode_delay=0 evicts at the end of the prompt)")
        index = self.row_index[row:row + 1]
        held, size = first.window.shape[2], self.config.decode_window
        for layer_idx, layer in enumerate(source.layers):
            self.main.store(range(layer_idx, layer_idx + 1), layer.keys, layer.values, layer.positions(), None, index)
            self.window[layer_idx][row:row + 1, :, size - held:].copy_(layer.window)
        self._rows[row] = layer_progress(first)
        self._regroup()
        self._set_counters(self._rows[row], index)

    def free(self, row: int) -> None:
        """Batch row ``row`` of an `open` cache is idle from its next step (its entries are left to be overwritten)."""
        self._check_row(row)
        idle = next((progress for progress in self._rows if progress.prompt_length is None), Progress())
        self._rows[row] = idle
        self._regroup()
        self._set_counters(idle, self.row_index[row:row + 1])

    def _check_row(self, row: int) -> None:
        if self.stage is not self.main or not self._rows:
            raise RuntimeError(f"{type(self).__name__}: open(rows, source) before insert or free")
        if not 0 <= row < len(self._rows):
            raise ValueError(f"row must be in [0, {len(self._rows)}), got {row}")

    def _regroup(self) -> None:
        """`groups`: the distinct counts of the rows, each with the batch rows it counts."""
        rows: dict[int, list[int]] = {}
        for index, progress in enumerate(self._rows):
            rows.setdefault(id(progress), []).append(index)
        by_id = {id(progress): progress for progress in self._rows}

        def index(members: list[int]) -> slice | torch.Tensor:   # a view where the rows are consecutive
            if len(members) == len(self._rows):
                return slice(None)
            if members[-1] - members[0] == len(members) - 1:
                return self.row_index[members[0]:members[-1] + 1]
            return self.row_index[members]

        self.groups = [(by_id[key], index(members)) for key, members in rows.items()]

    # -- the step, static where it can be --------------------------------------------------------------------------
    def observe_queries(self, query_states: torch.Tensor, layer_idx: int) -> None:
        if self.stage is not None:
            observe_step(self.step_layer(layer_idx), query_states)
        elif torch.compiler.is_compiling():
            eager(PolicyCache.observe_queries, self, query_states, layer_idx)
        else:
            super().observe_queries(query_states, layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stage is not None:
            layer = self.step_layer(layer_idx)
            write_step(layer, key_states, value_states, self.counters["slot"], self.counters["position"])
            return layer.keys, layer.values
        self._check_layer_idx(layer_idx)
        if torch.compiler.is_compiling():
            eager(PolicyCache.update, self, key_states, value_states, layer_idx)
            return placeholder(key_states, value_states, self.capacity)
        return super().update(key_states, value_states, layer_idx)

    def attend(self, query: torch.Tensor, layer_idx: int, attention_mask: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
        """Decode attention of layer ``layer_idx``'s newest token over what it holds; ``attention_mask`` is not read
        (padding comes from ``observe_padding``). In a static stage the last layer's call ends the step: the
        counters advance (in the step's graph)."""
        if self.stage is not None:
            out = self._attend_step(self.step_layer(layer_idx), query, scale)
            if layer_idx == len(self.layers) - 1:
                self.advance()
                self.end_step()
            return out
        layer = self.layers[layer_idx]
        if torch.compiler.is_compiling():
            return eager(layer_attention, layer, query, scale)
        return layer_attention(layer, query, scale)

    # -- a static step by layer arguments --------------------------------------------------------------------------
    def step_layer(self, layer_idx: int) -> StepLayer:
        """Layer ``layer_idx``'s buffers in the current static stage and its query window (`StepLayer`)."""
        return self.stage.layer(layer_idx, self.window[layer_idx])

    def step_attention(self, layer: StepLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scale: float | None = None) -> torch.Tensor:
        """One layer's whole static step, ``observe_queries``, ``update`` and ``attend`` in one, on ``layer`` (its
        `step_layer`) instead of a layer index: ``query [B, Hq, 1, D]``, the step's ``key`` and ``value``
        ``[B, Hkv, 1, D]`` -> ``[B, Hq, 1, Dv]``. It reads nothing of the layer but ``layer``, so one compiled
        function runs every layer's step (`flexentropy.engine.compiled_layer`); the counters do not advance
        (`advance`, after the last layer)."""
        observe_step(layer, query)
        write_step(layer, key, value, self.counters["slot"], self.counters["position"])
        return self._attend_step(layer, query, scale)

    def _attend_step(self, layer: StepLayer, query: torch.Tensor, scale: float | None) -> torch.Tensor:
        counters = self.counters
        return attend_step(layer, query, counters["slot"], counters["lengths"], self.flash, scale)

    def advance(self) -> None:
        """The device's end of a static step: its counters advance by one token (inside the step's graph)."""
        torch._foreach_add_(list(self.counters.values()), 1)

    # -- readers ---------------------------------------------------------------------------------------------------
    def stored_entries(self, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[B, Hkv, S, D]`` layer ``layer_idx`` holds now (views of the buffers when static)."""
        if self.stage is None:
            layer = self.layers[layer_idx]
            return layer.keys, layer.values
        stored = self.progress.stored - self._pending
        return self.stage.keys[layer_idx][:, :, :stored], self.stage.values[layer_idx][:, :, :stored]

    def stored_length(self, layer_idx: int = 0) -> int:
        """Entries held per KV head; under compilation a constant (0 before the prompt, else ``C``), so that a
        compiled step never depends on the count."""
        self._check_layer_idx(layer_idx)
        held = self.stage is not None or self.layers[layer_idx].is_initialized
        if torch.compiler.is_compiling():
            return self.capacity if held else 0
        if self.stage is None:
            return super().stored_length(layer_idx)
        return max(progress.stored for progress, _ in self.groups) - self._pending

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Logical length (the next token's position); under compilation in a static stage the 0-dim tensor of the
        counters (as transformers' ``StaticCache``), so that the compiled step does not depend on it."""
        if self.stage is None:
            return self.layers[layer_idx].get_seq_length()
        if torch.compiler.is_compiling():
            return self.counters["position"][0]
        return max(progress.seen for progress, _ in self.groups) - self._pending

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """A prompt: its own size; any later forward ``(C, 0)``, a constant (the steps ignore HF's mask): one mask
        shape for every decode graph."""
        layer = self.layers[layer_idx]
        if self.stage is None and layer.prompt_length is None:
            return layer.get_mask_sizes(query_length)
        return self.capacity, 0

    def head_lengths(self, layer_idx: int = 0) -> torch.Tensor:
        if self.stage is None:
            return super().head_lengths(layer_idx)
        keys = self.stage.keys[layer_idx]
        return torch.full(keys.shape[:2], self.stored_length(layer_idx), dtype=torch.long, device=keys.device)

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor:
        if self.stage is None:
            return super().kept_positions(layer_idx)
        return self.stage.positions[layer_idx][:, :, :self.stored_length(layer_idx)]

    def nbytes(self, layer_idx: int | None = None) -> int:
        """Bytes held: on the dynamic path the layers' (`PolicyCache.nbytes`); in a static stage the buffers' whole
        capacity, prompt buffers and query window included (a layer's share for ``layer_idx``)."""
        if self.stage is None:
            return super().nbytes(layer_idx)
        stages = self.main.nbytes() + (self.prompt.nbytes() if self.prompt is not None else 0)
        total = stages + sum(window.numel() * window.element_size() for window in self.window)
        return total if layer_idx is None else total // len(self.layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support beam search; use LatentKVCache")

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of what a step changes in place besides its own slot (the counters and the query window): recording
        a step runs it, and `restore` undoes that."""
        return [tensor.clone() for tensor in (*self.window, *self.counters.values())]

    def restore(self, saved: list[torch.Tensor]) -> None:
        """Put back a `snapshot`."""
        torch._foreach_copy_([*self.window, *self.counters.values()], saved)


def layer_progress(layer: PolicyLayer) -> Progress:
    """The counters of a `PolicyLayer` (the dynamic path's), as the static phase counts them."""
    return Progress(seen=layer.seen, observed=layer.observed, stored=layer.stored, prompt_length=layer.prompt_length,
                    previous_generated=layer.previous_generated, evictions=layer.evictions)


def layer_attention(layer: PolicyLayer, query: torch.Tensor, scale: float | None) -> torch.Tensor:
    """A step's attention on the dynamic path (a phase-1 step, or a later turn's tokens, causal among themselves)
    over the layer's entries, under its own padding mask (HF's logical mask is not read)."""
    real = layer.real_entries()
    if real is None:
        return decode_attention(query, layer.keys, layer.values, scale=scale)
    entries = torch.arange(layer.keys.shape[-2], device=query.device)
    causal = entries <= entries[entries.shape[0] - query.shape[-2]:, None]    # [L, S]
    return grouped_attention(query, layer.keys, layer.values, real[:, :, None, :] & causal, scale)


def placeholder(keys: torch.Tensor, values: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-memory NaN keys and values ``[B, Hkv, count, D]`` returned by a dynamic-path step under compilation
    (fixed shapes; the attention reads the cache through `StaticLatentKVCache.attend`)."""
    return nan_entries(keys, values, count)
