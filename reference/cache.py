"""Dense reference oracle for latent KV-cache eviction (design.md §2; seed paper sec. 4.3, Appendix B Alg. 4).

Written to be read against the paper and docs/design.md line by line, not to be fast: explicit Python loops over batch
rows,
KV heads, the group's query heads and window queries, float64, one full softmax per window query, no vectorised
top-k. It shares nothing with ``flexentropy.caches`` except :class:`flexentropy.config.EntropyConfig`.

Notation (docs/design.md, notation): queries ``[B, Hq, ., D]``, keys/values ``[B, Hkv, ., D]``, ``G = Hq // Hkv``;
query head
``hq`` reads KV head ``hq // G``. Positions are 0-based logical token positions; query ``i`` sees key ``j`` iff
``pos(j) <= pos(i)``.
"""

from __future__ import annotations

import math

import torch

from flexentropy.config import EntropyConfig


def _per_head_positions(key_positions: torch.Tensor, batch: int, kv_heads: int, length: int) -> list:
    """``key_positions`` (``[T]`` or ``[B, Hkv, T]``) as nested lists ``[b][h][j]``."""
    if key_positions.dim() == 1:
        row = key_positions.tolist()
        return [[row for _ in range(kv_heads)] for _ in range(batch)]
    return key_positions.reshape(batch, kv_heads, length).tolist()


# --------------------------------------------------------------------------------------------------------------
# Alg. 4 step 2: importance of every cached key
# --------------------------------------------------------------------------------------------------------------


