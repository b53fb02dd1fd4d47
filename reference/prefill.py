"""Dense reference oracle for entropy-guided sparse prefill (design.md §1, seed paper sec. 4.2, Alg. 1-3).

Written to be read against the paper and docs/design.md line by line, not to be fast: explicit Python loops over batch,
heads, segments and blocks, float64 by default, full ``N x N`` masks (small ``N`` only), no FlexAttention.
It shares nothing with ``flexentropy.policies.prefill`` except :class:`flexentropy.config.EntropyConfig`.

Notation (docs/design.md, notation): ``q`` is ``[B, Hq, N, D]``, ``k``/``v`` are ``[B, Hkv, N, D]``, ``G = Hq // Hkv``
and
query head ``h`` uses KV head ``h // G``. ``L_S`` segment size, ``L_B`` key-block size, ``C_S = ceil(N / L_S)``
segments, ``C_B = ceil(N / L_B)`` key blocks, ``C_Q = ceil(N / 128)`` query blocks; the last of each may be partial.
Positions are 0-based and causal: query ``i`` sees key ``j`` iff ``j <= i``.

A chunk of a prompt (chunked prefill, design.md §1.7): ``q`` is ``[B, Hq, M, D]``, the queries of the positions
``q_start .. q_start + M - 1``, against ``k``/``v`` ``[B, Hkv, q_start + M, D]``; segments, key blocks and query blocks
stay on the grid from position 0, and the plan covers the segments and query blocks that hold the chunk's queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexentropy.config import Q_BLOCK_SIZE, EntropyConfig, coverage_at

FLUCTUATION_EPS = 1e-9
"""The ``1e-9`` in design.md §1.4's ``r = |e[s] - e[s-1]| / (e[s-1] + 1e-9)``."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_qk(q: torch.Tensor, k: torch.Tensor, q_start: int = 0) -> int:
    """Validate ``q`` ``[B, Hq, M, D]`` against ``k`` ``[B, Hkv, q_start + M, D]``; return the GQA group size ``G``."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D [B, H, N, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if not isinstance(q_start, int) or q_start < 0:
        raise ValueError(f"q_start must be an int >= 0, got {q_start!r}")
    if q.shape[0] != k.shape[0] or q_start + q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} at q_start={q_start} and k {tuple(k.shape)} must agree on B, "
                         "q_start + M = N and D")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]}")
    return q.shape[1] // k.shape[1]


def candidate_blocks(segment: int, segment_size: int, block_size: int, num_blocks: int) -> list[int]:
    """Key blocks that are candidates of ``segment`` (design.md §1.2): those ending at or before its first token.

    Block ``j`` covers tokens ``[j * L_B, (j + 1) * L_B)``; it is a candidate iff ``(j + 1) * L_B <= s * L_S``.
    Segment 0 has none.
    """
    return [j for j in range(num_blocks) if (j + 1) * block_size <= segment * segment_size]


# --------------------------------------------------------------------------------------------------------------
# design.md §1.1 / paper Alg. 1: representatives
# --------------------------------------------------------------------------------------------------------------


def segment_representatives(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise max and min of ``x`` over each chunk of ``size`` tokens (paper Alg. 1, design.md §1.1).

    ``x`` is ``[B, H, N, D]``; chunk ``c`` holds tokens ``[c * size, min((c + 1) * size, N))`` (the last chunk
    may be partial). The max/min are taken per feature over the tokens (dim -2), not of a norm.
    Returns ``(xmax, xmin)``, each ``[B, H, ceil(N / size), D]`` in ``x``'s dtype (max/min are exact).
    """
    if size <= 0:
        raise ValueError(f"size must be > 0, got {size}")
    batch, heads, n, dim = x.shape
    num_chunks = _ceil_div(n, size)
    xmax = x.new_empty(batch, heads, num_chunks, dim)
    xmin = x.new_empty(batch, heads, num_chunks, dim)
    for c in range(num_chunks):
        chunk = x[:, :, c * size : min((c + 1) * size, n), :]  # Alg. 1: Q.reshape(N_S, L_S, d)[c]
        xmax[:, :, c, :] = chunk.amax(dim=-2)  # Alg. 1 line 3: .max(dim=1)
        xmin[:, :, c, :] = chunk.amin(dim=-2)  # Alg. 1 line 4: .min(dim=1)
    return xmax, xmin


