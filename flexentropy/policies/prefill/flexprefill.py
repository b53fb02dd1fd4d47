"""``flexprefill``: per head, a query-aware or a vertical-slash block pattern, each the fewest blocks reaching an
estimated attention mass ``gamma`` (FlexPrefill, Lai et al., ICLR 2025, sec. 3: query-aware sparse pattern
determination, cumulative-attention based index selection)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from einops import rearrange

from flexentropy._checks import check_int, check_number
from flexentropy.config import Q_BLOCK_SIZE
from flexentropy.policies.base import PrefillPolicy
from flexentropy.policies.prefill.estimates import block_means, block_sums, compute_dtype, last_queries_attention
from flexentropy.policies.prefill.fixed import fixed_blocks, query_block_table
from flexentropy.policies.prefill.ranking import mass_cover, top_k_mask
from flexentropy.sparse.kernel import pad_rows
from flexentropy.sparse.plan import SparsePlan, causal_blocks, query_blocks


class FlexPrefillEstimate(NamedTuple):
    """What FlexPrefill reads from one layer (float32, float64 for float64 inputs).

    Attributes:
        vertical: ``[B, Hq, C_B]`` attention of the last query block per key block (mean over its queries; sums
            to 1): the true distribution of the pattern test, pooled to blocks.
        slash: ``[B, Hq, C_B]`` the same attention per block diagonal ``o`` (query's key block minus key block).
        pooled: ``[B, Hq, C_B]`` the pattern test's estimate ``softmax(mean(q_last) . mean_block(k) / sqrt(D))``.
        divergence: ``[B, Hq]`` ``sqrt(JSD(pooled, vertical))`` (natural log; at most ``sqrt(ln 2)``).
        query_aware: bool ``[B, Hq]`` heads with ``divergence < tau``.
        block_mass: ``[B, Hq, C_Q, C_B]`` query-aware estimate: per query block (those holding the queries), the
            softmax of its mean query against the mean keys of its causal key blocks (rows sum to 1, non-causal 0).
    """

    vertical: torch.Tensor
    slash: torch.Tensor
    pooled: torch.Tensor
    divergence: torch.Tensor
    query_aware: torch.Tensor
    block_mass: torch.Tensor


def js_distance(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Square root of the Jensen-Shannon divergence (nats) of distributions along the last dim."""
    m = (p + r) / 2
    js = 0.5 * (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)
                + torch.special.xlogy(r, r) - torch.special.xlogy(r, m)).sum(dim=-1)
    return js.clamp_min(0).sqrt()


def band_blocks(bands: torch.Tensor, seq_len: int, block_size: int, q_start: int = 0) -> torch.Tensor:
    """Block table of selected block diagonals: query block ``qb`` attends key block ``j`` when a key block ``kb``
    holding some of its tokens has ``kb - j`` in ``bands``.

    Args:
        bands: bool ``[B, Hq, C_B]``, band ``o`` = key-block offset between a query's block and a key's block.

    Returns:
        bool ``[B, Hq, C_Q, C_B]`` over the query blocks holding the queries ``q_start .. seq_len - 1`` (causal:
        ``o >= 0``).
    """
    num_blocks, per_qblock = bands.shape[-1], Q_BLOCK_SIZE // block_size
    qb = query_blocks(seq_len, q_start, bands.device)
    own = qb[:, None] * per_qblock + torch.arange(per_qblock, device=bands.device)            # [C_Q, r]
    offset = own[..., None] - torch.arange(num_blocks, device=bands.device)                 # [C_Q, r, C_B]
    valid = (offset >= 0) & (own < num_blocks)[..., None]
    return (bands[..., offset.clamp(0, num_blocks - 1)] & valid).any(dim=-2)


