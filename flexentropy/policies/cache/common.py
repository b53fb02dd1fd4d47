"""Scoring helpers shared by the cache policies (no policy logic here: only what several rules read)."""

from __future__ import annotations

import torch

from flexentropy._checks import check_int
from flexentropy.kv.scoring import pool_scores, spread_forward, window_attention_scores
from flexentropy.policies.layer_view import LayerView


def window_scores(layer: LayerView, kind: str = "softmax", pool: int = 1, span: int = 0,
                  group_mode: str = "mean") -> torch.Tensor:
    """``[B, Hkv, S]`` importance of the stored entries under the layer's query window (SnapKV / design.md §2 scoring):
    mean softmax attention over the window's queries and the group's query heads (``kind="raw"``: summed logits;
    ``group_mode="max"``: the best query head's), then average pooling of width ``pool``, then spread forward over
    ``span`` entries (`spread_forward`)."""
    scores = window_attention_scores(layer.window, layer.keys, query_positions=layer.window_positions(),
                                     key_positions=layer.key_positions(), kind=kind, key_mask=layer.real_entries(),
                                     group_mode=group_mode)
    return spread_forward(pool_scores(scores, pool), span)


def check_window_budget(owner: str, budget: object, window: int) -> None:
    """Raise unless ``budget`` (entries kept per KV head) is an int of at least ``window``: a policy that scores with
    a query window always keeps the window's own entries."""
    check_int(owner, "budget", budget, window,
              minimum_is=f"window={window}: the window's own entries are always kept; a smaller budget needs a "
                         f"smaller window=")


def window_entries(layer: LayerView) -> int:
    """Stored entries at the window's own positions (the last ones: every decision keeps them)."""
    first = layer.observed - layer.window.shape[-2]
    return max(0, layer.seen - first)


MAX_SCORE_ELEMENTS = 1 << 26
"""Largest ``[B, Hq, rows, S]`` block of attention scores `accumulate_attention` materialises (256 MiB in float32)."""


def accumulate_attention(layer: LayerView, queries: torch.Tensor, first_position: int,
                         chunk: int = 256) -> torch.Tensor:
    """``[B, Hkv, S]`` attention the stored entries receive from ``queries [B, Hq, L, D]`` (positions
    ``first_position ..``), *summed* over the queries and the group's query heads (causal: a query adds 0 to keys
    after it). Queries are taken at most ``chunk`` at a time, fewer when ``B * Hq * chunk * S`` would exceed
    `MAX_SCORE_ELEMENTS`: memory is bounded, never ``L x S`` for a whole prompt (the compute is a dense ``Q K^T``)."""
    group = queries.shape[1] // layer.keys.shape[1]
    key_positions, key_mask = layer.key_positions(), layer.real_entries()
    per_row = queries.shape[0] * queries.shape[1] * max(layer.keys.shape[2], 1)
    chunk = max(1, min(chunk, MAX_SCORE_ELEMENTS // per_row))
    total = torch.zeros(layer.keys.shape[:3], dtype=torch.promote_types(queries.dtype, torch.float32),
                        device=layer.keys.device)
    for start in range(0, queries.shape[2], chunk):
        part = queries[:, :, start : start + chunk]
        positions = torch.arange(first_position + start, first_position + start + part.shape[2],
                                 device=queries.device)
        mean = window_attention_scores(part, layer.keys, query_positions=positions, key_positions=key_positions,
                                       key_mask=key_mask)
        total += mean * (group * part.shape[2])
    return total
