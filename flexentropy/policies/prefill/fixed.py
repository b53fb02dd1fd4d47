"""The blocks every prefill rule keeps, on the grid from position 0 (design.md §1.5, §1.7): the segments' candidate
and forced key blocks, the dense segments, each query block's fixed blocks, the table of a per-segment top-k, and the
plan of plain causal attention. Shared by every rule of `flexentropy.policies.PREFILL_POLICIES`; tensor code only (no
loop over heads or segments, no host sync). Positions are absolute: a chunk's rows and segments are the whole prompt's.
"""

from __future__ import annotations

import torch

from flexentropy.config import Q_BLOCK_SIZE, EntropyConfig
from flexentropy.policies.prefill.ranking import top_k_mask
from flexentropy.sparse.plan import SparsePlan, causal_blocks, causal_rows, query_blocks

Span = int | torch.Tensor
"""A position or a length: a Python int, or (in a compiled graph, where an int would be a guard) a 0-d tensor."""


def chunk_segments(num_segments: int, first_segment: int | torch.Tensor,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """Indices of the ``num_segments`` segments from ``first_segment`` (0: a whole prompt's): int64 ``[C_S]``.
    ``first_segment`` may be a 0-d tensor or a symbolic size (a compiled caller's)."""
    return torch.arange(num_segments, device=device) + first_segment


def candidate_blocks(segments: torch.Tensor, num_blocks: int, segment_size: int, block_size: int) -> torch.Tensor:
    """Key blocks each segment may select: those ending at or before the segment's first token.

    Args:
        segments: int64 ``[S]`` segment indices (`chunk_segments`, or any per-row indices).

    Returns:
        bool ``[S, C_B]``, True where ``(j + 1) * block_size <= s * segment_size``. Segment 0 has none.
    """
    j = torch.arange(num_blocks, device=segments.device)
    return (j[None, :] + 1) * block_size <= segments[:, None] * segment_size


def forced_blocks(candidates: torch.Tensor, segments: torch.Tensor, sink_blocks: int, local_blocks: int,
                  blocks_per_segment: int) -> torch.Tensor:
    """Candidates every segment keeps regardless of score: the first ``sink_blocks`` and the ``local_blocks``
    just before the segment. ``candidates`` bool ``[S, C_B]`` of the segments ``segments`` (int64 ``[S]``);
    bool ``[S, C_B]``."""
    j = torch.arange(candidates.shape[-1], device=candidates.device)
    local = j[None, :] >= (segments * blocks_per_segment - local_blocks)[:, None]
    return candidates & ((j < sink_blocks)[None, :] | local)


def segment_is_dense(segments: torch.Tensor, config: EntropyConfig, seq_len: Span, q_start: Span) -> torch.Tensor:
    """Which of the segments ``segments`` (int64 ``[S]``) attend to every earlier key, for the queries ``q_start ..
    seq_len - 1``: those starting before ``dense_prefix``; one that starts before ``q_start`` (a chunk holds only
    part of it, and its probes are in the previous chunk); when ``dense_last_segment``, those holding any of the last
    ``segment_size`` tokens (the last segment, and the one before it when the last is partial: a question that
    straddles a segment boundary stays dense; for a chunk, its own last tokens, since the last chunk's are the
    prompt's). bool ``[S]``."""
    size = config.segment_size
    start = segments * size
    dense = (start < config.dense_prefix) | (start < q_start)
    if config.dense_last_segment:
        dense = dense | (start + size > seq_len - size)
    return dense


def dense_segments(seq_len: int, config: EntropyConfig, device: torch.device | str | None = None, *,
                   q_start: int = 0) -> torch.Tensor:
    """`segment_is_dense` of the segments holding the queries ``q_start .. seq_len - 1`` (all of a whole prompt's).
    bool ``[C_S]``."""
    first = q_start // config.segment_size
    segments = chunk_segments(-(-seq_len // config.segment_size) - first, first, device)
    return segment_is_dense(segments, config, seq_len, q_start)


def fixed_rows(rows: torch.Tensor, config: EntropyConfig, seq_len: Span, q_start: Span,
               num_blocks: int) -> torch.Tensor:
    """`fixed_blocks` of the query blocks ``rows`` (int64 ``[C_Q]``, `query_blocks`) of the queries ``q_start ..
    seq_len - 1`` over ``num_blocks`` key blocks. bool ``[C_Q, C_B]``."""
    per_segment = config.segment_size // config.block_size
    segments = rows * Q_BLOCK_SIZE // config.segment_size                          # [C_Q] each row's segment
    candidates = candidate_blocks(segments, num_blocks, config.segment_size, config.block_size)
    forced = forced_blocks(candidates, segments, config.sink_blocks, config.local_blocks, per_segment)
    dense = segment_is_dense(segments, config, seq_len, q_start)
    causal = causal_rows(rows, seq_len, num_blocks, config.block_size)
    j = torch.arange(num_blocks, device=rows.device)
    own = (j[None, :] >= (segments * per_segment)[:, None]) & causal
    return forced | own | (dense[:, None] & causal)


def fixed_blocks(seq_len: int, config: EntropyConfig, device: torch.device | str | None = None, *,
                 q_start: int = 0) -> torch.Tensor:
    """Blocks every query block attends to whatever a policy selects (design.md §1.5): its own segment causally, the
    forced blocks of its segment (`forced_blocks`: sinks, ``local_blocks`` before it) and, in dense segments
    (`segment_is_dense`), every causal block; for the rows of the queries ``q_start .. seq_len - 1``.
    bool ``[C_Q, C_B]``."""
    rows = query_blocks(seq_len, q_start, device)
    return fixed_rows(rows, config, seq_len, q_start, -(-seq_len // config.block_size))


def query_block_table(selected: torch.Tensor, config: EntropyConfig, seq_len: int, q_start: int = 0) -> torch.Tensor:
    """Block table ``[B, Hq, C_Q, C_B]`` of a policy that selects per query block: its ``selected`` blocks (bool
    ``[B, Hq, C_Q, C_B]`` over the rows of the queries ``q_start .. seq_len - 1``, trimmed to the causal ones) plus
    the `fixed_blocks` every policy shares."""
    causal = causal_blocks(seq_len, config.block_size, selected.device, q_start=q_start)
    return (selected & causal) | fixed_blocks(seq_len, config, selected.device, q_start=q_start)


def segment_candidates(a_obs: torch.Tensor, config: EntropyConfig,
                     first_segment: Span = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(free, forced)`` bool ``[C_S, C_B]``: the candidates a segment may choose, and those it keeps anyway, for
    the segments of ``a_obs [..., C_S, C_B]`` (those from ``first_segment``)."""
    num_segments, num_blocks = a_obs.shape[-2:]
    per_segment = config.segment_size // config.block_size
    segments = chunk_segments(num_segments, first_segment, a_obs.device)
    candidates = candidate_blocks(segments, num_blocks, config.segment_size, config.block_size)
    forced = forced_blocks(candidates, segments, config.sink_blocks, config.local_blocks, per_segment)
    return candidates & ~forced, forced


def block_table(a_obs: torch.Tensor, budgets: torch.Tensor, config: EntropyConfig, seq_len: Span, *,
                q_start: Span = 0, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Block table ``[B, Hq, C_Q, C_B]`` from observation scores and token budgets (design.md §1.5), for the
    queries ``q_start .. seq_len - 1``.

    Segment s attends its `fixed_blocks` (own segment causally, forced blocks, every earlier block in a dense
    segment) and the top ``min(floor(B[s] / L_B), free candidates)`` other candidates by ``A_obs``. ``rows``: the
    query blocks of the table (default `query_blocks` of the queries); ``a_obs`` and ``budgets`` are those of their
    segments, from the first row's. A compiled caller passes them with ``seq_len`` and ``q_start`` as 0-d tensors.
    """
    if rows is None:
        rows = query_blocks(seq_len, q_start, a_obs.device)
    first_segment = rows[0] * Q_BLOCK_SIZE // config.segment_size
    free, _ = segment_candidates(a_obs, config, first_segment)
    count = torch.floor(budgets / config.block_size).clamp(0, a_obs.shape[-1])   # bounded before the int cast
    k = torch.minimum(count.long(), free.sum(dim=-1))
    chosen = top_k_mask(a_obs, free, k)                                        # [B, Hq, C_S, C_B]
    segment_of_row = rows * Q_BLOCK_SIZE // config.segment_size - first_segment
    return chosen[..., segment_of_row, :] | fixed_rows(rows, config, seq_len, q_start, a_obs.shape[-1])


def dense_plan(q: torch.Tensor, config: EntropyConfig, q_start: int = 0) -> SparsePlan:
    """The plan of plain causal attention (every causal block) of the queries ``q [B, Hq, M, D]`` at positions
    ``q_start ..``."""
    seq_len = q_start + q.shape[-2]
    causal = causal_blocks(seq_len, config.block_size, q.device, q_start=q_start)
    blocks = causal.expand(q.shape[0], q.shape[1], *causal.shape).contiguous()
    return SparsePlan(blocks, seq_len, config.block_size, dense=True, q_start=q_start)