@dataclass(frozen=True)
class FlexPrefill(PrefillPolicy):
    """FlexPrefill on the shared kernel: per head and input, a *query-aware* or a *vertical-slash* pattern.

    From the last query block (the last 128 queries; `FlexPrefillEstimate`): the true attention per key block and
    per block diagonal, and a pooled estimate from mean query and mean keys. Where the square-rooted Jensen-Shannon
    divergence between estimate and truth is below ``tau`` (query-aware sparse pattern determination), the pooled
    estimate is trusted and the head is query-aware: it keeps the fewest (query block, key block) pairs of
    ``block_mass`` whose mass, with the blocks every policy keeps, reaches ``gamma`` of the head's total
    (cumulative-attention index selection, over the whole flattened table). Otherwise it is vertical-slash: the fewest
    key-block columns and the fewest block diagonals each reaching ``gamma`` of the last block's attention (the same
    selection on the vertical and slash sums; sink blocks and the main diagonal, always kept, count first).
    Every head also keeps the top ``ceil(min_budget / L_B)`` columns and diagonals (at least ``min_budget`` tokens
    of each, as the released code does).

    Differences from the released code, all at block granularity: selection counts blocks by their pooled mass
    (the code counts tokens covering ``gamma`` then keeps that many blocks); diagonals are block offsets (a token
    diagonal crosses two); the shared ``fixed_blocks`` (own segment, sinks, local, dense segments) are kept.

    Knobs: ``gamma`` (0.9; 1.0 keeps every causal block), ``tau`` (0.1), ``min_budget`` (tokens; None: the shared
    ``config.base_budget``, 2048 by default, which is how an evaluation's prefill budget reaches this policy; the
    paper ran Llama with 1024).
    """

    name = "flexprefill"
    paper = "FlexPrefill (Lai et al., ICLR 2025)"
    keeps = ("own segment, sink/local blocks; per head query-aware pairs or vertical + slash blocks, the fewest "
             "reaching gamma of the estimated mass, at least min_budget tokens")
    per_head = True

    gamma: float = 0.9
    tau: float = 0.1
    min_budget: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("FlexPrefill", "gamma", self.gamma, 0.0, 1.0)
        check_number("FlexPrefill", "tau", self.tau, 0.0)
        if self.min_budget is not None:
            check_int("FlexPrefill", "min_budget", self.min_budget, 0)

    @property
    def min_tokens(self) -> int:
        """``min_budget``, or ``config.base_budget`` when None (tokens)."""
        return int(self.config.base_budget) if self.min_budget is None else self.min_budget

    def estimate(self, q: torch.Tensor, k: torch.Tensor) -> FlexPrefillEstimate:
        """`FlexPrefillEstimate` of ``q [B, Hq, M, D]``, the last ``M`` positions of ``k [B, Hkv, N, D]``: a chunk's
        pattern test reads the chunk's own last queries (what a chunked prefill has; the prompt's last chunk reads
        the prompt's). Memory ``O(B Hq (128 N + C_Q C_B))`` (the last block's attention ``[B, Hq, 128, N]``, 2 GiB at
        128k with 32 heads); nothing ``N x N``."""
        m, n, block = q.shape[-2], k.shape[-2], self.config.block_size
        group, dtype = q.shape[1] // k.shape[1], compute_dtype(q.dtype)
        count = min(Q_BLOCK_SIZE, m)
        per_block = block_sums(last_queries_attention(q, k, count), block)                # [B, Hq, count, C_B]
        num_blocks = per_block.shape[-1]
        vertical = per_block.mean(dim=-2)
        own = torch.arange(n - count, n, device=q.device) // block
        key_block = own[:, None] - torch.arange(num_blocks, device=q.device)              # [count, band]
        bands = per_block.gather(-1, key_block.clamp_min(0).expand_as(per_block))
        slash = bands.masked_fill(key_block < 0, 0.0).mean(dim=-2)
        keys = rearrange(block_means(k, block), "b h c d -> b h 1 c d")                    # [B, Hkv, 1, C_B, D]
        last = rearrange(q[..., m - count:, :].to(dtype).mean(dim=-2), "b (h g) d -> b h g 1 d", g=group)
        pooled = torch.softmax((last * keys).sum(-1) / math.sqrt(q.shape[-1]), dim=-1).flatten(1, 2)
        divergence = js_distance(pooled, vertical)
        rows = pad_rows(q, (n - m) % Q_BLOCK_SIZE)             # from the first row's start: the query grid
        queries = rearrange(block_means(rows, Q_BLOCK_SIZE), "b (h g) c d -> b h g c d", g=group)
        logits = torch.einsum("bhgcd,bhjd->bhgcj", queries, keys[:, :, 0]).flatten(1, 2) / math.sqrt(q.shape[-1])
        causal = causal_blocks(n, block, q.device, q_start=n - m)
        block_mass = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1).masked_fill(~causal, 0.0)
        return FlexPrefillEstimate(vertical, slash, pooled, divergence, divergence < self.tau, block_mass)

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor, compiled: bool | None = None) -> SparsePlan:
        """Per head the query-aware pairs or the vertical-slash blocks (plus the minimum columns and diagonals),
        composed with the shared fixed blocks by `query_block_table`. A chunk's rows: its own estimate (`estimate`),
        and a query-aware head's pairs chosen among the chunk's rows (the cumulative selection is over the pairs
        planned), so they are the whole prompt's rows only for the prompt's last chunk's vertical-slash heads."""
        n, block, q_start = k.shape[-2], self.config.block_size, k.shape[-2] - q.shape[-2]
        est = self.estimate(q, k)
        num_blocks = est.vertical.shape[-1]
        j = torch.arange(num_blocks, device=q.device)
        sinks, diagonal, every = j < self.config.sink_blocks, j == 0, torch.ones_like(j, dtype=torch.bool)
        least = torch.full(est.vertical.shape[:-1], min(-(-self.min_tokens // block), num_blocks), device=q.device)
        vertical_slash = ~est.query_aware[..., None]
        columns = top_k_mask(est.vertical, every, least) | (
            mass_cover(est.vertical, ~sinks, sinks, self.gamma) & vertical_slash)
        bands = top_k_mask(est.slash, every, least) | (
            mass_cover(est.slash, ~diagonal, diagonal, self.gamma) & vertical_slash)
        fixed = fixed_blocks(n, self.config, q.device, q_start=q_start)
        free = causal_blocks(n, block, q.device, q_start=q_start) & ~fixed
        pairs = mass_cover(est.block_mass.flatten(-2), free.flatten(), fixed.flatten(), self.gamma)
        query_aware = pairs.view_as(est.block_mass) & est.query_aware[..., None, None]
        selected = columns[..., None, :] | band_blocks(bands, n, block, q_start) | query_aware
        return SparsePlan(query_block_table(selected, self.config, n, q_start), n, block, q_start=q_start)
