"""`CachePhase`: what a `StaticLatentKVCache` reads and writes through, in either of its two phases (design.md §2).

The cache holds one current phase: its dynamic phase (`DynamicPhase`: the per-layer storage that transformers'
cache protocol grows; the prompt, the steps before the first decision, a later turn's forward) or its static phase
(`StaticPhase`: fixed buffers, the steps a driver compiles and records). Both offer the same reads and writes, and
both count through a `Progress`. A step's host work is the current phase's `prepare`, which names the phase the
step runs in (the cache makes it the current one, `StaticLatentKVCache.prepare`); after the step, `advance` (the
device's counts, inside a recorded step) and `count` (the host's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flexentropy.caches.progress import Progress
    from flexentropy.caches.static_buffers import StaticBuffers


class CachePhase(ABC):
    """One phase of a `StaticLatentKVCache` (module docstring): its reads and writes, by layer index ``layer_idx``.

    Attributes:
        buffers: the static buffers the phase's steps read and write (`StaticBuffers`: the stage), None where the
            layers hold the entries (the dynamic phase).
    """

    buffers: StaticBuffers | None

    @property
    @abstractmethod
    def progress(self) -> Progress:
        """The count of every layer and batch row (one request, or a left-padded batch taken together)."""

    @property
    def evictions(self) -> int:
        """Decisions that evicted so far (the first eviction, then the recompressions)."""
        return self.progress.evictions

    # -- the step ------------------------------------------------------------------------------------------------
    @abstractmethod
    def prepare(self, tokens: int) -> CachePhase:
        """The host's work before a forward of ``tokens`` tokens (entering or leaving the static buffers, the
        decisions due); returns the phase the forward runs in. It counts nothing (`count`, after the step), so a
        second call before the step has run finds nothing left to do."""

    @abstractmethod
    def advance(self) -> None:
        """The device's end of a step, inside a recorded step's graph."""

    @abstractmethod
    def count(self, tokens: int) -> None:
        """The host's end of a step of ``tokens`` tokens."""

    # -- writes --------------------------------------------------------------------------------------------------
    @abstractmethod
    def observe_queries(self, query_states: torch.Tensor, layer_idx: int) -> None:
        """Hand over one forward's post-RoPE queries ``[B, Hq, L, D]``."""

    @abstractmethod
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states [B, Hkv, L, D]`` and ``value_states [B, Hkv, L, Dv]`` (deciding first where due);
        returns what an attention reads, ``(keys, values)`` ``[B, Hkv, S, D]``."""

    # -- reads ---------------------------------------------------------------------------------------------------
    @abstractmethod
    def conversation(self) -> tuple[int, torch.Tensor | None]:
        """``(tokens, padding)`` of the conversation held: its logical length, the host's int (0: none), and its
        rows' left padding ``[B]`` int64 (None: none); what `PolicyCache.check_request` checks a forward against."""

    @abstractmethod
    def attend(self, query: torch.Tensor, layer_idx: int, scale: float | None) -> torch.Tensor:
        """Attention of the newest tokens ``query [B, Hq, L, D]`` over what the layer holds (its own padding, never
        HF's logical mask) -> ``[B, Hq, L, Dv]``."""

    @abstractmethod
    def entries(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[B, Hkv, S, D]`` the layer holds now."""

    @abstractmethod
    def stored_length(self, layer_idx: int) -> int:
        """Entries held per KV head; under compilation a constant, so that a compiled step never depends on it."""

    @abstractmethod
    def seq_length(self, layer_idx: int) -> int | torch.Tensor:
        """The logical length (the next token's position); under compilation in a static stage a 0-dim tensor."""

    @abstractmethod
    def head_lengths(self, layer_idx: int) -> torch.Tensor:
        """int64 ``[B, Hkv]`` entries held by every (batch row, KV head)."""

    @abstractmethod
    def mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of HF's masks for a forward of ``query_length`` tokens."""

    @abstractmethod
    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """``[B, Hkv, S]`` int64 token position of each entry held."""

    @abstractmethod
    def nbytes(self, layer_idx: int | None = None) -> int:
        """Bytes held (a layer's share for ``layer_idx``, all of them for None)."""
