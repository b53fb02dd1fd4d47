"""The storage of `StaticLatentKVCache`'s static phase: every layer's entries in one tensor per kind, and the
views a cache policy decides on.

- `StaticBuffers`: one stage's buffers, per layer ``keys [B, Hkv, C, D]``, ``values [B, Hkv, C, Dv]``, each
  entry's logical ``positions [B, Hkv, C]`` and ``real [B, Hkv, C]`` (False at left padding). A decode step writes
  its token at a slot held in a tensor and attends over the first ``lengths`` slots: nothing of its shapes changes
  from step to step or request to request. A layer's step reads and writes one `StepLayer` (its buffers, its query
  window and the step's counters): `step_attention` (`observe_step`, `write_step`, `attend_step`).
- `StackedView`: a policy's `LayerView` of several layers of a stage at once, stacked along the batch dim
  (``[l * B, ...]``, layer-major): the latent rule is per (row, KV head), so one decision on it is every layer's
  own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flexentropy.caches.progress import Counted, Progress
from flexentropy.kv.decode_attention import flash_decode, grouped_attention, split_count

SPLITS = 16
"""Most parts `flash_decode` splits one row's entries into (batch 1): flash-attn-4 runs a row on ``Hkv`` blocks of
the GPU, so a long row (the prompt buffers of a captured phase 1) needs parts to fill it."""
SPLIT_ENTRIES = 128
"""Fewest entries per part (a part of fewer costs more to merge than it saves)."""


def static_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new zeroed buffer whose address a captured step keeps, marked a static address for dynamo (a CUDA graph
    reads it where it was recorded; the cache keeps its buffers across requests, `StaticLatentKVCache.reset`)."""
    buffer = torch.zeros(shape, dtype=dtype, device=device)
    torch._dynamo.mark_static_address(buffer, guard=False)
    torch._dynamo.mark_static(buffer)   # one graph per stage, not one dynamic graph
    return buffer


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of the same elements (same address, shape and strides)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


