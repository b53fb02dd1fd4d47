"""Dense reference twins of the peers' prefill policies: ``flexprefill``, ``xattention``, ``vertical_slash``
(`flexentropy.policies.prefill.{flexprefill,xattention,vertical_slash}`).

Written to be read against the papers and the policy docstrings, not to be fast: loops over batch rows, heads, query
blocks and tiles, float64, Python sorting with explicit tie rules, no FlexAttention. It shares nothing with
``flexentropy`` except :class:`flexentropy.config.EntropyConfig` and ``Q_BLOCK_SIZE``.

Notation: ``q [B, Hq, N, D]``, ``k [B, Hkv, N, D]``, query head ``h`` reads KV head ``h // (Hq // Hkv)``; query block
``qb`` holds tokens ``[128 qb, 128 qb + 128)``, key block ``j`` tokens ``[L_B j, L_B j + L_B)``; causal: ``j <= i``.
"""

from __future__ import annotations

import math

import torch

from flexentropy.config import Q_BLOCK_SIZE, EntropyConfig
from reference import prefill as ref_prefill

F64 = torch.float64
SINK_COLUMNS, LOCAL_DIAGONALS, LAST_QUERIES = 30, 100, 64


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _last_key_block(qb: int, n: int, block_size: int) -> int:
    return (min((qb + 1) * Q_BLOCK_SIZE, n) - 1) // block_size


def fixed_table(n: int, config: EntropyConfig) -> list[list[int]]:
    """Per query block, the key blocks every policy keeps: every causal block in a dense segment
    (`reference.prefill.dense_row`); otherwise its own segment's blocks up to the
    diagonal, the first ``sink_blocks`` and the ``local_blocks`` just before the segment (blocks before it only)."""
    seg, blk = config.segment_size, config.block_size
    rows = []
    for qb in range(_ceil_div(n, Q_BLOCK_SIZE)):
        s = qb * Q_BLOCK_SIZE // seg
        first, last = s * seg // blk, _last_key_block(qb, n, blk)
        if ref_prefill.dense_row(s, n, config):
            rows.append(list(range(last + 1)))
            continue
        before = [j for j in range(first) if j < config.sink_blocks or j >= first - config.local_blocks]
        rows.append(before + list(range(first, last + 1)))
    return rows


def cover(scores: dict[int, float], forced: set[int], fraction: float) -> list[int]:
    """Free entries (keys of ``scores`` not in ``forced``) best first, ties to the lower index, taken while the kept
    mass (forced first) is below ``fraction`` of the total; ``fraction >= 1`` takes every free entry."""
    need = fraction * sum(scores.values())
    kept = sum(scores[i] for i in forced if i in scores)
    chosen = []
    for i in sorted((i for i in scores if i not in forced), key=lambda i: (-scores[i], i)):
        if fraction < 1 and kept >= need:
            break
        chosen.append(i)
        kept += scores[i]
    return chosen


