"""Per-head top-k block selection into a `SparsePlan` (paper sec. 4.2, design.md §1.5).

Pipeline: `observation_attention` -> `segment_entropy` -> `allocate_budgets` -> `block_table` -> `SparsePlan`.
All of it is tensor code: no loop over heads or segments, no host sync.
"""

from __future__ import annotations

import warnings

import torch
import torch._inductor.exc

from flexentropy._checks import check_layer_idx, check_qk
from flexentropy._compile import keep_dynamic, no_silent_fallback
from flexentropy.config import MASS_OBSERVATIONS, Q_BLOCK_SIZE, EntropyConfig, check_config, coverage_at
from flexentropy.prefill.budgets import MAX_SEGMENTS, fluctuation_budgets
from flexentropy.prefill.entropies import rigid_heads, segment_entropy
from flexentropy.prefill.observation import _observation, candidate_blocks
from flexentropy.sparse.plan import SparsePlan, causal_blocks


def forced_blocks(candidates: torch.Tensor, sink_blocks: int, local_blocks: int,
                  blocks_per_segment: int) -> torch.Tensor:
    """Candidates every segment keeps regardless of score: the first ``sink_blocks`` and the ``local_blocks``
    just before the segment. bool ``[C_S, C_B]``."""
    num_segments, num_blocks = candidates.shape
    s = torch.arange(num_segments, device=candidates.device)
    j = torch.arange(num_blocks, device=candidates.device)
    local = j[None, :] >= (s * blocks_per_segment - local_blocks)[:, None]
    return candidates & ((j < sink_blocks)[None, :] | local)


