"""Keep and gather: which cache entries survive an eviction, and the compressed tensors (paper Alg. 4 steps 3-4).

Second and third stages of the cache's *score -> keep -> gather* pipeline, shared by every eviction policy (design.md
§3).
Every (batch row, KV head) keeps the same number of entries so the compressed cache stays a rectangular
``[B, Hkv, kept, D]`` tensor, stored per KV head (never expanded to the query heads).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flexentropy._checks import is_int


class KeptKV(NamedTuple):
    """Compressed cache: ``keys [B, Hkv, K, D]``, ``values [B, Hkv, K, Dv]``, ``positions [B, Hkv, K]`` or None."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor | None


def keep_indices(scores: torch.Tensor, budget: int, forced: int | torch.Tensor = 0) -> torch.Tensor:
    """Indices of the entries to keep per (batch row, KV head), in original order (paper Alg. 4 step 3, design.md §2).

    Args:
        scores: ``[B, Hkv, T]`` importance of each cached entry (finite; higher is kept first).
        budget: entries to keep per head (``B_d``); when ``budget >= T`` every entry is kept.
        forced: entries kept whatever their score: an int ``n`` for the last ``n`` entries (the observation
            window's own positions sit at the end of the cache), or a bool mask broadcastable to ``[B, Hkv, T]``.
            At most ``budget`` per head.

    Returns:
        ``[B, Hkv, min(budget, T)]`` int64 indices into ``T``, ascending: the forced entries, then the top
        ``budget - forced`` others by score, ties going to the lower index.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, Hkv, T], got shape {list(scores.shape)}")
    if not is_int(budget) or budget < 1:
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")
    length = scores.shape[-1]
    if isinstance(forced, torch.Tensor):
        if forced.dtype != torch.bool:
            raise TypeError(f"forced must be an int or a bool mask, got a {forced.dtype} tensor")
        try:
            forced_mask = forced.to(scores.device).expand(scores.shape)
        except RuntimeError as err:
            raise ValueError(f"forced mask of shape {list(forced.shape)} does not broadcast to the scores' "
                             f"{list(scores.shape)}") from err
        most = int(forced_mask.sum(-1).max()) if forced_mask.numel() else 0
    elif is_int(forced) and 0 <= forced <= length:
        forced_mask = torch.arange(length, device=scores.device) >= length - forced
        most = forced
    else:
        raise ValueError(f"forced must be a bool mask or an int in [0, T={length}], got {forced!r}")
    if most > budget:
        raise ValueError(f"{most} forced entries in one head exceed the budget of {budget}")
    if budget >= length:
        return torch.arange(length, device=scores.device).expand(scores.shape).clone()
    # One stable sort: the forced entries first (above every score, an infinite one cut to the largest finite),
    # then the others by score, descending, ties to the lower index.
    ranked = scores.clamp(max=torch.finfo(scores.dtype).max).masked_fill_(forced_mask, float("inf"))
    return torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :budget].sort(dim=-1).values


def gather_kv(
    keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, positions: torch.Tensor | None = None
) -> KeptKV:
    """The entries ``indices [B, Hkv, K]`` of ``keys [B, Hkv, T, D]``, ``values [B, Hkv, T, Dv]`` (Alg. 4 step 4).

    ``positions`` (``[T]`` or ``[B, Hkv, T]``, the logical token position of each entry) is gathered alongside
    when given, so masks and diagnostics can be derived from the compressed cache.
    """
    if keys.dim() != 4 or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"keys [B, Hkv, T, D] and values [B, Hkv, T, Dv] must agree on B, Hkv, T, got "
                         f"{list(keys.shape)} and {list(values.shape)}")
    if indices.dim() != 3 or indices.shape[:2] != keys.shape[:2]:
        raise ValueError(f"indices must be [B, Hkv, K] = [{keys.shape[0]}, {keys.shape[1]}, K], "
                         f"got {list(indices.shape)}")
    index = indices.unsqueeze(-1)
    kept_keys = keys.gather(2, index.expand(-1, -1, -1, keys.shape[-1]))
    kept_values = values.gather(2, index.expand(-1, -1, -1, values.shape[-1]))
    kept_positions = None if positions is None else positions.expand(keys.shape[:3]).gather(-1, indices)
    return KeptKV(kept_keys, kept_values, kept_positions)
