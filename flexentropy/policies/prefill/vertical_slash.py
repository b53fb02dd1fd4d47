"""``vertical_slash``: MInference's vertical-slash pattern run as the blocks that hold it (MInference 1.0, Jiang et
al., NeurIPS 2024, sec. 3: the vertical-slash head and its online index estimate)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexentropy._checks import check_int
from flexentropy.config import Q_BLOCK_SIZE
from flexentropy.policies.base import PrefillPolicy
from flexentropy.policies.prefill.estimates import block_sums, last_queries_attention
from flexentropy.policies.prefill.fixed import query_block_table
from flexentropy.policies.prefill.ranking import top_k_mask
from flexentropy.sparse.plan import SparsePlan, query_blocks

LAST_QUERIES = 64
"""Queries whose attention picks the pattern (MInference's ``last_q``)."""
SINK_COLUMNS = 30
"""Leading key columns always kept (ranked first), as MInference's kernel does."""
LOCAL_DIAGONALS = 100
"""Diagonals nearest the main one always kept (ranked first), as MInference's kernel does."""


def diagonal_sums(probs: torch.Tensor) -> torch.Tensor:
    """Sum of the last queries' attention along each diagonal: ``[B, H, n, N] -> [B, H, N]``, entry ``d`` the
    mass at token offset ``d = i - j`` (row ``r`` of ``probs`` is query ``N - n + r``)."""
    count, n = probs.shape[-2:]
    key = torch.arange(n - count, n, device=probs.device)[:, None] - torch.arange(n, device=probs.device)
    picked = probs.gather(-1, key.clamp_min(0).expand_as(probs))
    return picked.masked_fill(key < 0, 0.0).sum(dim=-2)


def pattern_blocks(columns: torch.Tensor, diagonals: torch.Tensor, block_size: int, q_start: int = 0) -> torch.Tensor:
    """Blocks holding a selected token pair: key block ``j`` of query block ``qb`` is kept when it holds a selected
    column, or when some causal pair in it lies on a selected diagonal (offsets ``i - j`` of the pair range over an
    interval, read from a running count of selected diagonals).

    Args:
        columns, diagonals: bool ``[B, H, N]`` (key columns; token offsets ``0 .. N-1``).

    Returns:
        bool ``[B, H, C_Q, C_B]`` over the query blocks holding the queries ``q_start .. N - 1``.
    """
    n = columns.shape[-1]
    device = columns.device
    kept_columns = block_sums(columns.int(), block_size) > 0                                 # [B, H, C_B]
    first_q = query_blocks(n, q_start, device) * Q_BLOCK_SIZE
    last_q = torch.clamp(first_q + Q_BLOCK_SIZE, max=n) - 1
    first_k = torch.arange(kept_columns.shape[-1], device=device) * block_size
    high = last_q[:, None] - first_k[None, :]                                               # largest offset
    low = torch.clamp(first_q[:, None] - (first_k[None, :] + block_size - 1), min=0)       # smallest
    running = torch.nn.functional.pad(torch.cumsum(diagonals.int(), dim=-1), (1, 0))       # [B, H, N + 1]
    flat = running.flatten(0, 1)
    hits = flat[:, (high.clamp_min(-1) + 1).flatten()] - flat[:, low.clamp(max=n).flatten()]
    on_diagonal = (hits.view(*columns.shape[:2], *high.shape) > 0) & (high >= 0)
    return kept_columns[..., None, :] | on_diagonal


@dataclass(frozen=True)
class VerticalSlash(PrefillPolicy):
    """From the attention of the last 64 queries, per head the top ``vertical`` key columns (attention summed over
    the queries) and the top ``slash`` diagonals (summed along each offset ``i - j``), the first 30 columns and the
    100 diagonals nearest the main one ranked first (MInference's kernel); run as the blocks holding them
    (`pattern_blocks`) with the shared fixed blocks. MInference picks the pattern per head offline; this policy runs
    the vertical-slash pattern in every head, with MInference's online index estimate.

    Knobs: ``vertical`` (1000) and ``slash`` (6096), MInference's setting for 128k prompts; counts of at least N
    keep every causal block. Unbudgeted: fixed counts, not ``config.base_budget``. docs/prefill.md says what the
    block granularity adds to the density.
    """

    name = "vertical_slash"
    paper = "MInference 1.0 (Jiang et al., NeurIPS 2024): vertical-slash"
    keeps = "own segment, sink/local blocks, blocks holding the top vertical columns and top slash diagonals"
    per_head = True

    vertical: int = 1000
    slash: int = 6096

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("VerticalSlash", "vertical", self.vertical, 0)
        check_int("VerticalSlash", "slash", self.slash, 0)

    def select_tokens(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(columns, diagonals)``, bool ``[B, Hq, N]`` each: the token-level pattern, from the last 64 of the queries
        ``q [B, Hq, M, D]``, the last ``M`` positions of ``k [B, Hkv, N, D]`` (a chunk's own). Memory
        ``O(B Hq 64 N)``."""
        n = k.shape[-2]
        probs = last_queries_attention(q, k, min(LAST_QUERIES, q.shape[-2]))
        index = torch.arange(n, device=q.device)
        vertical = probs.sum(dim=-2).masked_fill(index < SINK_COLUMNS, float("inf"))
        slash = diagonal_sums(probs).masked_fill(index < LOCAL_DIAGONALS, float("inf"))
        every = torch.ones_like(index, dtype=torch.bool)
        columns = top_k_mask(vertical, every, torch.full(vertical.shape[:-1], min(self.vertical, n), device=q.device))
        diagonals = top_k_mask(slash, every, torch.full(slash.shape[:-1], min(self.slash, n), device=q.device))
        return columns, diagonals

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor, compiled: bool | None = None) -> SparsePlan:
        """`select_tokens` -> `pattern_blocks` -> `query_block_table`. A chunk's pattern is read from its own last
        queries, so its rows are the whole prompt's for the prompt's last chunk (of at least 64 queries)."""
        n, q_start = k.shape[-2], k.shape[-2] - q.shape[-2]
        selected = pattern_blocks(*self.select_tokens(q, k), self.config.block_size, q_start)
        return SparsePlan(query_block_table(selected, self.config, n, q_start), n, self.config.block_size,
                          q_start=q_start)


def token_density(columns: torch.Tensor, diagonals: torch.Tensor) -> torch.Tensor:
    """Fraction of causal token pairs a token-granular vertical-slash pattern computes, per ``[B, H]``.

    Pairs on a selected column ``j`` (``N - j`` of them) plus pairs on a selected diagonal ``d`` (``N - d``), less
    those on both (for each column ``j``, the selected diagonals ``d <= N - 1 - j``). O(N) per head.
    """
    n = columns.shape[-1]
    index = torch.arange(n, device=columns.device, dtype=torch.float64)
    on_columns = (columns * (n - index)).sum(dim=-1)
    on_diagonals = (diagonals * (n - index)).sum(dim=-1)
    both = (columns * torch.cumsum(diagonals.double(), dim=-1).flip(-1)).sum(dim=-1)
    return (on_columns + on_diagonals - both) / (n * (n + 1) / 2)
