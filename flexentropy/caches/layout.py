"""How a `PolicyLayer`'s entries are laid out, and the reads that depend on it.

Rectangular: ``keys [B, Hkv, S, D]``, ``values [B, Hkv, S, Dv]`` at logical positions ``[B, Hkv, S]``. Ragged, after a
ragged decision (AdaKV): the kept entries flat in a `RaggedKV` (`flexentropy.kv.ragged`), plus a rectangular tail of
the tokens appended since. HF attention code cannot read the ragged layout: ``update`` then returns a zero-memory NaN
placeholder of the padded shape (`nan_entries`: a reader that does not know the layout fails loudly), and attention
goes through `attend_entries`.
"""

from __future__ import annotations

import torch

from flexentropy.kv.decode_attention import decode_attention, grouped_attention, kept_columns
from flexentropy.kv.ragged import RaggedKV, ragged_decode_attention


def nan_entries(keys: torch.Tensor, values: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-memory NaN keys and values ``[B, Hkv, count, D]`` shaped like ``keys``/``values`` (batch, heads, head
    dims): what an ``update`` returns where no caller may read the entries (a reader that does fails loudly)."""
    nan = float("nan")
    return (keys.new_full((1, 1, 1, 1), nan).expand(*keys.shape[:2], count, keys.shape[-1]),
            values.new_full((1, 1, 1, 1), nan).expand(*values.shape[:2], count, values.shape[-1]))


def head_lengths(keys: torch.Tensor, ragged: RaggedKV | None) -> torch.Tensor:
    """int64 ``[B, Hkv]`` entries held by every (batch row, KV head): the rectangular ``keys [B, Hkv, S, D]`` (a
    ragged layer's tail) and the ``ragged`` part's counts."""
    tail = torch.full(keys.shape[:2], keys.shape[-2], dtype=torch.long, device=keys.device)
    return tail if ragged is None else tail + ragged.counts


def attend_entries(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ragged: RaggedKV | None,
                   attention_mask: torch.Tensor | None, positions: torch.Tensor | None,
                   scale: float | None) -> torch.Tensor:
    """Attention of the ``L`` newest tokens (whose keys are stored last) over a layer's entries, in either layout.

    Args:
        query: ``[B, Hq, L, D]`` post-RoPE.
        keys, values: ``[B, Hkv, S, D]``, ``[B, Hkv, S, Dv]`` the rectangular entries (a ragged layer's tail).
        ragged: the ragged part, or None.
        attention_mask: optional bool ``[B, 1, L, T]`` over *logical* key positions ``0 .. T-1`` (True: attend),
            e.g. a padding mask; the columns of the kept entries are read at their positions.
        positions: ``[B, Hkv, S]`` int64 positions of the rectangular entries (read with a mask only).
        scale: softmax scale (default ``1 / sqrt(D)``).

    Returns:
        ``[B, Hq, L, Dv]`` in the query's dtype.
    """
    if ragged is None:
        if attention_mask is None:
            return decode_attention(query, keys, values, scale=scale)
        return grouped_attention(query, keys, values, kept_columns(attention_mask, positions), scale)
    ragged_allowed = tail_allowed = None
    if attention_mask is not None:
        ragged_allowed, tail_allowed = ragged.allowed(attention_mask, positions)
    return ragged_decode_attention(query, ragged.keys, ragged.values, ragged.counts, keys, values,
                                   ragged_allowed=ragged_allowed, tail_allowed=tail_allowed, scale=scale)