def dense_segments(seq_len: int, config: EntropyConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Segments that attend to every earlier key: those starting before ``dense_prefix`` and, when
    ``dense_last_segment``, those holding any of the last ``segment_size`` tokens (the last segment, and the one
    before it when the last is partial: a question that straddles a segment boundary stays dense). bool ``[C_S]``."""
    size = config.segment_size
    s = torch.arange(-(-seq_len // size), device=device)
    dense = s * size < config.dense_prefix
    if config.dense_last_segment:
        dense = dense | ((s + 1) * size > seq_len - size)
    return dense


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


def fixed_blocks(seq_len: int, config: EntropyConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Blocks every query block attends to whatever a policy selects (design.md §1.5): its own segment causally, the
    forced blocks of its segment (`forced_blocks`: sinks, ``local_blocks`` before it) and, in dense segments
    (`dense_segments`), every causal block. bool ``[C_Q, C_B]``."""
    num_segments, num_blocks = -(-seq_len // config.segment_size), -(-seq_len // config.block_size)
    per_segment = config.segment_size // config.block_size
    candidates = candidate_blocks(num_segments, num_blocks, config.segment_size, config.block_size, device)
    forced = forced_blocks(candidates, config.sink_blocks, config.local_blocks, per_segment)
    dense = dense_segments(seq_len, config, device)
    causal = causal_blocks(seq_len, config.block_size, device)
    segment_of_qb = torch.arange(causal.shape[0], device=device) * Q_BLOCK_SIZE // config.segment_size
    j = torch.arange(num_blocks, device=device)
    own = (j[None, :] >= (segment_of_qb * per_segment)[:, None]) & causal
    return forced[segment_of_qb] | own | (dense[segment_of_qb][:, None] & causal)


def query_block_table(selected: torch.Tensor, config: EntropyConfig, seq_len: int) -> torch.Tensor:
    """Block table ``[B, Hq, C_Q, C_B]`` of a policy that selects per query block: its ``selected`` blocks (bool
    ``[B, Hq, C_Q, C_B]``, trimmed to the causal ones) plus the `fixed_blocks` every policy shares."""
    causal = causal_blocks(seq_len, config.block_size, selected.device)
    return (selected & causal) | fixed_blocks(seq_len, config, selected.device)


def _free_and_forced(a_obs: torch.Tensor, config: EntropyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(free, forced)`` bool ``[C_S, C_B]``: the candidates a segment may choose, and those it keeps anyway."""
    num_segments, num_blocks = a_obs.shape[-2:]
    per_segment = config.segment_size // config.block_size
    candidates = candidate_blocks(num_segments, num_blocks, config.segment_size, config.block_size, a_obs.device)
    forced = forced_blocks(candidates, config.sink_blocks, config.local_blocks, per_segment)
    return candidates & ~forced, forced


def _coverage(a_obs: torch.Tensor, config: EntropyConfig) -> float | torch.Tensor:
    """`coverage_at` for the prompt of ``a_obs [..., C_B]`` (``C_B * L_B`` tokens): a float, or for a
    ``(short, long)`` pair a 0-d tensor (float32, or ``a_obs``'s wider dtype) of the length counted on the device."""
    if not isinstance(config.coverage, tuple):
        return config.coverage
    dtype = torch.promote_types(a_obs.dtype, torch.float32)
    return coverage_at(config.coverage, a_obs.new_ones(a_obs.shape[-1], dtype=dtype).sum() * config.block_size)


def coverage_budgets(a_obs: torch.Tensor, config: EntropyConfig) -> torch.Tensor:
    """Token budget of every (batch, query head, segment) under ``budget_rule="coverage"`` (design.md §1.4b).

    ``B[s] = L_B * max(1, |fewest free candidates holding coverage of row s's mass|)``, the coverage
    `coverage_at` the prompt's length (`mass_cover` of
    ``A_obs``, the forced blocks' mass counting; for the ``"probe"`` observation the row is part of the probes' whole
    attention, whose rest, on the segment's own keys, counts as kept). No ``B_0`` and no cap: a peaked row (low
    entropy) gets one block, a spread one (high entropy) as many as its mass needs.

    Args:
        a_obs: ``[B, Hq, C_S, C_B]`` from `observation_attention`.

    Returns:
        float32 ``[B, Hq, C_S]`` budgets in tokens.
    """
    free, forced = _free_and_forced(a_obs, config)
    total = 1.0 if config.observation in MASS_OBSERVATIONS else None   # a probe row's rest: on its own segment
    count = mass_cover(a_obs, free, forced, _coverage(a_obs, config), total).sum(dim=-1)
    return (count.clamp_min(1) * config.block_size).float()


def block_table(a_obs: torch.Tensor, budgets: torch.Tensor, config: EntropyConfig, seq_len: int) -> torch.Tensor:
    """Block table ``[B, Hq, C_Q, C_B]`` from observation scores and token budgets (design.md §1.5).

    Segment s attends its `fixed_blocks` (own segment causally, forced blocks, every earlier block in a dense
    segment) and the top ``min(floor(B[s] / L_B), free candidates)`` other candidates by ``A_obs``.
    """
    device = a_obs.device
    free, _ = _free_and_forced(a_obs, config)
    count = torch.floor(budgets / config.block_size).clamp(0, a_obs.shape[-1])   # bounded before the int cast
    k = torch.minimum(count.long(), free.sum(dim=-1))
    chosen = top_k_mask(a_obs, free, k)                                        # [B, Hq, C_S, C_B]
    segment_of_qb = torch.arange(-(-seq_len // Q_BLOCK_SIZE), device=device) * Q_BLOCK_SIZE // config.segment_size
    return chosen[..., segment_of_qb, :] | fixed_blocks(seq_len, config, device)


def dense_plan(q: torch.Tensor, config: EntropyConfig) -> SparsePlan:
    """The plan of plain causal attention (every causal block)."""
    n = q.shape[-2]
    causal = causal_blocks(n, config.block_size, q.device)
    blocks = causal.expand(q.shape[0], q.shape[1], *causal.shape).contiguous()
    return SparsePlan(blocks, n, config.block_size, dense=True)


def _select(a_obs: torch.Tensor, config: EntropyConfig,
            seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(blocks, budgets, entropy, rigid)`` from a layer's observation: entropy, budgets and the top-k."""
    entropy = segment_entropy(a_obs, normalise=config.observation in MASS_OBSERVATIONS)
    coverage = config.budget_rule == "coverage"
    budgets = coverage_budgets(a_obs, config) if coverage else fluctuation_budgets(entropy, config)
    blocks = block_table(a_obs, budgets, config, seq_len)
    return blocks, budgets, entropy, rigid_heads(entropy, config.entropy_threshold)


def _observe(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, compiled: bool = False) -> torch.Tensor:
    kernel = config.probe_kernel
    if kernel is None:   # auto: the kernel builds its BlockMask eagerly, so not inside an enclosing compiled graph
        kernel = q.is_cuda and not torch.compiler.is_compiling()
    return _observation(q, k, config.segment_size, config.block_size, config.observation, config.observation_scale,
                        config.probes, kernel=kernel, compiled=compiled)


def _plan_tensors(q: torch.Tensor, k: torch.Tensor,
                  config: EntropyConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(blocks, budgets, entropy, rigid)`` of a sparse layer: Alg. 1-3 and the top-k, as one graph."""
    return _select(_observe(q, k, config), config, q.shape[-2])


_compiled_plan_tensors = torch.compile(_plan_tensors, dynamic=True, fullgraph=True)
_compiled_select = torch.compile(_select, dynamic=True, fullgraph=True)
_compile_failed: list[str] = []
"""Set when the compiled selection failed to build here: later calls run the (identical) eager selection."""


def _run_plan_tensors(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig,
                      compiled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if not compiled or _compile_failed:
        return _plan_tensors(q, k, config)
    try:
        with no_silent_fallback():
            if config.observation in MASS_OBSERVATIONS:     # a loop over chunks of probe rows
                a_obs = _observe(q, k, config, compiled=True)
                keep_dynamic(a_obs, dims=(-2, -1))          # C_S, C_B of [B, Hq, C_S, C_B]
                return _compiled_select(a_obs, config, q.shape[-2])
            return _compiled_plan_tensors(q, k, config)
    except (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.Unsupported,
            torch._inductor.exc.InductorError) as err:
        _compile_failed.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        warnings.warn(f"flexentropy: compiling block selection failed ({_compile_failed[0]}); selecting eagerly "
                      "from now on (same result, more kernel launches)", RuntimeWarning, stacklevel=3)
        return _plan_tensors(q, k, config)


def select_blocks(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, layer_idx: int = 1, *,
                  compiled: bool | None = None) -> SparsePlan:
    """Entropy-guided sparse plan for one layer (paper Alg. 1-3, design.md §1.1-1.5).

    Args:
        q: ``[B, Hq, N, D]`` post-RoPE queries. k: ``[B, Hkv, N, D]`` post-RoPE keys.
        config: knobs (segment/block sizes, budgets, dense fallbacks).
        layer_idx: layers in ``config.dense_layers`` get a dense plan; so does ``N <= dense_prefix``.
        compiled: run selection as one compiled graph (default: on CUDA, where it fuses ~100 small kernels;
            eager on CPU). If that graph fails to compile, a warning is given and selection runs eagerly.

    Returns:
        `SparsePlan` with the block table, budgets, entropies and rigid-head flags.
    """
    check_qk(q, k)
    check_layer_idx(layer_idx)
    check_config(config)
    if config.is_dense_layer(layer_idx, q.shape[-2]):
        return dense_plan(q, config)
    return plan_blocks(q, k, config, compiled=compiled)


def plan_blocks(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, *, compiled: bool | None = None
                ) -> SparsePlan:
    """The sparse plan of `select_blocks` for a layer that goes sparse, on arguments already checked (the callers
    check them at their own entry: `sparse_prefill_attention`, `PrefillPolicy.plan`)."""
    n = q.shape[-2]
    if -(-n // config.segment_size) > MAX_SEGMENTS:
        raise ValueError(f"N={n} gives more than {MAX_SEGMENTS} segments of {config.segment_size}; "
                         "raise segment_size")
    blocks, budgets, entropy, rigid = _run_plan_tensors(q, k, config, q.is_cuda if compiled is None else compiled)
    return SparsePlan(blocks, n, config.block_size, budgets=budgets, entropy=entropy, rigid=rigid)
