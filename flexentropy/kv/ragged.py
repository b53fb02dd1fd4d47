"""Decode attention over a *ragged* per-head cache: every (batch row, KV head) keeps its own number of entries.

Per-head budgets (AdaKV, design.md §3) only save memory if the heads' entries are stored without padding. The ragged
layout is a flat ``keys [T, D]`` / ``values [T, Dv]`` holding the entries of head ``(b, h)`` contiguously, in the
order ``(0, 0), (0, 1), ..., (B - 1, Hkv - 1)``, with ``counts [B, Hkv]`` entries each (``T = counts.sum()``), plus a
rectangular *tail* ``[B, Hkv, t, D]`` of the tokens appended since (every head gets every new token).

`ragged_decode_attention` computes exact softmax attention over both parts without padding: the ragged part by a
segment softmax (per-entry logits, a per-segment max and sum by ``scatter_reduce`` / ``index_add``), the tail by a
dense matmul, the two merged with their log-sum-exp statistics (as flash attention merges KV blocks). Memory is
``O(T * G * L)`` for ``G`` query heads per KV head and ``L`` queries: never ``T x T`` and nothing padded to the
longest head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from einops import rearrange


class RaggedKV(NamedTuple):
    """Per-head kept entries without padding: ``keys [T, D]``, ``values [T, Dv]``, ``positions [T]`` (int64), head
    ``(b, h)``'s ``counts[b, h]`` entries contiguous, heads in row-major ``(b, h)`` order."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def from_mask(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
                  ) -> RaggedKV:
        """The entries of ``keys [B, Hkv, S, D]``, ``values``, ``positions [B, Hkv, S]`` where the bool mask ``keep
        [B, Hkv, S]`` is True, flat (fresh, compact tensors)."""
        return cls(keys[keep], values[keep], positions[keep], keep.sum(dim=-1))

    @property
    def longest(self) -> int:
        """Entries of the longest head (a host int: read once per decision, not per step)."""
        return int(self.counts.max()) if self.counts.numel() else 0

    def select_rows(self, rows: torch.Tensor) -> RaggedKV:
        """The batch rows ``rows [B']`` (int64; beam search reorders and repeats rows)."""
        counts = self.counts
        rows = rows.to(counts.device)
        starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view_as(counts)[rows].reshape(-1)
        lengths = counts[rows].reshape(-1)
        offsets = lengths.cumsum(0) - lengths
        index = torch.repeat_interleave(starts - offsets, lengths) + torch.arange(int(lengths.sum()),
                                                                                  device=counts.device)
        return RaggedKV(self.keys[index], self.values[index], self.positions[index], counts[rows])

    def allowed(self, mask: torch.Tensor, tail_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ragged_allowed [T, L], tail_allowed [B, Hkv, L, t])`` for `ragged_decode_attention`: the columns of a
        bool mask ``[B, 1, L, T_logical]`` over logical key positions, read at the ragged entries' positions and at
        the tail's ``tail_positions [B, Hkv, t]``."""
        mask = mask[:, 0].transpose(1, 2)                                                  # [B, T, L]
        kv_heads = tail_positions.shape[1]
        row = segment_ids(self.counts) // kv_heads
        ragged_allowed = mask[row, self.positions]                                         # [T_kept, L]
        tail = tail_positions[:, 0]                                                        # [B, t]
        tail_allowed = mask.gather(1, tail[..., None].expand(-1, -1, mask.shape[-1]))      # [B, t, L]
        return ragged_allowed, tail_allowed.transpose(1, 2)[:, None].expand(-1, kv_heads, -1, -1)


