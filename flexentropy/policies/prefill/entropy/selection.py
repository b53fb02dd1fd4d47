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

from flexentropy._compile import compiled, keep_dynamic
from flexentropy.config import MASS_OBSERVATIONS, Q_BLOCK_SIZE, EntropyConfig, coverage_at
from flexentropy.policies.prefill.entropy.budgets import MAX_SEGMENTS, fluctuation_budgets
from flexentropy.policies.prefill.entropy.entropies import rigid_heads, segment_entropy
from flexentropy.policies.prefill.entropy.observation import _observation
from flexentropy.policies.prefill.fixed import Span, block_table, segment_candidates
from flexentropy.policies.prefill.ranking import mass_cover
from flexentropy.sparse.kernel import compiled_region, pad_rows
from flexentropy.sparse.plan import SparsePlan, query_blocks


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
    free, forced = segment_candidates(a_obs, config, first_segment)
    total = 1.0 if config.observation in MASS_OBSERVATIONS else None   # a probe row's rest: on its own segment
    count = mass_cover(a_obs, free, forced, _coverage(a_obs, config), total).sum(dim=-1)
    return (count.clamp_min(1) * config.block_size).float()


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


def plan_blocks(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, *, compiled: bool | None = None
                ) -> SparsePlan:
    """The sparse plan of `select_blocks` for a layer that goes sparse, on arguments already checked (by the front
    doors of `flexentropy.policies.base.PrefillPolicy`). ``q [B, Hq, M, D]`` holds the
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