# --------------------------------------------------------------------------------------------------------------
# design.md §1.2 / paper Alg. 2: observation attention
# --------------------------------------------------------------------------------------------------------------


def observation_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    segment_size: int,
    block_size: int,
    *,
    observation: str = "paper",
    scale: float = 1.0,
    probes: int = 16,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Observation attention ``A_obs`` ``[B, Hq, C_S, C_B]`` (paper Alg. 2, design.md §1.2), computed in ``dtype``.

    For query head ``h`` (KV head ``h // G``), segment ``s`` and candidate key block ``j``::

        S1 = Qmax[s].Kmax[j] * scale    S2 = Qmax[s].Kmin[j] * scale
        S3 = Qmin[s].Kmax[j] * scale    S4 = Qmin[s].Kmin[j] * scale

    ``observation="paper"`` (Alg. 2 lines 5-9): each ``S_i`` is soft-maxed over the candidates of ``s`` and
    ``A_obs = max((softmax(S1) + softmax(S2)) / 2, (softmax(S3) + softmax(S4)) / 2)``, not renormalised.
    ``observation="critiprefill"``: ``A_obs = softmax(max((S1 + S3) / 2, (S2 + S4) / 2))`` over the candidates.

    ``observation="probe"`` (design.md §1.2b) and ``"pooled"`` (§1.2c): :func:`probe_observation`.

    Candidates of ``s`` are the key blocks with ``(j + 1) * block_size <= s * segment_size``; every other entry
    (in particular the whole row of segment 0) is exactly 0.
    """
    if observation in ("probe", "pooled"):
        return probe_observation(q, k, segment_size, block_size, probes, scale, dtype, pooled=observation == "pooled")
    if observation not in ("paper", "critiprefill"):
        raise ValueError(f"observation must be 'paper', 'critiprefill', 'probe' or 'pooled', got {observation!r}")
    group = _check_qk(q, k)
    batch, q_heads, n, _ = q.shape
    num_segments = _ceil_div(n, segment_size)
    num_blocks = _ceil_div(n, block_size)

    # Alg. 1 for queries (per segment) and keys (per block), in the computation dtype.
    q_max, q_min = segment_representatives(q.to(dtype), segment_size)
    k_max, k_min = segment_representatives(k.to(dtype), block_size)

    a_obs = torch.zeros(batch, q_heads, num_segments, num_blocks, dtype=dtype, device=q.device)
    for b in range(batch):
        for h in range(q_heads):
            kv = h // group
            for s in range(num_segments):
                cand = candidate_blocks(s, segment_size, block_size, num_blocks)
                if not cand:
                    continue  # segment 0: no candidates, row stays all zeros
                idx = torch.tensor(cand, dtype=torch.long, device=q.device)
                kmax_c = k_max[b, kv, idx]  # [n_cand, D]
                kmin_c = k_min[b, kv, idx]
                s1 = (kmax_c @ q_max[b, h, s]) * scale  # Qmax . Kmax
                s2 = (kmin_c @ q_max[b, h, s]) * scale  # Qmax . Kmin
                s3 = (kmax_c @ q_min[b, h, s]) * scale  # Qmin . Kmax
                s4 = (kmin_c @ q_min[b, h, s]) * scale  # Qmin . Kmin
                if observation == "paper":
                    p1, p2 = torch.softmax(s1, dim=-1), torch.softmax(s2, dim=-1)  # Alg. 2 lines 5-6
                    p3, p4 = torch.softmax(s3, dim=-1), torch.softmax(s4, dim=-1)  # Alg. 2 lines 7-8
                    row = torch.maximum((p1 + p2) / 2, (p3 + p4) / 2)  # Alg. 2 line 9
                else:
                    row = torch.softmax(torch.maximum((s1 + s3) / 2, (s2 + s4) / 2), dim=-1)
                a_obs[b, h, s, idx] = row
    return a_obs


def probe_observation(q: torch.Tensor, k: torch.Tensor, segment_size: int, block_size: int, probes: int,
                      scale: float, dtype: torch.dtype = torch.float64, *, pooled: bool = False) -> torch.Tensor:
    """The ``"probe"`` observation ``[B, Hq, C_S, C_B]`` (design.md §1.2b), or with ``pooled`` the ``"pooled"`` one
    (§1.2c), computed in ``dtype``.

    Segment ``s`` has the probe queries ``i_p = min(s L_S + (p + 1) L_S / probes - 1, N - 1)``, ``p < probes``. Each
    probe's attention is the softmax of ``scale * q[i_p].k[t] / sqrt(D)`` over the keys ``t <= i_p``; ``A[s, j]`` is
    the mean over the probes of the probability mass on key block ``j``, for candidate blocks ``j``; 0 elsewhere.
    ``pooled``: the probe sees each key block ``j`` as ``n_j`` copies of the mean of the block's ``n_j`` keys up to
    ``i_p``.
    """
    group = _check_qk(q, k)
    batch, q_heads, n, dim = q.shape
    num_segments, num_blocks = _ceil_div(n, segment_size), _ceil_div(n, block_size)
    a_obs = torch.zeros(batch, q_heads, num_segments, num_blocks, dtype=dtype, device=q.device)
    for b in range(batch):
        for h in range(q_heads):
            keys = k[b, h // group].to(dtype)
            for s in range(num_segments):
                cand = candidate_blocks(s, segment_size, block_size, num_blocks)
                for p in range(probes):
                    i = min(s * segment_size + (p + 1) * (segment_size // probes) - 1, n - 1)
                    seen = keys[: i + 1]
                    if pooled:   # each key replaced by the mean of its block's keys that the probe sees
                        block_of = torch.arange(i + 1, device=q.device) // block_size
                        sums = torch.zeros(num_blocks, dim, dtype=dtype, device=q.device).index_add_(0, block_of, seen)
                        seen = (sums / torch.bincount(block_of, minlength=num_blocks).clamp_min(1)[:, None])[block_of]
                    weights = torch.softmax(seen @ q[b, h, i].to(dtype) * scale / math.sqrt(dim), dim=-1)
                    for j in cand:
                        a_obs[b, h, s, j] += weights[j * block_size:(j + 1) * block_size].sum() / probes
    return a_obs


# --------------------------------------------------------------------------------------------------------------
# design.md §1.3: entropy and head types
# --------------------------------------------------------------------------------------------------------------


def segment_entropy(a_obs: torch.Tensor, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Entropy of each observation row (paper sec. 4.2, design.md §1.3): ``e = -sum_j a_j ln a_j`` with ``0 ln 0 = 0``.

    ``a_obs`` is ``[B, Hq, C_S, C_B]`` (non-candidates are 0 and so contribute nothing); returns
    ``[B, Hq, C_S]`` in ``dtype``. Segment 0 (no candidates) has entropy 0.
    """
    a = a_obs.to(dtype)
    positive = a > 0
    safe = torch.where(positive, a, torch.ones_like(a))  # ln(1) = 0 stands in for the 0 * ln 0 = 0 convention
    terms = torch.where(positive, a * torch.log(safe), torch.zeros_like(a))
    return -terms.sum(dim=-1)


def rigid_heads(entropy: torch.Tensor, threshold: float) -> torch.Tensor:
    """Rigid-head flags ``[B, Hq]`` (paper Alg. 3 line 7, design.md §1.3): ``max_{s >= 1} e[s] < threshold``.

    Segment 0 is left out (it has no candidates, so its entropy is always 0). A head with a single segment has
    no ``s >= 1``; the max over the empty set is taken as ``-inf``, so it is rigid.
    """
    batch, heads, num_segments = entropy.shape
    rigid = torch.ones(batch, heads, dtype=torch.bool, device=entropy.device)
    for b in range(batch):
        for h in range(heads):
            if num_segments > 1:
                rigid[b, h] = bool(entropy[b, h, 1:].max().item() < threshold)
    return rigid


# --------------------------------------------------------------------------------------------------------------
# design.md §1.4 / paper Alg. 3: budgets
# --------------------------------------------------------------------------------------------------------------


def allocate_budgets(entropy: torch.Tensor, config: EntropyConfig) -> torch.Tensor:
    """Per-head, per-segment budgets in tokens ``[B, Hq, C_S]`` float64 (paper Alg. 3 as fixed by design.md §1.4).

    With ``B_0 = base_budget``, ``alpha = budget_alpha``, ``delta_t = fluctuation_threshold``:

    - rigid head (:func:`rigid_heads` with ``entropy_threshold``): ``B[s] = B_0`` for every ``s``;
    - dynamic head: ``B[0] = B[1] = B_0``; for ``s >= 2``, sequentially,
      ``r = |e[s] - e[s-1]| / (e[s-1] + 1e-9)`` (``fluctuation="abs"``) or
      ``r = clamp((e[s] - e[s-1]) / (e[s-1] + 1e-9), 0, 1 + delta_t)`` (``"signed"``), then
      ``B[s] = clamp(B[s-1] + alpha * B_0 * (r - delta_t), B_0, max_budget_factor * B_0)``.

    The arithmetic is Python float (IEEE double).
    """
    b0 = float(config.base_budget)
    alpha = float(config.budget_alpha)
    delta_t = float(config.fluctuation_threshold)
    low, high = b0, float(config.max_budget_factor) * b0

    e = entropy.to(torch.float64)
    batch, heads, num_segments = e.shape
    rigid = rigid_heads(e, config.entropy_threshold)
    budgets = torch.empty(batch, heads, num_segments, dtype=torch.float64, device=entropy.device)
    for b in range(batch):
        for h in range(heads):
            if rigid[b, h]:  # Alg. 3 lines 7-8
                budgets[b, h, :] = b0
                continue
            row = [b0] * num_segments  # Alg. 3 line 10; design.md §1.4: B[1] = B_0 too (e[0] carries no information)
            for s in range(2, num_segments):
                prev, cur = e[b, h, s - 1].item(), e[b, h, s].item()
                if config.fluctuation == "abs":
                    r = abs(cur - prev) / (prev + FLUCTUATION_EPS)
                else:  # "signed" (released code)
                    r = min(max((cur - prev) / (prev + FLUCTUATION_EPS), 0.0), 1.0 + delta_t)
                delta_budget = alpha * b0 * (r - delta_t)  # Alg. 3 line 12
                row[s] = min(max(row[s - 1] + delta_budget, low), high)  # lines 13-14, clamp fixed per design.md §1.4
            budgets[b, h, :] = torch.tensor(row, dtype=torch.float64)
    return budgets


def coverage_budgets(a_obs: torch.Tensor, config: EntropyConfig, q_start: int = 0) -> torch.Tensor:
    """Per-head, per-segment budgets in tokens ``[B, Hq, C_S]`` float64 under ``budget_rule="coverage"``
    (design.md §1.4b). The rows of ``a_obs`` are the segments from ``q_start // L_S`` (a chunk's, design.md §1.7).

    For segment ``s`` of head ``h``: the candidates (:func:`candidate_blocks`) split into forced ones (the first
    ``sink_blocks`` and the ``local_blocks`` before the segment) and the rest; the rest, best ``A_obs`` first (ties
    to the lower index), are taken one by one while the mass taken so far, forced blocks included, is below
    ``coverage`` times the row's total (all of them when ``coverage == 1``), ``coverage`` being `coverage_at` the
    prompt's length in whole key blocks (``C_B * L_B``). A ``"probe"`` row is part of the probes'
    whole attention (mass 1): the rest of it, on the segment's own keys, counts as taken and the target is
    ``coverage``. ``B[s]`` is ``L_B`` times their number, at least ``L_B``.
    """
    batch, heads, num_segments, num_blocks = a_obs.shape
    seg_size, blk_size = config.segment_size, config.block_size
    first_segment = q_start // seg_size
    coverage = coverage_at(config.coverage, num_blocks * blk_size)
    budgets = torch.empty(batch, heads, num_segments, dtype=torch.float64, device=a_obs.device)
    for b in range(batch):
        for h in range(heads):
            for row in range(num_segments):
                s = first_segment + row
                cand = candidate_blocks(s, seg_size, blk_size, num_blocks)
                first_block = s * seg_size // blk_size
                forced = [j for j in cand
                          if j < config.sink_blocks or first_block - config.local_blocks <= j < first_block]
                mass = a_obs[b, h, row].double()
                rest = sorted((j for j in cand if j not in forced), key=lambda j: (-mass[j].item(), j))
                total = 1.0 if config.observation in ("probe", "pooled") else mass.sum().item()
                taken = sum(mass[j].item() for j in forced) + total - mass.sum().item()
                count = 0
                for j in rest:
                    if coverage < 1 and taken >= coverage * total:
                        break
                    taken += mass[j].item()
                    count += 1
                budgets[b, h, row] = max(count, 1) * blk_size
    return budgets


# --------------------------------------------------------------------------------------------------------------
# design.md §1.5: selection
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ReferencePlan:
    """What :func:`select_blocks` decided for one layer.

    blocks: bool ``[B, Hq, C_Q, C_B]``; ``blocks[b, h, qb, j]`` is True when query block ``qb`` (tokens
        ``[qb * 128, (qb + 1) * 128)``) attends to any token of key block ``j``.
    dense_mask: bool ``[B, Hq, N, N]``; ``blocks`` expanded to tokens AND causal (``j <= i``).
    budgets: float64 ``[B, Hq, C_S]`` tokens, or None for a dense layer.
    entropy: ``[B, Hq, C_S]`` segment entropies, or None for a dense layer.
    a_obs: ``[B, Hq, C_S, C_B]`` observation attention, or None for a dense layer.
    density: computed blocks / causal blocks, over all ``(b, h, qb)`` (1.0 for a dense layer).
    """

    blocks: torch.Tensor
    dense_mask: torch.Tensor
    budgets: torch.Tensor | None
    entropy: torch.Tensor | None
    a_obs: torch.Tensor | None
    density: float


def dense_row(segment: int, n: int, config: EntropyConfig, q_start: int = 0) -> bool:
    """Whether segment ``segment`` of the queries ``q_start .. n - 1`` attends densely: it starts before
    ``dense_prefix``, or before ``q_start`` (a chunk holds only part of it), or ``dense_last_segment`` and it holds
    one of the last ``segment_size`` tokens (of the chunk: the plugin cannot know which chunk is the prompt's
    last)."""
    size = config.segment_size
    start = segment * size
    return (start < config.dense_prefix or start < q_start
            or (config.dense_last_segment and (segment + 1) * size > n - size))


def _last_key_block(query_block: int, n: int, block_size: int) -> int:
    """Index of the key block holding the last token of ``query_block`` (the block on its diagonal)."""
    last_token = min((query_block + 1) * Q_BLOCK_SIZE, n) - 1
    return last_token // block_size


def _causal_blocks(batch: int, heads: int, n: int, block_size: int, device: torch.device,
                   q_start: int = 0) -> torch.Tensor:
    """bool ``[B, H, C_Q, C_B]``: every key block holding at least one key visible to the query block, for the query
    blocks ``q_start // 128 .. ceil(n / 128) - 1`` (row ``r`` is query block ``q_start // 128 + r``)."""
    first_row = q_start // Q_BLOCK_SIZE
    blocks = torch.zeros(batch, heads, _ceil_div(n, Q_BLOCK_SIZE) - first_row, _ceil_div(n, block_size),
                         dtype=torch.bool, device=device)
    for row in range(blocks.shape[2]):
        blocks[:, :, row, : _last_key_block(first_row + row, n, block_size) + 1] = True
    return blocks


def blocks_to_dense_mask(blocks: torch.Tensor, n: int, block_size: int, q_start: int = 0) -> torch.Tensor:
    """Expand a ``[B, H, C_Q, C_B]`` block table (rows from query block ``q_start // 128``) to a token mask
    ``[B, H, n - q_start, n]`` AND causal ``j <= i`` (query ``i`` at position ``i``, ``q_start <= i < n``)."""
    device = blocks.device
    positions = torch.arange(q_start, n, device=device)
    row_of = positions // Q_BLOCK_SIZE - q_start // Q_BLOCK_SIZE  # query i -> its row
    key_block_of = torch.arange(n, device=device) // block_size  # key j -> its key block
    token_mask = blocks[:, :, row_of, :][:, :, :, key_block_of]
    causal = positions[:, None] >= torch.arange(n, device=device)[None, :]
    return token_mask & causal


def select_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    config: EntropyConfig,
    layer_idx: int | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    q_start: int = 0,
) -> ReferencePlan:
    """Key blocks each query block attends to (design.md §1.5), with the ``A_obs``/entropy/budgets behind them.

    Whole layer dense (every causal block; budgets/entropy/a_obs None) when ``layer_idx in config.dense_layers``
    (None: no layer given) or ``N <= config.dense_prefix``. Otherwise ``A_obs`` = :func:`observation_attention`
    (``config.observation``, ``config.observation_scale``, computed in ``dtype``), then :func:`segment_entropy` and
    the budgets (:func:`allocate_budgets`, or :func:`coverage_budgets` when ``budget_rule="coverage"``), and query block
    ``qb`` (in segment ``s = qb * 128 // L_S``) of head ``h`` attends to:

    - its own segment causally: key blocks from the segment's first block ``s * L_S // L_B`` up to the block
      holding the query block's last token (included; token-level causality trims it in ``dense_mask``);
    - if ``s`` is a dense row (`dense_row`): every candidate of ``s``;
    - otherwise the forced candidates (the first ``sink_blocks`` key blocks and the ``local_blocks`` blocks just
      before the segment, only those that are candidates) plus the top ``k[h, s]`` of the remaining candidates
      by ``A_obs[h, s]``, ties to the lower block index, where
      ``k[h, s] = min(floor(B[h, s] / L_B), number of non-forced candidates)``.

    A chunk (design.md §1.7: ``q [B, Hq, M, D]`` at positions ``q_start ..``, ``k`` of ``N = q_start + M`` keys): the
    same rule over the segments ``q_start // L_S ..`` and query blocks ``q_start // 128 ..`` that hold its queries,
    dense when ``N <= dense_prefix``, a segment starting before ``q_start`` a dense row, the coverage at ``N``. Its
    observation is the whole prompt's of the queries extended to position 0 with zero queries (only the partial first
    segment reads them, and it is dense). ``budget_rule="fluctuation"`` runs its recurrence
    from the chunk's first segment (``B = B_0`` for its first two).
    """
    _check_qk(q, k, q_start)
    batch, q_heads, _, dim = q.shape
    n = k.shape[2]
    seg_size, blk_size = config.segment_size, config.block_size
    first_segment, first_row = q_start // seg_size, q_start // Q_BLOCK_SIZE
    num_segments = _ceil_div(n, seg_size)
    num_blocks = _ceil_div(n, blk_size)
    num_qblocks = _ceil_div(n, Q_BLOCK_SIZE)

    causal_blocks = _causal_blocks(batch, q_heads, n, blk_size, q.device, q_start)
    if (layer_idx is not None and layer_idx in config.dense_layers) or n <= config.dense_prefix:
        return ReferencePlan(causal_blocks, blocks_to_dense_mask(causal_blocks, n, blk_size, q_start), None, None,
                             None, 1.0)
    coverage = config.budget_rule == "coverage"

    extended = torch.cat([q.new_zeros(batch, q_heads, q_start, dim), q], dim=2)  # zero queries before the chunk
    whole = observation_attention(extended, k, seg_size, blk_size, observation=config.observation,
                                  scale=config.observation_scale, probes=config.probes, dtype=dtype)
    a_obs = whole[:, :, first_segment:]
    mass_rows = config.observation in ("probe", "pooled")
    normalised = a_obs / a_obs.sum(dim=-1, keepdim=True).clamp_min(1e-30) if mass_rows else a_obs
    entropy = segment_entropy(normalised, dtype=dtype)
    budgets = coverage_budgets(a_obs, config, q_start) if coverage else allocate_budgets(entropy, config)

    blocks = torch.zeros_like(causal_blocks)
    for b in range(batch):
        for h in range(q_heads):
            # Earlier key blocks chosen for each segment (the part of the row that lies before the segment).
            chosen: dict[int, list[int]] = {}
            for s in range(first_segment, num_segments):
                cand = candidate_blocks(s, seg_size, blk_size, num_blocks)
                first_block = s * seg_size // blk_size
                if dense_row(s, n, config, q_start):
                    chosen[s] = list(cand)
                    continue
                forced = [j for j in cand
                          if j < config.sink_blocks or first_block - config.local_blocks <= j < first_block]
                rest = [j for j in cand if j not in forced]
                row = s - first_segment
                k_sel = min(math.floor(budgets[b, h, row].item() / blk_size), len(rest))
                ranked = sorted(rest, key=lambda j: (-a_obs[b, h, row, j].item(), j))  # ties: lower index first
                chosen[s] = forced + ranked[:k_sel]
            for qb in range(first_row, num_qblocks):
                s = qb * Q_BLOCK_SIZE // seg_size
                first_block = s * seg_size // blk_size
                own = list(range(first_block, _last_key_block(qb, n, blk_size) + 1))
                for j in chosen[s] + own:
                    blocks[b, h, qb - first_row, j] = True

    density = blocks.sum().item() / causal_blocks.sum().item()
    return ReferencePlan(blocks, blocks_to_dense_mask(blocks, n, blk_size, q_start), budgets, entropy, a_obs, density)


