"""Per-head top-k block selection into a `SparsePlan` (paper sec. 4.2, design.md §1.5), of a whole prompt or of a
chunk of its queries (design.md §1.7).

Pipeline: `observation_attention` -> `segment_entropy` -> `allocate_budgets` -> `block_table` -> `SparsePlan`.
All of it is tensor code: no loop over heads or segments, no host sync. Positions are absolute: segments, key blocks
and the plan's rows (query blocks of 128) lie on the grid from position 0, whatever chunk of queries is planned.
"""

from __future__ import annotations

import warnings

import torch
import torch._inductor.exc

from flexentropy._checks import check_bool, check_layer_idx, check_qk
from flexentropy._compile import compiled, keep_dynamic
from flexentropy.config import MASS_OBSERVATIONS, Q_BLOCK_SIZE, EntropyConfig, check_config, coverage_at
from flexentropy.prefill.budgets import MAX_SEGMENTS, fluctuation_budgets
from flexentropy.prefill.entropies import rigid_heads, segment_entropy
from flexentropy.prefill.observation import _observation, candidate_blocks, chunk_segments
from flexentropy.sparse.kernel import compiled_region, pad_rows
from flexentropy.sparse.plan import SparsePlan, causal_blocks, causal_rows, query_blocks

Span = int | torch.Tensor
"""A position or a length: a Python int, or (in a compiled graph, where an int would be a guard) a 0-d tensor."""


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


def _descending_rank(scores: torch.Tensor, eligible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rank, ordered)``: each entry's place in its row sorted by descending score, eligible entries first and
    ties to the lower index, and the sorted scores (``-1`` for ineligible entries). ``scores`` non-negative."""
    ranked = scores.masked_fill(~eligible, -1.0)
    ordered, order = torch.sort(ranked, dim=-1, descending=True, stable=True)
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions), ordered


def top_k_mask(scores: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The ``k[...]`` highest ``scores`` among ``eligible`` entries of each row, ties to the lower index.

    Args:
        scores: ``[..., C]`` non-negative. eligible: bool broadcastable to ``scores``.
        k: int ``[...]``, at most the number of eligible entries per row (rows may differ).

    Returns:
        bool ``[..., C]``.
    """
    rank, _ = _descending_rank(scores, eligible.expand_as(scores))
    return rank < k[..., None]


def mass_cover(scores: torch.Tensor, free: torch.Tensor, forced: torch.Tensor, fraction: float | torch.Tensor,
               total: float | None = None) -> torch.Tensor:
    """The smallest set of ``free`` entries of each row that, added to the ``forced`` ones, holds at least
    ``fraction`` of the row's mass: free entries best first (ties to the lower index) until the kept mass reaches
    ``fraction * sum(row)`` (FlexPrefill's and XAttention's "cumulative attention reaches gamma / threshold").
    With ``total``, the row is part of a whole of that mass whose rest (``total - sum(row)``) is kept anyway: the
    kept mass, that rest included, must reach ``fraction * total``.

    ``fraction >= 1`` keeps every free entry (exactly, whatever the rounding of the sums).

    Args:
        scores: ``[..., C]`` non-negative estimated mass, 0 outside the row's support (its sum is the total).
        free: bool ``[..., C]`` (broadcastable) entries that may be chosen.
        forced: bool ``[..., C]`` (broadcastable) entries kept anyway, disjoint from ``free``; their mass counts.
        fraction: in ``[0, 1]``: a float, or a tensor broadcastable to the rows.

    Returns:
        bool ``[..., C]``: the chosen free entries (forced ones not included).
    """
    free = free.expand_as(scores)
    rank, ordered = _descending_rank(scores, free)
    if not isinstance(fraction, torch.Tensor) and fraction >= 1:
        count = free.sum(dim=-1)
    else:
        row = scores.sum(dim=-1)
        whole = row if total is None else torch.full_like(row, total)
        need = fraction * whole - (whole - row) - (scores * forced).sum(dim=-1)
        mass = ordered.clamp_min(0)
        before = torch.cumsum(mass, dim=-1) - mass                  # mass of the better free entries
        count = ((before < need[..., None]) & (ordered >= 0)).sum(dim=-1)
        if isinstance(fraction, torch.Tensor):
            count = torch.where(fraction >= 1, free.sum(dim=-1), count)
    return rank < count[..., None]


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


def query_block_table(selected: torch.Tensor, config: EntropyConfig, seq_len: int) -> torch.Tensor:
    """Block table ``[B, Hq, C_Q, C_B]`` of a policy that selects per query block: its ``selected`` blocks (bool
    ``[B, Hq, C_Q, C_B]``, trimmed to the causal ones) plus the `fixed_blocks` every policy shares."""
    causal = causal_blocks(seq_len, config.block_size, selected.device)
    return (selected & causal) | fixed_blocks(seq_len, config, selected.device)