class StaticBuffers:
    """One stage of a `StaticLatentKVCache`: ``capacity`` entries per KV head of every layer (module docstring).

    Each layer's buffers are tensors of their own (a step's in-place writes into a view of one tensor for all layers
    would make the compiled step copy the whole tensor); decisions read several layers at once through `stacked`.

    Attributes:
        capacity: ``C``.
        keys, values, positions, real: per layer, ``[B, Hkv, C, D]``, ``[B, Hkv, C, Dv]``, ``[B, Hkv, C]`` int64,
            ``[B, Hkv, C]`` bool (empty before `allocate`).
        version: bumped whenever `allocate` makes new buffers (a recorded step must be recorded again).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.real: list[torch.Tensor] = []
        self.version = 0

    def allocate(self, layers: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Buffers for ``layers`` layers of entries shaped like ``keys [B, Hkv, *, D]``, ``values [B, Hkv, *, Dv]``;
        the existing ones are kept when they fit (their addresses with them)."""
        batch, heads, _, dim = keys.shape
        shape = (batch, heads, self.capacity)
        first = self.keys[0] if self.keys else None
        if (first is not None and len(self.keys) == layers and first.shape == (*shape, dim)
                and self.values[0].shape[-1] == values.shape[-1] and first.dtype == keys.dtype
                and first.device == keys.device):
            return
        device = keys.device
        self.keys = [static_buffer((*shape, dim), keys.dtype, device) for _ in range(layers)]
        self.values = [static_buffer((*shape, values.shape[-1]), values.dtype, device) for _ in range(layers)]
        self.positions = [static_buffer(shape, torch.long, device) for _ in range(layers)]
        self.real = [static_buffer(shape, torch.bool, device) for _ in range(layers)]
        self.version += 1

    def nbytes(self) -> int:
        """Bytes the buffers hold (their whole capacity)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *self.positions, *self.real))

    def stacked(self, name: str, layers: range, stored: int, rows: slice | torch.Tensor = slice(None)
                ) -> torch.Tensor:
        """The first ``stored`` entries of buffer ``name`` of ``layers`` and batch rows ``rows``, stacked along the
        batch dim: ``[l * b, ...]`` (a view for one layer and a slice of rows, a copy otherwise)."""
        parts = [buffer[rows, :, :stored] for buffer in getattr(self, name)[layers.start:layers.stop]]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def store(self, layers: range, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              real: torch.Tensor | None, rows: slice | torch.Tensor = slice(None)) -> None:
        """Write entries to the front of layers ``layers``, batch rows ``rows`` (a slice, or int64 indices):
        ``keys [l * b, Hkv, S, D]``, ``values``, ``positions [l * b, Hkv, S]`` and ``real`` (None: every entry
        real), stacked along the batch dim as `stacked` gives them; the slots after them are left as they are.
        Entries already in place (a layer's keys and values that live in these buffers: `AppendBuffers.lend`) are not
        copied."""
        stored, count = keys.shape[-2], len(layers)
        if stored >= self.capacity:
            raise RuntimeError(f"{stored} entries do not leave a free slot in static buffers of {self.capacity}")
        chosen = slice(layers.start, layers.stop)
        entries = {"keys": keys, "values": values, "positions": positions,
                   "real": positions.new_ones(positions.shape, dtype=torch.bool) if real is None else real}
        for name, tensor in entries.items():
            fronts = [buffer[:, :, :stored] for buffer in getattr(self, name)[chosen]]
            if isinstance(rows, slice):
                pairs = [(front[rows], part) for front, part in zip(fronts, tensor.chunk(count), strict=True)
                         if not same_memory(front[rows], part)]
                if pairs:
                    torch._foreach_copy_([front for front, _ in pairs], [part for _, part in pairs])
            else:
                for front, part in zip(fronts, tensor.chunk(count), strict=True):
                    front.index_copy_(0, rows, part)

    def layer(self, layer_idx: int, window: torch.Tensor, counters: dict[str, torch.Tensor], flash: bool
              ) -> StepLayer:
        """Layer ``layer_idx``'s buffers with its query ``window``, the step's device ``counters`` (``slot``,
        ``lengths``, ``position``) and its kernel: what its static step reads and writes."""
        return StepLayer(self.keys[layer_idx], self.values[layer_idx], self.positions[layer_idx],
                         self.real[layer_idx], window, counters["slot"], counters["lengths"], counters["position"],
                         flash)


class StepLayer(NamedTuple):
    """Everything one layer's decode step reads and writes: the step's metadata, handed to the attention as an
    argument, so that one compiled function serves every layer (its index is read nowhere).

    Attributes:
        keys, values: ``[B, Hkv, C, D]``, ``[B, Hkv, C, Dv]``.
        positions, real: ``[B, Hkv, C]`` int64 logical positions, bool real tokens (False at left padding).
        window: the layer's query window ``[B, Hq, W, D]``.
        slot, lengths, position: the step's device counters ``[B]``: each row's slot for the token (int64), the
            slots it reads (int32, its own included) and the token's position (int64).
        flash: attend with flash-attn-4's kernel over the first ``lengths`` slots (else SDPA under the validity).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor
    window: torch.Tensor
    slot: torch.Tensor
    lengths: torch.Tensor
    position: torch.Tensor
    flash: bool


def step_attention(layer: StepLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scale: float | None = None) -> torch.Tensor:
    """One layer's whole static step on ``layer``: the step's ``query [B, Hq, 1, D]`` into the window, its ``key``
    and ``value`` ``[B, Hkv, 1, D]`` into the buffers, then its attention -> ``[B, Hq, 1, Dv]``. The counters do not
    advance (`StaticPhase.advance`, after the last layer)."""
    observe_step(layer, query)
    write_step(layer, key, value)
    return attend_step(layer, query, scale)


def observe_step(layer: StepLayer, query: torch.Tensor) -> None:
    """A step's queries ``[B, Hq, L, D]`` into ``layer``'s window, its oldest ``L`` dropped, in place."""
    window = layer.window
    window.copy_(torch.cat([window[:, :, query.shape[2]:], query.to(window.dtype)], dim=2))


def write_step(layer: StepLayer, key: torch.Tensor, value: torch.Tensor) -> None:
    """A step's token, ``key [B, Hkv, 1, D]`` and ``value``, with its position, at each row's slot of ``layer``, in
    place.

    Indexed writes (``index_put_``), which the compiled step makes in place; a ``scatter_`` there becomes a copy
    of the whole buffer, every step."""
    batch, heads = key.shape[:2]
    slot, position = layer.slot, layer.position
    at = (torch.arange(batch, device=slot.device)[:, None], torch.arange(heads, device=slot.device)[None, :],
          slot[:, None])                                                       # [B, Hkv] entries
    layer.keys.index_put_(at, key[:, :, 0].to(layer.keys.dtype))
    layer.values.index_put_(at, value[:, :, 0].to(layer.values.dtype))
    layer.positions.index_put_(at, position[:, None].expand(batch, heads))
    layer.real.index_put_(at, torch.ones((), dtype=torch.bool, device=slot.device))


def attend_step(layer: StepLayer, query: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``[B, Hq, 1, Dv]``: one step's attention over ``layer``'s slots up to each row's slot (its own included):
    the first ``lengths`` of each row with flash-attn-4's kernel (split into up to `SPLITS` parts of at least
    `SPLIT_ENTRIES`), else SDPA under the slots' validity (left padding excluded)."""
    keys, values = layer.keys, layer.values
    capacity = keys.shape[-2]
    if layer.flash:
        splits = split_count(keys.shape[0], capacity, min(SPLITS, -(-capacity // SPLIT_ENTRIES)))
        return flash_decode(query, keys, values, layer.lengths, scale, splits=splits)
    slots = torch.arange(capacity, device=keys.device)
    valid = (slots <= layer.slot[:, None, None]) & layer.real
    return grouped_attention(query, keys, values, valid[:, :, None, :], scale)


class StackedView(Counted):
    """A `LayerView` of layers ``layers`` of ``stage``, stacked along the batch dim (module docstring).

    Args:
        stage: the buffers holding the entries.
        layers: the layers, a range.
        progress: the counters (``stored`` entries per KV head are live), read under their own names (`Counted`).
        window: the query window of those layers and rows ``[l * b, Hq, W', D]``.
        padding: left-padding tokens of each of those rows ``[b]``, or None.
        owner: the cache's name (messages).
        rows: the batch rows (all: ``slice(None)``; else int64 indices).
    """

    layer_idx = 0
    num_layers = None

    def __init__(self, stage: StaticBuffers, layers: range, progress: Progress, window: torch.Tensor,
                 padding: torch.Tensor | None, owner: str, rows: slice | torch.Tensor = slice(None)) -> None:
        stored = progress.stored
        self.keys = stage.stacked("keys", layers, stored, rows)
        self.values = stage.stacked("values", layers, stored, rows)
        self._positions = stage.stacked("positions", layers, stored, rows)
        self.window = window
        self.padding = None if padding is None else padding.repeat(len(layers))
        self.progress, self.owner = progress, owner
        self.stats: dict[str, torch.Tensor] = {}

    def positions(self) -> torch.Tensor:
        return self._positions

    def row_positions(self) -> torch.Tensor:
        return self._positions if self.padding is None else self._positions - self.padding[:, None, None]

    def real_entries(self) -> torch.Tensor | None:
        return None if self.padding is None else self.row_positions() >= 0

    def key_positions(self) -> torch.Tensor:
        if self.progress.evictions == 0:   # nothing evicted yet: every head holds 0 .. S - 1
            return torch.arange(self.progress.stored, device=self.keys.device)
        return self._positions

    def window_positions(self) -> torch.Tensor:
        observed = self.progress.observed
        return torch.arange(observed - self.window.shape[-2], observed, device=self.window.device)