def top(scores: list[float], count: int) -> list[int]:
    """The ``count`` best indices, ties to the lower index."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:count]


def _table(n: int, config: EntropyConfig, selected: list[set[int]]) -> torch.Tensor:
    """Row table ``[C_Q, C_B]``: the selected causal blocks of each query block plus its `fixed_table` blocks."""
    blk = config.block_size
    table = torch.zeros(_ceil_div(n, Q_BLOCK_SIZE), _ceil_div(n, blk), dtype=torch.bool)
    for qb, fixed in enumerate(fixed_table(n, config)):
        for j in set(fixed) | {j for j in selected[qb] if j <= _last_key_block(qb, n, blk)}:
            table[qb, j] = True
    return table


def last_attention(q: torch.Tensor, k: torch.Tensor, b: int, h: int, count: int) -> torch.Tensor:
    """float64 ``[count, N]``: softmax(q_i . k_j / sqrt(D)) over ``j <= i`` for the last ``count`` queries."""
    n, dim = q.shape[2], q.shape[3]
    kv = h // (q.shape[1] // k.shape[1])
    rows = torch.zeros(count, n, dtype=F64)
    for r, i in enumerate(range(n - count, n)):
        logits = k[b, kv, : i + 1].to(F64) @ q[b, h, i].to(F64) / math.sqrt(dim)
        rows[r, : i + 1] = torch.softmax(logits, dim=0)
    return rows


# --------------------------------------------------------------------------------------------------------------
# XAttention (Xu et al., ICML 2025): antidiagonal scoring, threshold block selection
# --------------------------------------------------------------------------------------------------------------


def xattention_mass(q: torch.Tensor, k: torch.Tensor, stride: int, block_size: int) -> torch.Tensor:
    """``[B, Hq, C_Q, C_B]`` float64: for query tile ``t`` (tokens ``[tS, tS + S)``, zero past N) and key tile
    ``u <= t``, logit ``sum_a q[tS + S-1-a] . k[uS + a] / (sqrt(D) S)``; softmax over ``u``; summed into (query
    block of ``tS``, key block of ``uS``). Tiles starting at or after N have no row."""
    batch, q_heads, n, dim = q.shape
    group = q_heads // k.shape[1]
    tiles = _ceil_div(n, stride)
    mass = torch.zeros(batch, q_heads, _ceil_div(n, Q_BLOCK_SIZE), _ceil_div(n, block_size), dtype=F64)

    for b in range(batch):
        for h in range(q_heads):
            qs = torch.zeros(tiles * stride, dim, dtype=F64)
            ks = torch.zeros(tiles * stride, dim, dtype=F64)
            qs[:n], ks[:n] = q[b, h].to(F64), k[b, h // group].to(F64)
            key_tiles = ks.view(tiles, stride, dim)                                   # [u, a, D]
            for t in range(tiles):
                logits = torch.zeros(t + 1, dtype=F64)
                for a in range(stride):                                               # one antidiagonal
                    logits += key_tiles[: t + 1, a] @ qs[t * stride + stride - 1 - a]
                probs = torch.softmax(logits / (math.sqrt(dim) * stride), dim=0)
                key_block = torch.arange(t + 1) * stride // block_size                    # block of tile u
                mass[b, h, t * stride // Q_BLOCK_SIZE].index_add_(0, key_block, probs)
    return mass


def xattention_blocks(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, threshold: float = 0.9,
                      stride: int = 8) -> torch.Tensor:
    """Per query block, `cover` of its row of `xattention_mass` over the causal blocks, the fixed ones forced."""
    n = q.shape[2]
    mass = xattention_mass(q, k, stride, config.block_size)
    fixed = fixed_table(n, config)
    blocks = torch.zeros(mass.shape, dtype=torch.bool)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            chosen = []
            for qb in range(mass.shape[2]):
                causal = range(_last_key_block(qb, n, config.block_size) + 1)
                chosen.append(set(cover({j: float(mass[b, h, qb, j]) for j in causal}, set(fixed[qb]), threshold)))
            blocks[b, h] = _table(n, config, chosen)
    return blocks


# --------------------------------------------------------------------------------------------------------------
# FlexPrefill (Lai et al., ICLR 2025, sec. 3): pattern determination, cumulative-attention selection
# --------------------------------------------------------------------------------------------------------------


def _mean_rows(x: torch.Tensor, size: int, count: int) -> list[torch.Tensor]:
    """Means over ``[c size, c size + size)`` (real tokens) of ``x [N, D]``, for ``c < count``."""
    return [x[c * size: (c + 1) * size].to(F64).mean(dim=0) for c in range(count)]


def js_distance(p: list[float], r: list[float]) -> float:
    """sqrt of the Jensen-Shannon divergence in nats, ``0 ln 0 = 0``."""
    def kl(a: list[float], m: list[float]) -> float:
        return sum(x * math.log(x / y) for x, y in zip(a, m, strict=True) if x > 0)

    m = [(x + y) / 2 for x, y in zip(p, r, strict=True)]
    return math.sqrt(max(0.5 * kl(p, m) + 0.5 * kl(r, m), 0.0))


def flexprefill_blocks(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, gamma: float = 0.9,
                       tau: float = 0.1, min_budget: int | None = None) -> torch.Tensor:
    """Per head: from the last ``c = min(128, N)`` queries, ``vertical[j]`` (mean over them of their attention in
    key block j) and ``slash[o]`` (the same over pairs with ``i // L_B - j // L_B = o``); ``pooled`` = softmax over
    key blocks of ``mean(q_last) . mean(k in j) / sqrt(D)``; the head is query-aware when
    ``sqrt(JSD(pooled, vertical)) < tau``. Every head keeps the top ``ceil(min_budget / L_B)`` columns and bands
    (``min_budget`` None: ``base_budget``); a vertical-slash head adds the `cover` of ``vertical`` (sinks forced)
    and of ``slash`` (band 0 forced) at ``gamma``; a query-aware head adds the `cover` at ``gamma`` of the pairs
    (qb, j) of its table, scored by the softmax over qb's causal blocks of ``mean(q in qb) . mean(k in j) /
    sqrt(D)``, the fixed pairs forced. Band ``o`` gives query block qb every block ``kb - o`` for its key blocks
    ``kb``."""
    batch, q_heads, n, dim = q.shape
    blk = config.block_size
    group = q_heads // k.shape[1]
    num_blocks, num_qblocks = _ceil_div(n, blk), _ceil_div(n, Q_BLOCK_SIZE)
    count = min(Q_BLOCK_SIZE, n)
    least = min(_ceil_div(int(config.base_budget) if min_budget is None else min_budget, blk), num_blocks)
    fixed = fixed_table(n, config)
    blocks = torch.zeros(batch, q_heads, num_qblocks, num_blocks, dtype=torch.bool)
    for b in range(batch):
        for h in range(q_heads):
            probs = last_attention(q, k, b, h, count)
            vertical, slash = torch.zeros(num_blocks, dtype=F64), torch.zeros(num_blocks, dtype=F64)
            for r, i in enumerate(range(n - count, n)):
                key_block = torch.arange(i + 1) // blk
                vertical.index_add_(0, key_block, probs[r, : i + 1] / count)
                slash.index_add_(0, i // blk - key_block, probs[r, : i + 1] / count)
            vertical, slash = vertical.tolist(), slash.tolist()
            keys = _mean_rows(k[b, h // group], blk, num_blocks)
            last = q[b, h, n - count:].to(F64).mean(dim=0)
            pooled = torch.softmax(torch.stack([last @ key for key in keys]) / math.sqrt(dim), dim=0).tolist()
            query_aware = js_distance(pooled, vertical) < tau
            columns = set(top(vertical, least))
            bands = set(top(slash, least))
            selected: list[set[int]] = [set() for _ in range(num_qblocks)]
            if query_aware:
                scores, forced = {}, set()
                for qb, mean_q in enumerate(_mean_rows(q[b, h], Q_BLOCK_SIZE, num_qblocks)):
                    causal = list(range(_last_key_block(qb, n, blk) + 1))
                    row = torch.softmax(torch.stack([mean_q @ keys[j] for j in causal]) / math.sqrt(dim), dim=0)
                    scores.update({(qb, j): float(row[j]) for j in causal})
                    forced.update((qb, j) for j in fixed[qb])
                for qb, j in cover(scores, forced, gamma):
                    selected[qb].add(j)
            else:
                sinks = {j for j in range(num_blocks) if j < config.sink_blocks}
                columns |= set(cover(dict(enumerate(vertical)), sinks, gamma))
                bands |= set(cover(dict(enumerate(slash)), {0}, gamma))
            for qb in range(num_qblocks):
                own = range(qb * Q_BLOCK_SIZE // blk, min((qb + 1) * Q_BLOCK_SIZE // blk, num_blocks))
                selected[qb] |= columns | {kb - o for kb in own for o in bands if kb - o >= 0}
            blocks[b, h] = _table(n, config, selected)
    return blocks


# --------------------------------------------------------------------------------------------------------------
# MInference vertical-slash (Jiang et al., NeurIPS 2024, sec. 3)
# --------------------------------------------------------------------------------------------------------------


def vertical_slash_tokens(q: torch.Tensor, k: torch.Tensor, vertical: int = 1000,
                          slash: int = 6096) -> tuple[list[list[set[int]]], list[list[set[int]]]]:
    """``[b][h]`` selected key columns and token offsets ``d = i - j``: from the last ``min(64, N)`` queries'
    attention, column sums and diagonal sums; the first 30 columns and offsets below 100 rank first (infinite
    score); the top ``vertical`` columns and ``slash`` offsets, ties to the lower index."""
    batch, q_heads, n, _ = q.shape
    count = min(LAST_QUERIES, n)
    columns: list[list[set[int]]] = []
    diagonals: list[list[set[int]]] = []
    for b in range(batch):
        columns.append([])
        diagonals.append([])
        for h in range(q_heads):
            probs = last_attention(q, k, b, h, count)
            col, diag = torch.zeros(n, dtype=F64), torch.zeros(n, dtype=F64)
            for r, i in enumerate(range(n - count, n)):
                col[: i + 1] += probs[r, : i + 1]
                diag[: i + 1] += probs[r, : i + 1].flip(0)                               # d = i - j
            col, diag = col.tolist(), diag.tolist()
            col = [math.inf if j < SINK_COLUMNS else x for j, x in enumerate(col)]
            diag = [math.inf if d < LOCAL_DIAGONALS else x for d, x in enumerate(diag)]
            columns[b].append(set(top(col, vertical)))
            diagonals[b].append(set(top(diag, slash)))
    return columns, diagonals


def vertical_slash_blocks(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, vertical: int = 1000,
                          slash: int = 6096) -> torch.Tensor:
    """Blocks holding a selected token pair (causal ``j <= i``, on a selected column or offset), brute force over
    each block pair's tokens, plus the fixed blocks."""
    batch, q_heads, n, _ = q.shape
    blk = config.block_size
    columns, diagonals = vertical_slash_tokens(q, k, vertical, slash)
    num_qblocks, num_blocks = _ceil_div(n, Q_BLOCK_SIZE), _ceil_div(n, blk)
    blocks = torch.zeros(batch, q_heads, num_qblocks, num_blocks, dtype=torch.bool)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    for b in range(batch):
        for h in range(q_heads):
            column = torch.zeros(n, dtype=torch.bool)
            column[list(columns[b][h])] = True
            offset = torch.zeros(n, dtype=torch.bool)
            offset[list(diagonals[b][h])] = True
            pairs = (j <= i) & (column[None, :] | offset[(i - j).clamp(0, n - 1)])          # [N, N] token pairs
            selected = []
            for qb in range(num_qblocks):
                rows = pairs[qb * Q_BLOCK_SIZE: (qb + 1) * Q_BLOCK_SIZE]
                selected.append({jb for jb in range(num_blocks) if bool(rows[:, jb * blk: (jb + 1) * blk].any())})
            blocks[b, h] = _table(n, config, selected)
    return blocks