def window_attention_scores(
    window_q: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    kind: str = "softmax",
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    group_mode: str = "mean",
) -> torch.Tensor:
    """Scores ``[B, Hkv, T]`` float64 of ``keys [B, Hkv, T, D]`` under ``window_q [B, Hq, W, D]`` (design.md §2).

    ``key_mask`` (bool ``[B, Hkv, T]``, optional): a key where it is False is seen by no query (left padding).

    ``"softmax"``: for every KV head ``h``, every query head ``hq`` of its group and every window query ``i``, the
    softmax over the keys ``i`` sees of ``scale * q.k`` (default ``scale = 1/sqrt(D)``), accumulated and divided
    by ``G * W`` (unseen keys add 0). ``"raw"`` (Alg. 4 lines 13-14, ``w = sum_i Q_W K^T``): the sum of the unscaled
    logits over the same (query, head) pairs, unseen keys adding 0. ``group_mode="max"``: each query head's own
    score over the window (divided by ``W`` for ``"softmax"``), the best head's per key.
    """
    batch, q_heads, window, dim = window_q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    q = window_q.to(torch.float64)
    k = keys.to(torch.float64)
    q_pos = query_positions.tolist()
    k_pos = _per_head_positions(key_positions, batch, kv_heads, length)
    allowed = (torch.ones(batch, kv_heads, length, dtype=torch.bool) if key_mask is None else key_mask).tolist()
    per_head = torch.zeros(batch, kv_heads, group, length, dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            for g in range(group):
                hq = h * group + g
                for i in range(window):
                    seen = [j for j in range(length) if k_pos[b][h][j] <= q_pos[i] and allowed[b][h][j]]
                    if not seen:
                        continue  # every key this query saw was evicted: it adds nothing
                    logits = {j: float(torch.dot(q[b, hq, i], k[b, h, j])) for j in seen}  # S = Q_W K^T, row i
                    if kind == "raw":
                        for j in seen:
                            per_head[b, h, g, j] += logits[j]  # w = sum_i S[i, :]
                        continue
                    top = max(scale * logits[j] for j in seen)
                    exps = {j: math.exp(scale * logits[j] - top) for j in seen}
                    total = sum(exps.values())
                    for j in seen:
                        per_head[b, h, g, j] += exps[j] / total / window
    if group_mode == "max":
        return per_head.amax(dim=2)
    return per_head.sum(dim=2) if kind == "raw" else per_head.sum(dim=2) / group


def prefix_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One decode step over the first ``lengths[b]`` entries of each row (what `flash_decode` computes): float64
    ``[B, Hq, 1, Dv]`` for ``query [B, Hq, 1, D]``, ``keys [B, Hkv, C, D]``, ``values [B, Hkv, C, Dv]``."""
    batch, q_heads, _, dim = query.shape
    group = q_heads // keys.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    out = torch.zeros(batch, q_heads, 1, values.shape[-1], dtype=torch.float64)
    for b in range(batch):
        used = int(lengths[b])
        for hq in range(q_heads):
            k = keys[b, hq // group, :used].double().cpu()
            v = values[b, hq // group, :used].double().cpu()
            weights = torch.softmax(query[b, hq, 0].double().cpu() @ k.T * scale, dim=-1)
            out[b, hq, 0] = weights @ v
    return out


def pool_scores(scores: torch.Tensor, width: int) -> torch.Tensor:
    """Average pooling along the last axis, same length, zero padding counted (``t`` averages ``t +- width//2``)."""
    radius = width // 2
    length = scores.shape[-1]
    pooled = torch.zeros_like(scores, dtype=torch.float64)
    for t in range(length):
        pooled[..., t] = scores[..., max(0, t - radius) : min(length, t + radius + 1)].to(torch.float64).sum(-1) / width
    return pooled


def spread_forward(scores: torch.Tensor, span: int) -> torch.Tensor:
    """Entry ``t`` becomes the max of entries ``t - span .. t`` (those before the start not counted)."""
    spread = torch.empty_like(scores, dtype=torch.float64)
    for t in range(scores.shape[-1]):
        spread[..., t] = scores[..., max(0, t - span) : t + 1].to(torch.float64).amax(-1)
    return spread


# --------------------------------------------------------------------------------------------------------------
# Alg. 4 steps 3-4: selection and compression
# --------------------------------------------------------------------------------------------------------------


def keep_indices(scores: torch.Tensor, budget: int, forced: torch.Tensor) -> torch.Tensor:
    """Per ``(b, h)``: the ``forced [B, Hkv, T]`` entries, then the best others by score (ties to the lower index),
    ``min(budget, T)`` in all, returned ascending as ``[B, Hkv, min(budget, T)]`` int64."""
    batch, kv_heads, length = scores.shape
    kept = torch.empty(batch, kv_heads, min(budget, length), dtype=torch.long)
    for b in range(batch):
        for h in range(kv_heads):
            ranked = sorted(range(length), key=lambda j: (not bool(forced[b, h, j]), -float(scores[b, h, j]), j))
            kept[b, h] = torch.tensor(sorted(ranked[:budget]))
    return kept


def evict(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    window_q: torch.Tensor,
    query_positions: torch.Tensor,
    config: EntropyConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One latent eviction (paper Alg. 4): ``(indices, keys, values, positions)`` after keeping ``decode_budget``.

    ``positions [B, Hkv, T]`` are the stored entries' token positions; the window's own positions (those at or
    after its first query) are always kept.
    """
    scores = window_attention_scores(window_q, keys, query_positions, positions, config.decode_score,
                                     group_mode=config.decode_group)  # step 2
    scores = spread_forward(pool_scores(scores, config.decode_pool), config.decode_span)
    forced = positions >= int(query_positions[0])  # step 1: the window's own entries
    indices = keep_indices(scores, config.decode_budget, forced)  # step 3
    batch, kv_heads, kept = indices.shape
    new_keys = torch.empty(batch, kv_heads, kept, keys.shape[-1], dtype=keys.dtype)
    new_values = torch.empty(batch, kv_heads, kept, values.shape[-1], dtype=values.dtype)
    new_positions = torch.empty(batch, kv_heads, kept, dtype=torch.long)
    for b in range(batch):  # step 4: KV_compressed = {(K_j, V_j) | j in I_idx}
        for h in range(kv_heads):
            for slot, j in enumerate(indices[b, h].tolist()):
                new_keys[b, h, slot] = keys[b, h, j]
                new_values[b, h, slot] = values[b, h, j]
                new_positions[b, h, slot] = positions[b, h, j]
    return indices, new_keys, new_values, new_positions


# --------------------------------------------------------------------------------------------------------------
# One layer's lifecycle (design.md §2, and the schedule of flexentropy.caches.LatentKVCache)
# --------------------------------------------------------------------------------------------------------------


class LatentCacheOracle:
    """One attention layer's cache under latent eviction, step by step, keeping every query it was handed.

    ``step(q, k, v)`` is one forward: the first is the prompt. Before appending, once ``decode_delay`` tokens have
    been generated, the first step evicts to ``decode_budget`` when more are stored (``decode_delay = 0``: at the end
    of the prompt's forward, once its queries are handed over); afterwards, with
    ``recompress_every = R``, a step that finds ``decode_budget + R`` stored evicts again. The window is the last
    ``decode_window`` queries handed over, the current forward's included when ``hand_over="before"``.
    """

    def __init__(self, config: EntropyConfig) -> None:
        self.config = config
        self.keys: torch.Tensor | None = None  # [B, Hkv, S, D] stored entries
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [B, Hkv, S] their token positions
        self.queries: torch.Tensor | None = None  # [B, Hq, observed, D] every query handed over
        self.prompt_length: int | None = None
        self.seen = 0
        self.evictions: list[torch.Tensor] = []  # the kept indices of each eviction
        self._first_check_done = False

    def _hand_over(self, query: torch.Tensor) -> None:
        self.queries = query if self.queries is None else torch.cat([self.queries, query], dim=2)

    def step(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hand_over: str = "before"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of ``q_len`` tokens; returns the ``(keys, values)`` its attention reads (the stored ones, before
        an eviction that ends the forward)."""
        config = self.config
        if hand_over == "before":
            self._hand_over(query)
        if self.prompt_length is not None and self.seen - self.prompt_length >= config.decode_delay:
            stored = self.keys.shape[2]
            if not self._first_check_done:
                due = stored > config.decode_budget
                self._first_check_done = True
            else:
                due = config.recompress_every is not None and stored >= config.decode_budget + config.recompress_every
            self._evict_if(due)
        batch, kv_heads, q_len = key.shape[:3]
        new_positions = torch.arange(self.seen, self.seen + q_len).expand(batch, kv_heads, q_len)
        if self.keys is None:
            self.prompt_length = q_len
            self.keys, self.values, self.positions = key, value, new_positions.clone()
        else:
            self.keys = torch.cat([self.keys, key], dim=2)
            self.values = torch.cat([self.values, value], dim=2)
            self.positions = torch.cat([self.positions, new_positions], dim=2)
        self.seen += q_len
        if hand_over == "after":
            self._hand_over(query)
        read = self.keys, self.values   # what this forward's attention reads
        if config.decode_delay == 0 and not self._first_check_done:   # the end of the prompt's forward
            self._first_check_done = True
            self._evict_if(self.keys.shape[2] > config.decode_budget)
        return read

    def _evict_if(self, due: bool) -> None:
        """Keep ``decode_budget`` entries per head by window attention when ``due``."""
        if not due:
            return
        config = self.config
        window = min(config.decode_window, self.queries.shape[2])
        observed = self.queries.shape[2]
        query_positions = torch.arange(observed - window, observed)
        indices, self.keys, self.values, self.positions = evict(
            self.keys, self.values, self.positions, self.queries[:, :, observed - window :], query_positions, config,
        )
        self.evictions.append(indices)
