"""`StaticPhase`: the static half of a `StaticLatentKVCache`, everything from its first decision on (design.md §2),
and a captured phase 1.

It owns the preallocated buffers (`StaticBuffers`: ``main`` of ``decode_budget + recompress_every`` entries per KV
head, and with ``max_prompt_length`` the ``prompt`` buffers of a captured phase 1), one query window per layer, and
its batch rows (`BatchRows`: each row's `Progress` and the device's copy of the counts). The dynamic phase
(`DynamicPhase`) enters it (`enter_from_layers`, `enter_prompt`); a step's host work is `prepare` (the decisions
due, leaving for a later turn); the step itself runs each layer's `StepLayer` (`step_layer`,
`flexentropy.caches.static_buffers.step_attention`), or the phase's reads and writes one by one; then `advance`
(device) and `count` (host). The decode engine's step driver (`flexentropy.engine.driver`) is what prepares, advances
and counts a step.

Decisions: on the steps where the latent policy decides (the first eviction, each recompression), `prepare` runs the
decision for every layer at once on a `StackedView` of the buffers (score -> keep -> gather, as `LatentKVCache`
decides each layer), in chunks of layers where the scores of a long prompt would not fit in memory together; they
are taken before the step's queries are handed over (transformers' order: ``update`` before the queries).

Rows: the phase serves one request (or a left-padded batch) at a time, or, `open` for batch rows, one request per row,
each entered on its own (`insert`), counting and deciding on its own, and freed for the next (`free`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from flexentropy._checks import check_int
from flexentropy.caches.batch_rows import BatchRows, Rows
from flexentropy.caches.phase import CachePhase
from flexentropy.caches.policy_layer import PolicyLayer
from flexentropy.caches.progress import Progress
from flexentropy.caches.static_buffers import (
    StackedView,
    StaticBuffers,
    StepLayer,
    attend_step,
    observe_step,
    static_buffer,
    write_step,
)
from flexentropy.config import EntropyConfig
from flexentropy.kv.decode_attention import flash_decode_usable
from flexentropy.kv.keep import gather_kv

SCORE_ELEMENTS = 1 << 27
"""Most window scores (float32) one decision holds at once: the layers of a long prompt are decided in chunks."""


class StaticPhase(CachePhase):
    """The static phase of a `StaticLatentKVCache` (module docstring).

    Args:
        config: the cache's `EntropyConfig` (``decode_*``, ``recompress_every``).
        policy: its latent policy (the decisions).
        layers: its dynamic layers (`PolicyLayer`, the prompt and phase 1), which the phase takes the entries of when
            it starts and hands them back to for a later turn.
        owner: the cache's class name (messages).
        max_prompt_length: the longest prompt whose phase 1 runs in the prompt buffers (None: none does).
        dynamic: the phase of those layers, which a later turn runs in (`DynamicPhase`).

    Attributes:
        main, prompt: the buffers of the static phase proper and of a captured phase 1 (or None).
        buffers: the stage, the buffers the steps use (``main``, or ``prompt`` in a captured phase 1).
        window: per layer, the query window ``[B, Hq, W, D]``.
        batch: the batch rows (`BatchRows`: each row's `Progress`, and the device's counters ``slot``, ``lengths``,
            ``position``).
        padding: left-padding tokens of each row ``[B]``, or None.
        flash: whether the steps attend with flash-attn-4's kernel.
    """

    def __init__(self, config: EntropyConfig, policy: Any, layers: list[PolicyLayer], owner: str,
                 max_prompt_length: int | None, dynamic: CachePhase) -> None:
        self.config, self.policy, self.layers, self.owner, self.dynamic = config, policy, layers, owner, dynamic
        delay = config.decode_delay
        self.main = StaticBuffers(config.decode_budget + config.recompress_every)
        self.prompt = StaticBuffers(max_prompt_length + delay) if max_prompt_length is not None and delay else None
        self.window: list[torch.Tensor] = []
        self.batch = BatchRows()
        self.flash = False
        self.clear()

    def clear(self) -> None:
        """Nothing counted, nothing entered; the buffers, windows and device counters stay (their addresses with
        them)."""
        self.buffers: StaticBuffers = self.main
        self.padding: torch.Tensor | None = None
        self.batch.clear()

    @property
    def capacity(self) -> int:
        return self.main.capacity

    @property
    def progress(self) -> Progress:
        """The one count of every row (one request, or a batch taken together); raises for rows served one by one."""
        return self.batch.progress

    # -- the host's part of a step ---------------------------------------------------------------------------------
    def prepare(self, tokens: int) -> CachePhase:
        """A one-token step: the latent policy's decision for every layer where due (and leaving the prompt buffers
        at the first decision point); this phase. A later turn (``tokens`` > 1): the entries back to the layers,
        and the dynamic phase."""
        if tokens != 1:
            groups = self.batch.groups
            if len(groups) != 1 or groups[0][0].prompt_length is None:
                raise ValueError(f"{self.owner} serves its rows one by one (open, insert, free), and a forward of "
                                 f"{tokens} tokens is a step of none of them: call cache.reset() before another "
                                 f"request on this cache")
            return self._leave(tokens)
        for progress, rows in self.batch.groups:
            if progress.prompt_length is None:   # idle rows (`free`): their slot starts over before the end
                if progress.stored + 1 >= self.capacity:
                    progress.start_over()
                    self.batch.mirror(progress, rows)
                continue
            target = self.policy.before_append(progress, 1)
            leaving_prompt = self.buffers is self.prompt and progress.generated >= self.config.decode_delay
            if leaving_prompt or target is not None:
                self._evict(target, progress, rows)
        return self

    def advance(self) -> None:
        """The device's end of a static step: every row's counters one token on (inside the step's graph)."""
        torch._foreach_add_(list(self.batch.device.values()), 1)

    def count(self, tokens: int) -> None:
        """The host's end of a static step of ``tokens`` tokens: every group of rows counts it."""
        for progress, _ in self.batch.groups:
            progress.observe(tokens)
            progress.append(tokens)

    def lend_prompt(self, layer: PolicyLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Before ``layer``'s update of ``keys [B, Hkv, L, D]`` and ``values`` on the dynamic path: where its entries
        after the update and its reserve (the ``decode_delay`` slots of phase 1) fit the prompt buffers, lend them to
        the layer (allocated at the first such update, kept after), so that its entries live there. A prompt's KV is
        then held once, in the buffers its captured phase 1 reads, not in the layers' own tensors beside them; a
        longer prompt keeps tensors of its own."""
        prompt = self.prompt
        if prompt is None or layer.stored + keys.shape[-2] + layer.appends.reserve > prompt.capacity:
            return
        prompt.allocate(len(self.layers), keys, values)
        layer.appends.lend(prompt.keys[layer.layer_idx], prompt.values[layer.layer_idx])

    def prompt_fits(self, first: PolicyLayer) -> bool:
        """Whether phase 1 of the request that ``first`` (the first layer) holds fits the prompt buffers."""
        delay = self.config.decode_delay
        return (self.prompt is not None and first.evictions == 0 and first.ragged is None
                and first.stored + delay - first.generated <= self.prompt.capacity)

    # -- entering and leaving ------------------------------------------------------------------------------------------
    def _take_layers(self) -> None:
        """Adopt the layers' counters, padding and query windows (the layers' own state is dropped after)."""
        first = self.layers[0]
        if first.window is None:
            raise RuntimeError(f"{self.owner} holds entries but no queries were handed over: the attention must call "
                               f"cache.observe_queries(query_states, layer_idx) on every forward")
        self._allocate_rows(first.window.shape[0], first.window)
        size, held = self.config.decode_window, first.window.shape[2]
        torch._foreach_copy_([window[:, :, size - held:] for window in self.window],
                             [layer.window for layer in self.layers])
        self.batch.share(first.progress)   # the count goes on in the static phase (the layers get new ones)
        self.padding = first.padding

    def _allocate_rows(self, rows: int, window: torch.Tensor) -> None:
        """The query windows (shaped like ``window [B, Hq, *, D]``) and the device counters for ``rows`` batch rows;
        the existing ones are kept when they fit (their addresses with them)."""
        shape = (rows, window.shape[1], self.config.decode_window, window.shape[-1])
        kept = self.window[0] if self.window else None
        if kept is None or kept.shape != shape or kept.dtype != window.dtype or kept.device != window.device:
            self.window = [static_buffer(shape, window.dtype, window.device) for _ in self.layers]
        self.batch.allocate(rows, window.device)

    def _enter(self, stage: StaticBuffers) -> StaticPhase:
        """Make ``stage`` the one the steps use, its counters at the stored entries; drop the layers' state; this
        phase."""
        self.buffers = stage
        self.flash = flash_decode_usable(self.config.decode_kernel, stage.keys[0], padded=self.padding is not None)
        self.batch.mirror(self.batch.progress, slice(None))
        for layer in self.layers:
            layer.reset()
        return self

    def _real(self, positions: torch.Tensor, layers: int, rows: Rows = slice(None)) -> torch.Tensor | None:
        """Which of the entries at ``positions [layers * b, Hkv, S]`` (batch rows ``rows`` of ``layers`` layers) are
        real tokens (None: no padding)."""
        if self.padding is None:
            return None
        return positions - self.padding[rows].repeat(layers)[:, None, None] >= 0

    def enter_prompt(self) -> StaticPhase:
        """The first step of a captured phase 1: the layers' entries into the prompt buffers (their keys and values
        are there already when `lend_prompt` lent them: only the positions and flags are written); this phase."""
        first = self.layers[0]
        self.prompt.allocate(len(self.layers), first.keys, first.values)
        self._take_layers()
        for index, layer in enumerate(self.layers):
            positions = layer.positions()
            self.prompt.store(range(index, index + 1), layer.keys, layer.values, positions, self._real(positions, 1))
        return self._enter(self.prompt)

    def enter_from_layers(self, target: int | None) -> StaticPhase:
        """The first decision point on the dynamic path: each layer's kept entries (all of them when ``target`` is
        None) into the buffers, one layer at a time (its prompt-sized entries are freed as it goes); this phase."""
        first = self.layers[0]
        self.main.allocate(len(self.layers), first.keys, first.values)
        self._take_layers()
        for index, layer in enumerate(self.layers):
            keys, values, positions = layer.keys, layer.values, layer.positions()
            if target is not None:
                keys, values, positions = gather_kv(keys, values, self.policy.select(layer, target, 1), positions)
            self.main.store(range(index, index + 1), keys, values, positions, self._real(positions, 1))
            layer.reset()
        self.batch.progress.keep(target)
        return self._enter(self.main)

    def _evict(self, target: int | None, progress: Progress, rows: Rows) -> None:
        """A decision in a static stage for batch rows ``rows`` (counted by ``progress``): every layer keeps
        ``target`` entries per KV head (all of them when None, at the end of a captured phase 1 whose entries fit
        the buffers), from the stage into the buffers."""
        source = self.buffers
        if source is self.prompt:
            self.main.allocate(len(self.layers), source.keys[0], source.values[0])
        layers = len(self.layers)
        held = min(self.config.decode_window, progress.observed)
        heads, size = self.window[0].shape[1:3]
        batch = len(self.batch.row_index[rows])
        chunk = max(1, min(layers, SCORE_ELEMENTS // (batch * heads * held * max(progress.stored, 1))))
        padding = None if self.padding is None else self.padding[rows]
        for start in range(0, layers, chunk):
            part = range(start, min(start + chunk, layers))
            window = torch.cat([self.window[index][rows, :, size - held:] for index in part])
            view = StackedView(source, part, progress, window, padding, self.owner, rows)
            keys, values, positions = view.keys, view.values, view.positions()
            if target is not None:
                keys, values, positions = gather_kv(keys, values, self.policy.select(view, target, 1), positions)
            self.main.store(part, keys, values, positions, self._real(positions, len(part), rows), rows)
        progress.keep(target)
        if source is self.main:
            self.batch.mirror(progress, rows)
        else:
            self._enter(self.main)

    def _leave(self, tokens: int) -> CachePhase:
        """A later turn (``tokens`` tokens after decoding began): the entries and windows back to the layers, and the
        dynamic phase, prepared for the turn (a decision due now is taken before the turn's queries are handed over,
        as for every step); nothing counted here any more.

        The layers get views of the stage's entries (nothing writes the buffers on the dynamic path; the layers copy
        them when they append or evict), so that leaving the prompt buffers does not copy the prompt."""
        stage, progress = self.buffers, self.batch.progress
        held, size = min(self.config.decode_window, progress.observed), self.config.decode_window
        for index, layer in enumerate(self.layers):
            layer.adopt(stage.keys[index][:, :, :progress.stored], stage.values[index][:, :, :progress.stored],
                        stage.positions[index][:, :, :progress.stored],
                        self.window[index][:, :, size - held:].clone(), self.padding, progress)
        self.batch.clear()
        return self.dynamic.prepare(tokens)

    # -- rows served one by one ----------------------------------------------------------------------------------------
    def open(self, rows: int, source: Any) -> None:
        """Serve ``rows`` requests at once, each entered on its own (`insert`): buffers for ``rows`` batch rows shaped
        like ``source``'s (a one-row latent cache after its prompt), every row idle."""
        check_int(self.owner, "rows", rows, 1)
        first = source.layers[0]
        if first.window is None or first.keys.shape[0] != 1:
            raise ValueError(f"open needs a one-row cache that holds a prompt and its queries, got "
                             f"{'no queries' if first.window is None else f'{first.keys.shape[0]} rows'}")
        self.main.allocate(len(self.layers), first.keys.expand(rows, -1, -1, -1),
                           first.values.expand(rows, -1, -1, -1))
        self._allocate_rows(rows, first.window)
        self.batch.share(Progress())
        self.buffers = self.main
        self.flash = flash_decode_usable(self.config.decode_kernel, self.main.keys[0], padded=False)

    def insert(self, row: int, source: Any) -> None:
        """Put the request that ``source`` holds (a one-row latent cache after its prompt, evicted to the budget) in
        batch row ``row``; the row's next step is that request's."""
        self._check_row(row)
        first = source.layers[0]
        if first.stored >= self.capacity:
            raise ValueError(f"insert: the request holds {first.stored} entries per KV head, more than the buffers' "
                             f"{self.capacity - 1}: evict it first (decode_delay=0 evicts at the end of the prompt)")
        index = self.batch.row_index[row:row + 1]
        held, size = first.window.shape[2], self.config.decode_window
        for layer_idx, layer in enumerate(source.layers):
            self.main.store(range(layer_idx, layer_idx + 1), layer.keys, layer.values, layer.positions(), None, index)
            self.window[layer_idx][row:row + 1, :, size - held:].copy_(layer.window)
        self.batch.put(row, replace(first.progress))

    def free(self, row: int) -> None:
        """Batch row ``row`` is idle from its next step (its entries are left to be overwritten)."""
        self._check_row(row)
        self.batch.put(row, self.batch.idle())

    def _check_row(self, row: int) -> None:
        if self.buffers is not self.main or not self.batch.rows:
            raise RuntimeError(f"{self.owner}: open(rows, source) before insert or free")
        if not 0 <= row < len(self.batch.rows):
            raise ValueError(f"row must be in [0, {len(self.batch.rows)}), got {row}")

    # -- the step ----------------------------------------------------------------------------------------------------
    def step_layer(self, layer_idx: int) -> StepLayer:
        """Layer ``layer_idx``'s buffers in the current stage, its query window and the step's counters."""
        return self.buffers.layer(layer_idx, self.window[layer_idx], self.batch.device, self.flash)

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of what a step changes in place besides its own slot (the device counters and the query windows):
        recording a step runs it, and `restore` undoes that."""
        return [tensor.clone() for tensor in (*self.window, *self.batch.device.values())]

    def restore(self, saved: list[torch.Tensor]) -> None:
        """Put back a `snapshot`."""
        torch._foreach_copy_([*self.window, *self.batch.device.values()], saved)

    # -- writes and reads of a step run one call at a time (not by `step_layer`) ---------------------------------
    def observe_queries(self, query_states: torch.Tensor, layer_idx: int) -> None:
        observe_step(self.step_layer(layer_idx), query_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.step_layer(layer_idx)
        write_step(layer, key_states, value_states)
        return layer.keys, layer.values

    def attend(self, query: torch.Tensor, layer_idx: int, scale: float | None) -> torch.Tensor:
        return attend_step(self.step_layer(layer_idx), query, scale)

    def entries(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the stage's buffers."""
        stored = self.batch.progress.stored
        return self.buffers.keys[layer_idx][:, :, :stored], self.buffers.values[layer_idx][:, :, :stored]

    def stored_length(self, layer_idx: int) -> int:
        """The fullest row's; under compilation ``C``."""
        return self.capacity if torch.compiler.is_compiling() else self.batch.stored()

    def conversation(self) -> tuple[int, torch.Tensor | None]:
        return self.batch.seen(), self.padding

    def seq_length(self, layer_idx: int) -> int | torch.Tensor:
        """The longest row's; under compilation the 0-dim tensor of the device's counters (as transformers'
        ``StaticCache``), so that the compiled step does not depend on it."""
        if torch.compiler.is_compiling():
            return self.batch.device["position"][0]
        return self.batch.seen()

    def head_lengths(self, layer_idx: int) -> torch.Tensor:
        keys = self.buffers.keys[layer_idx]
        return torch.full(keys.shape[:2], self.stored_length(layer_idx), dtype=torch.long, device=keys.device)

    def mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """``(C, 0)``, a constant (the steps ignore HF's mask): one mask shape for every decode graph."""
        return self.capacity, 0

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        return self.buffers.positions[layer_idx][:, :, :self.batch.stored()]

    def nbytes(self, layer_idx: int | None = None) -> int:
        """Bytes of every buffer (their whole capacity), prompt buffers and query windows included."""
        stages = self.main.nbytes() + (self.prompt.nbytes() if self.prompt is not None else 0)
        total = stages + sum(window.numel() * window.element_size() for window in self.window)
        return total if layer_idx is None else total // len(self.layers)
