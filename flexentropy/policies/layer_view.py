"""`LayerView`: what a cache policy may read and write of one layer of the cache it runs in.

The policies are written against this protocol, never against the storage classes (`flexentropy.caches`), which
implement it: the dependency goes one way, from the storage to the policies (design.md §3.2).
"""

from __future__ import annotations

from typing import Protocol

import torch


class LayerView(Protocol):
    """One attention layer's cache, as a policy sees it.

    Read-only:
        keys, values: ``[B, Hkv, S, D]``, ``[B, Hkv, S, Dv]`` the stored entries, per KV head.
        window: ``[B, Hq, W', D]`` the most recent handed-over post-RoPE queries (``W' <= policy.query_window``), or
            None before any.
        layer_idx, num_layers: the layer's index and the model's layer count (None when unknown).
        owner: the cache's class name (for error messages).
        seen: tokens appended so far (the logical length). observed: queries handed over so far.
        prompt_length: tokens of the first ``update`` (None before it). generated: tokens appended after it.
        previous_generated: ``generated`` before the previous ``update`` (None before the first after the prompt).
        evictions: decisions applied so far. stored: entries held per KV head.

    Writable:
        stats: per-entry statistics ``[B, Hkv, S]``, one per name of ``policy.stats``; a policy may update their
            values (not their shape), the storage gathers them with the entries.
    """

    keys: torch.Tensor
    values: torch.Tensor
    window: torch.Tensor | None
    stats: dict[str, torch.Tensor]
    layer_idx: int
    num_layers: int | None
    owner: str
    seen: int
    observed: int
    prompt_length: int | None
    previous_generated: int | None
    evictions: int

    @property
    def stored(self) -> int: ...

    @property
    def generated(self) -> int: ...

    def positions(self) -> torch.Tensor:
        """``[B, Hkv, S]`` int64 logical position of every stored entry, ascending along ``S``."""
        ...

    def row_positions(self) -> torch.Tensor:
        """`positions` counted from each row's first real token (left padding negative)."""
        ...

    def real_entries(self) -> torch.Tensor | None:
        """``[B, Hkv, S]`` bool, False at left-padding entries; None when there are none."""
        ...

    def key_positions(self) -> torch.Tensor:
        """Positions for scoring: ``[S]`` before any decision, else ``[B, Hkv, S]``."""
        ...

    def window_positions(self) -> torch.Tensor:
        """``[W']`` positions of the queries in ``window``."""
        ...