# --------------------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------------------


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``softmax(q k^T * scale)`` over the allowed keys, times ``v``; ``[B, Hq, M, Dv]`` in ``dtype``.

    ``q`` is ``[B, Hq, M, D]`` and ``k``/``v`` ``[B, Hkv, N, D]`` with ``M <= N`` (a chunk's queries are the last M
    positions); ``mask`` is bool ``[B, Hq, M, N]`` (True = query i may attend key j; broadcastable shapes are
    expanded). GQA: KV head ``h // G`` serves query head ``h`` (kv heads repeated ``G`` times). Rows with no allowed
    key output 0. ``scale`` defaults to ``1 / sqrt(D)``.
    """
    group = _check_qk(q, k, k.shape[2] - q.shape[2])
    batch, q_heads, n, dim = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    k_rep = k.to(dtype).repeat_interleave(group, dim=1)  # [B, Hq, N, D]: head h holds kv head h // G
    v_rep = v.to(dtype).repeat_interleave(group, dim=1)
    qd = q.to(dtype)
    mask = mask.to(torch.bool).expand(batch, q_heads, n, k.shape[2])

    out = torch.zeros(batch, q_heads, n, v.shape[-1], dtype=dtype, device=q.device)
    for b in range(batch):
        for h in range(q_heads):
            scores = (qd[b, h] @ k_rep[b, h].transpose(0, 1)) * scale  # [M, N]
            scores = scores.masked_fill(~mask[b, h], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            has_key = mask[b, h].any(dim=-1, keepdim=True)
            probs = torch.where(has_key, probs, torch.zeros_like(probs))  # all-masked rows: NaN -> 0
            out[b, h] = probs @ v_rep[b, h]
    return out


def sparse_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: EntropyConfig,
    layer_idx: int | None = None,
    dtype: torch.dtype = torch.float64,
    q_start: int = 0,
) -> torch.Tensor:
    """Entropy-guided sparse prefill attention (design.md §1): :func:`masked_attention` on ``select_blocks(...)``.

    Selection (observation attention, entropy, budgets, top-k) and attention are both computed in ``dtype``;
    the output is ``[B, Hq, M, Dv]`` in ``dtype`` with the default ``1 / sqrt(D)`` scale (``M = N`` for a whole
    prompt; a chunk's queries at ``q_start ..``, design.md §1.7).
    """
    plan = select_blocks(q, k, config, layer_idx, dtype=dtype, q_start=q_start)
    return masked_attention(q, k, v, plan.dense_mask, dtype=dtype)