def segment_ids(counts: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64: the flat index ``b * Hkv + h`` of the head owning each ragged entry."""
    flat = counts.reshape(-1)
    return torch.repeat_interleave(torch.arange(flat.numel(), device=counts.device), flat)


def ragged_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    counts: torch.Tensor,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    *,
    ragged_allowed: torch.Tensor | None = None,
    tail_allowed: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of the ``L`` newest tokens over a ragged cache plus its rectangular tail.

    Args:
        query: ``[B, Hq, L, D]`` post-RoPE queries; query head ``hq`` reads KV head ``hq // (Hq // Hkv)``.
        keys, values: ``[T, D]``, ``[T, Dv]`` ragged entries, head ``(b, h)``'s ``counts[b, h]`` entries contiguous,
            heads in row-major ``(b, h)`` order. They all precede the queries (no causal mask needed).
        counts: int ``[B, Hkv]`` entries per head.
        tail_keys, tail_values: ``[B, Hkv, t, D]``, ``[B, Hkv, t, Dv]`` entries appended after the ragged ones; the
            last ``L`` are the queries' own (query ``i`` sees tail entries ``0 .. t - L + i``: bottom-right causal).
            ``t >= L``.
        ragged_allowed: optional bool ``[T, L]``: False where query ``i`` must not see entry ``j`` (padding).
        tail_allowed: optional bool ``[B, Hkv, L, t]`` likewise for the tail (combined with causality).
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns:
        ``[B, Hq, L, Dv]`` in the query's dtype; computed in float32 (float64 for float64 inputs). A query that sees
        no entry gets zeros.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads, tail = tail_keys.shape[1], tail_keys.shape[2]
    if counts.shape != (batch, kv_heads) or q_heads % kv_heads:
        raise ValueError(f"counts {list(counts.shape)} must be [B={batch}, Hkv={kv_heads}] and query heads ({q_heads}) "
                         f"a multiple of KV heads")
    if keys.shape[0] != values.shape[0] or keys.dim() != 2 or keys.shape[-1] != dim:
        raise ValueError(f"ragged keys [T, D={dim}] and values [T, Dv] must agree, got {list(keys.shape)} and "
                         f"{list(values.shape)}")
    if tail < q_len:
        raise ValueError(f"{q_len} queries but only {tail} tail entries: the tail must hold the queries' own keys")
    dtype = torch.promote_types(query.dtype, torch.float32)
    group = q_heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    lowest = torch.finfo(dtype).min
    q = rearrange(query.to(dtype) * scale, "b (h g) l d -> (b h) (g l) d", g=group)     # [BH, GL, D]
    heads, rows = q.shape[:2]

    # Ragged part: per-entry logits against the owning head's queries, then a softmax per segment.
    segment = segment_ids(counts)                                                   # [T]
    logits = torch.einsum("tmd,td->tm", q[segment], keys.to(dtype))                   # [T, GL]
    if ragged_allowed is not None:
        logits = logits.masked_fill(~ragged_allowed.repeat(1, group), float("-inf"))
    index = segment[:, None].expand_as(logits)
    ragged_max = logits.new_full((heads, rows), float("-inf")).scatter_reduce(0, index, logits, "amax")
    probs = torch.exp(logits - ragged_max.clamp_min(lowest)[segment])
    ragged_sum = logits.new_zeros(heads, rows).index_add_(0, segment, probs)
    ragged_out = logits.new_zeros(heads, rows, values.shape[-1]).index_add_(
        0, segment, probs[:, :, None] * values.to(dtype)[:, None, :])

    # Tail: dense, bottom-right causal.
    tail_logits = q @ rearrange(tail_keys.to(dtype), "b h t d -> (b h) d t")            # [BH, GL, t]
    position = torch.arange(tail, device=query.device)
    allowed = (position <= position[tail - q_len :, None]).repeat(group, 1)           # [GL, t]
    if tail_allowed is not None:
        allowed = allowed & rearrange(tail_allowed, "b h l t -> (b h) l t").repeat(1, group, 1)
    tail_logits = tail_logits.masked_fill(~allowed, float("-inf"))
    tail_max = tail_logits.amax(dim=-1)
    tail_probs = torch.exp(tail_logits - tail_max.clamp_min(lowest)[..., None])
    tail_sum = tail_probs.sum(dim=-1)
    tail_out = tail_probs @ rearrange(tail_values.to(dtype), "b h t d -> (b h) t d")

    # Merge the two softmax pieces by their maxima.
    top = torch.maximum(ragged_max, tail_max).clamp_min(lowest)
    ragged_weight, tail_weight = torch.exp(ragged_max - top), torch.exp(tail_max - top)
    total = ragged_sum * ragged_weight + tail_sum * tail_weight
    out = ragged_out * ragged_weight[..., None] + tail_out * tail_weight[..., None]
    out = torch.where(total[..., None] > 0, out / total.clamp_min(torch.finfo(dtype).tiny)[..., None], 0.0)
    return rearrange(out, "(b h) (g l) d -> b (h g) l d", b=batch, g=group).to(query.dtype)