def _free_and_forced(a_obs: torch.Tensor, config: EntropyConfig,
                     first_segment: Span = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(free, forced)`` bool ``[C_S, C_B]``: the candidates a segment may choose, and those it keeps anyway, for
    the segments of ``a_obs [..., C_S, C_B]`` (those from ``first_segment``)."""
    num_segments, num_blocks = a_obs.shape[-2:]
    per_segment = config.segment_size // config.block_size
    segments = chunk_segments(num_segments, first_segment, a_obs.device)
    candidates = candidate_blocks(segments, num_blocks, config.segment_size, config.block_size)
    forced = forced_blocks(candidates, segments, config.sink_blocks, config.local_blocks, per_segment)
    return candidates & ~forced, forced


def _coverage(a_obs: torch.Tensor, config: EntropyConfig) -> float | torch.Tensor:
    """`coverage_at` for the prompt of ``a_obs [..., C_B]`` (``C_B * L_B`` tokens): a float, or for a
    ``(short, long)`` pair a 0-d tensor (float32, or ``a_obs``'s wider dtype) of the length counted on the device."""
    if not isinstance(config.coverage, tuple):
        return config.coverage
    dtype = torch.promote_types(a_obs.dtype, torch.float32)
    return coverage_at(config.coverage, a_obs.new_ones(a_obs.shape[-1], dtype=dtype).sum() * config.block_size)


def coverage_budgets(a_obs: torch.Tensor, config: EntropyConfig, first_segment: Span = 0) -> torch.Tensor:
    """Token budget of every (batch, query head, segment) under ``budget_rule="coverage"`` (design.md §1.4b).

    ``B[s] = L_B * max(1, |fewest free candidates holding coverage of row s's mass|)``, the coverage
    `coverage_at` the prompt's length (`mass_cover` of
    ``A_obs``, the forced blocks' mass counting; for the ``"probe"`` observation the row is part of the probes' whole
    attention, whose rest, on the segment's own keys, counts as kept). No ``B_0`` and no cap: a peaked row (low
    entropy) gets one block, a spread one (high entropy) as many as its mass needs.

    Args:
        a_obs: ``[B, Hq, C_S, C_B]`` from `observation_attention`, of the segments from ``first_segment`` (a
            chunk's; its coverage is taken at its key length, the prompt so far).

    Returns:
        float32 ``[B, Hq, C_S]`` budgets in tokens.
    """
    free, forced = _free_and_forced(a_obs, config, first_segment)
    total = 1.0 if config.observation in MASS_OBSERVATIONS else None   # a probe row's rest: on its own segment
    count = mass_cover(a_obs, free, forced, _coverage(a_obs, config), total).sum(dim=-1)
    return (count.clamp_min(1) * config.block_size).float()


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
    free, _ = _free_and_forced(a_obs, config, first_segment)
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


def _select(a_obs: torch.Tensor, config: EntropyConfig, rows: torch.Tensor, q_start: Span,
            seq_len: Span) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(blocks, budgets, entropy)`` from a layer's observation: entropy, budgets and the top-k, for the query blocks
    ``rows`` (of the segments of ``a_obs``) of the queries ``q_start .. seq_len - 1``."""
    entropy = segment_entropy(a_obs, normalise=config.observation in MASS_OBSERVATIONS)
    first_segment = rows[0] * Q_BLOCK_SIZE // config.segment_size
    coverage = config.budget_rule == "coverage"
    budgets = coverage_budgets(a_obs, config, first_segment) if coverage else fluctuation_budgets(entropy, config)
    return block_table(a_obs, budgets, config, seq_len, q_start=q_start, rows=rows), budgets, entropy


def _observe(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, compiled: bool = False) -> torch.Tensor:
    kernel = config.probe_kernel and not q.is_meta   # meta tensors (shapes without data): flex has no meta form
    if kernel is None:   # auto: the kernel builds its BlockMask eagerly, so not inside an enclosing compiled graph
        kernel = q.is_cuda and not torch.compiler.is_compiling()
    return _observation(q, k, config.segment_size, config.block_size, config.observation, config.observation_scale,
                        config.probes, kernel=kernel, compiled=compiled)


def _plan_tensors(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, rows: torch.Tensor, q_start: Span,
                  seq_len: Span) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(blocks, budgets, entropy)`` of a sparse layer: Alg. 1-3 and the top-k, as one graph. ``q`` and ``rows``
    from a segment's start (`_run_plan_tensors`)."""
    return _select(_observe(q, k, config), config, rows, q_start, seq_len)


_compiled_plan_tensors = compiled(_plan_tensors, dynamic=True, fullgraph=True)
_compiled_select = compiled(_select, dynamic=True, fullgraph=True)
_compile_failed: list[str] = []
"""Set when the compiled selection failed to build here: later calls run the (identical) eager selection."""


def selection_start(q_start: int, seq_len: int, segment_size: int) -> int:
    """Position from which the selection plans the queries ``q_start .. seq_len - 1``: the start of the segment
    holding ``q_start``, or of the one before when the queries lie in one segment (a compiled graph would specialise
    a segment axis of size 1). The rows and segments before ``q_start``'s are dense, and dropped from the plan."""
    first = q_start // segment_size
    if first > 0 and -(-seq_len // segment_size) - first == 1:
        first -= 1
    return first * segment_size


def _run_plan_tensors(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, rows: torch.Tensor, q_start: int,
                      compiled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_plan_tensors`, eager or compiled; compiled, the chunk's start and length enter as 0-d tensors (no guard on
    them)."""
    seq_len = k.shape[-2]
    if not compiled or _compile_failed:
        return _plan_tensors(q, k, config, rows, q_start, seq_len)
    span = [torch.full((), value, dtype=torch.int64, device=q.device) for value in (q_start, seq_len)]   # fills
    keep_dynamic(rows, dims=(0,))
    try:
        with compiled_region():
            if config.observation in MASS_OBSERVATIONS:     # a loop over chunks of probe rows
                a_obs = _observe(q, k, config, compiled=True)
                keep_dynamic(a_obs, dims=(-2, -1))          # C_S, C_B of [B, Hq, C_S, C_B]
                return _compiled_select(a_obs, config, rows, *span)
            return _compiled_plan_tensors(q, k, config, rows, *span)
    except (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.Unsupported,
            torch._inductor.exc.InductorError) as err:
        _compile_failed.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        warnings.warn(f"flexentropy: compiling block selection failed ({_compile_failed[0]}); selecting eagerly "
                      "from now on (same result, more kernel launches)", RuntimeWarning, stacklevel=3)
        return _plan_tensors(q, k, config, rows, q_start, seq_len)


def select_blocks(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, layer_idx: int = 1, *,
                  compiled: bool | None = None, q_start: int = 0) -> SparsePlan:
    """Entropy-guided sparse plan for one layer (paper Alg. 1-3, design.md §1.1-1.5), of a whole prompt or of a
    chunk of its queries (chunked prefill, design.md §1.7).

    A chunk's segments and key blocks stay on the grid from position 0. A segment the chunk holds only part of at
    its start runs dense (its probes are in the previous chunk), and with ``dense_last_segment`` so do the
    segments holding the chunk's last ``segment_size`` tokens; the coverage is taken at the key length
    ``q_start + M``. Every other segment's observation uses its own queries (all in the chunk) and the keys before
    them, so it is the whole prompt's.

    Args:
        q: ``[B, Hq, M, D]`` post-RoPE queries of the positions ``q_start .. q_start + M - 1`` (a whole prompt:
            ``q_start=0``, ``M = N``). k: ``[B, Hkv, q_start + M, D]`` post-RoPE keys of the positions
            ``0 .. q_start + M - 1``.
        config: knobs (segment/block sizes, budgets, dense fallbacks). A chunk (``q_start > 0``) needs
            ``budget_rule="coverage"`` (the default; ``"fluctuation"`` raises ``ValueError``).
        layer_idx: layers in ``config.dense_layers`` get a dense plan; so do ``q_start + M <= dense_prefix`` keys.
        compiled: run selection as one compiled graph (default: on CUDA, where it fuses ~100 small kernels;
            eager on CPU); a new ``q_start`` or length reuses it. If that graph fails to compile, a warning is given
            and selection runs eagerly.
        q_start: position of the first query, an int >= 0.

    Returns:
        `SparsePlan` with the block table (rows: the query blocks holding the queries), budgets, entropies and
        rigid-head flags.
    """
    check_qk(q, k, q_start=q_start)
    check_layer_idx(layer_idx)
    check_config(config)
    check_bool("select_blocks", "compiled", compiled, optional=True)
    if q.shape[-2] == 0 or config.is_dense_layer(layer_idx, k.shape[-2]):
        return dense_plan(q, config, q_start)
    return plan_blocks(q, k, config, compiled=compiled)


def plan_blocks(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, *, compiled: bool | None = None
                ) -> SparsePlan:
    """The sparse plan of `select_blocks` for a layer that goes sparse, on arguments already checked (the callers
    check them at their own entry: `sparse_prefill_attention`, `PrefillPolicy.plan`). ``q [B, Hq, M, D]`` holds the
    last M of the positions of ``k [B, Hkv, N, D]`` (``q_start = N - M``)."""
    n = k.shape[-2]
    if -(-n // config.segment_size) > MAX_SEGMENTS:
        raise ValueError(f"N={n} gives more than {MAX_SEGMENTS} segments of {config.segment_size}; "
                         "raise segment_size")
    q_start = n - q.shape[-2]
    start = selection_start(q_start, n, config.segment_size)     # planned from here, zero queries before q
    queries = pad_rows(q, q_start - start)                        # [B, Hq, N - start, D]
    rows = query_blocks(n, start, q.device)
    blocks, budgets, entropy = _run_plan_tensors(queries, k, config, rows, q_start,
                                                 q.is_cuda if compiled is None else compiled)
    if start < q_start:          # drop the rows and segments planned before the chunk's first query (all dense)
        blocks = blocks[..., q_start // Q_BLOCK_SIZE - start // Q_BLOCK_SIZE:, :].contiguous()
        skipped = q_start // config.segment_size - start // config.segment_size
        budgets, entropy = budgets[..., skipped:], entropy[..., skipped:]
    return SparsePlan(blocks, n, config.block_size, budgets=budgets, entropy=entropy,
                      rigid=rigid_heads(entropy, config.entropy_threshold), q_start=q_start)
