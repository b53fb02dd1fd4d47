"""The entropy method's probe observation: the attention mass of each segment's probe queries on each key block
(design.md §1.2b, §1.2c), by three ways to it: the scored path (`probe_block_mass`), the pooled estimate
(`pooled_block_mass`) and the kernel (`probe_mass_kernel`).

Nothing here builds an ``N x N`` tensor: probe rows are scored in chunks. Computation runs in ``compute_dtype``
(float32, float64 for float64 inputs; `flexentropy.policies.prefill.estimates`).

The probe observations also serve a chunk of a prompt: given queries ``q [B, Hq, M, D]`` and keys ``k [B, Hkv, N, D]``
with ``M <= N``, the queries are those of the last M positions ``N - M .. N - 1``, and ``N - M`` is a multiple of the
segment size (the selection pads a chunk's queries to its first segment's start, design.md §1.7): the segments are
those holding the queries.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from flexentropy._compile import compiled, keep_dynamic
from flexentropy.config import Q_BLOCK_SIZE
from flexentropy.policies.prefill.estimates import causal_logits, compute_dtype
from flexentropy.sparse.kernel import compiled_region

PROBE_CHUNK_SCORES = 2**26
"""Most probe scores alive at once in the eager scored path, and block scores in `pooled_block_mass` (256 MiB in
float32): probe rows are scored in chunks."""

PROBE_CHUNK_SCORES_COMPILED = 2**28
"""The same for the compiled scored path, which reduces each block's scores in registers, so it can score larger
chunks (docs/performance.md)."""


def probe_positions(seq_len: int, segment_size: int, probes: int, device: torch.device | str | None = None, *,
                    q_start: int = 0) -> torch.Tensor:
    """The probe queries of every segment holding one of the positions ``q_start .. seq_len - 1``: ``probes`` evenly
    strided positions, each the last of its stride (``s L_S + (i + 1) L_S / probes - 1``), clamped to the last
    token. int64 ``[C_S, probes]``, from segment ``q_start // L_S``."""
    first = q_start // segment_size
    rows = torch.arange((-(-seq_len // segment_size) - first) * probes, device=device)
    return probe_row_position(rows, probes, segment_size, segment_size // probes, seq_len - 1, first).view(-1, probes)


def probe_rows_per_chunk(probes: int, limit: int, per_row: int) -> int:
    """Probe rows scored together: the probes of whole segments (a multiple of ``probes``, at least one segment's),
    as many as keep ``rows * per_row`` within ``limit``."""
    return max(probes, limit // per_row // probes * probes)


def segment_means(mass: torch.Tensor, probes: int) -> torch.Tensor:
    """Per-segment mean of the probe rows' block masses ``mass [B, Hq, R, C_B]``, rows of whole segments in order
    (`probe_positions` flattened): ``[B, Hq, R / probes, C_B]``. Each chunk of rows is reduced as it comes, so the
    rows of every probe are never held at once (at 1M tokens they would be ``probes`` times the result)."""
    return rearrange(mass, "b h (s p) c -> b h s p c", p=probes).mean(dim=-2)


def probe_row_position(row: torch.Tensor, probes: int | torch.Tensor, segment_size: int | torch.Tensor,
                       stride: int | torch.Tensor, last: int | torch.Tensor,
                       first_segment: int | torch.Tensor = 0) -> torch.Tensor:
    """Position of probe row ``row`` of `probe_positions` flattened (``c * probes + i``, segment ``s = first_segment
    + c``): ``s L_S + (i + 1) stride - 1``, at most ``last``. The sizes may be ints or 0-d tensors (a compiled
    ``mask_mod`` reads them from one)."""
    segment = first_segment + row // probes
    return torch.clamp(segment * segment_size + (row % probes + 1) * stride - 1, max=last)


def probe_block_mass(q: torch.Tensor, k: torch.Tensor, segment_size: int, block_size: int, probes: int,
                     scale: float = 1.0, *, kernel: bool = False, compiled: bool = False) -> torch.Tensor:
    """Mean causal attention mass of each segment's probe queries (`probe_positions`) on each key block.

    A probe's attention is the layer's own softmax over every key up to it, logits ``scale * q.k / sqrt(D)``
    (``scale = 1``: the model's attention); its mass is summed per key block and averaged over the segment's probes.
    Rows are not renormalised: a row sums to 1 over all blocks up to the segment's last probe (own segment included).
    Compute ``~N^2 D probes / (2 L_S)`` multiply-adds per head (``probes / L_S`` of dense ``QK^T``, half of it
    masked); no ``N x N`` tensor.

    Two ways to the same function: ``kernel=False`` (this function's default) scores probe rows in chunks of
    at most `PROBE_CHUNK_SCORES` scores (`PROBE_CHUNK_SCORES_COMPILED` compiled; `positions_attention`, logits in the
    input dtype, softmax and sums in `compute_dtype`, summed per block through each block's log-sum-exp;
    ``compiled=True`` scores each chunk in one compiled graph); ``kernel=True`` runs `probe_mass_kernel` (compiled
    ``flex_attention`` on CUDA, no score stored; faster than the compiled scored path on the GPU,
    docs/performance.md). Selection takes the kernel on CUDA by default (`EntropyConfig.probe_kernel`).

    Args:
        q: ``[B, Hq, M, D]`` the queries of the last M positions (M = N: a whole prompt; a chunk's from a segment
            start, module docstring). k: ``[B, Hkv, N, D]``. probes: a divisor of ``segment_size``.

    Returns:
        ``[B, Hq, C_S, C_B]`` in `compute_dtype`, the segments holding the queries.
    """
    if kernel:
        return probe_mass_kernel(q, k, segment_size, block_size, probes, scale, compiled=q.is_cuda)
    batch, q_heads = q.shape[:2]
    n = k.shape[-2]
    q_start = n - q.shape[-2]
    positions = probe_positions(n, segment_size, probes, q.device, q_start=q_start).flatten()   # [C_S * probes]
    num_blocks = -(-n // block_size)
    limit = PROBE_CHUNK_SCORES_COMPILED if compiled else PROBE_CHUNK_SCORES
    per_chunk = probe_rows_per_chunk(probes, limit, batch * q_heads * n)
    score = _compiled_scored_chunk if compiled else _scored_chunk
    masses = []
    with compiled_region() if compiled else contextlib.nullcontext():
        for start in range(0, positions.shape[0], per_chunk):   # chunks of whole segments (a few at 32k, batch 1)
            stop = min(start + per_chunk, positions.shape[0])
            keys_seen = min(n, q_start + stop // probes * segment_size)   # every key up to the chunk's last probe
            at = positions[start:stop]
            rows = at - q_start                                 # the probes' rows of q
            if compiled:
                at = at.clone()                                 # not a view: dynamo would guard its base's size
                keep_dynamic(at, rows, dims=(0,))
            mass = score(q, k[..., :keys_seen, :], at, rows, scale, block_size)
            masses.append(segment_means(F.pad(mass, (0, num_blocks - mass.shape[-1])), probes))
    return torch.cat(masses, dim=-2)


def pooled_block_mass(q: torch.Tensor, k: torch.Tensor, segment_size: int, block_size: int, probes: int,
                      scale: float = 1.0) -> torch.Tensor:
    """Estimate of `probe_block_mass` with one pooled key per block: the same probe queries (`probe_positions`), but
    a probe scores each key block it sees by the mean of the block's keys it sees, logit ``scale * q.mean_k /
    sqrt(D) + log(count)`` (the block's log-sum-exp if its keys' logits were equal; lower by Jensen's inequality
    otherwise), and its mass per block is the softmax over those logits, averaged over the segment's probes.

    Compute ``~N^2 D probes / (2 L_S L_B)`` multiply-adds per head (``L_B`` times less than `probe_block_mass`) and
    one pass over the keys; no ``N x N`` tensor: probe rows go in chunks of at most `PROBE_CHUNK_SCORES` block
    scores.

    Args:
        q: ``[B, Hq, M, D]`` the queries of the last M positions (as `probe_block_mass`). k: ``[B, Hkv, N, D]``.
            probes: a divisor of ``segment_size``.

    Returns:
        ``[B, Hq, C_S, C_B]`` in `compute_dtype`; a row sums to 1 over the blocks up to its segment's last probe.
    """
    batch, q_heads, _, dim = q.shape
    n = k.shape[-2]
    q_start = n - q.shape[-2]
    group, dtype = q_heads // k.shape[1], compute_dtype(q.dtype)
    num_blocks = -(-n // block_size)
    # every probe ends a run of `grain` keys: running sums of the runs within each block give a probe its own block's
    # keys up to it, and the block's whole sum; one pass over the keys, N / grain sums kept
    grain = math.gcd(segment_size // probes, block_size)
    padded = F.pad(k, (0, 0, 0, num_blocks * block_size - n)) if n % block_size else k
    within = rearrange(padded, "b h (c s t) d -> b h c s t d", s=block_size // grain, t=grain).sum(-2, dtype=dtype)
    within = within.cumsum(dim=-2)                                                        # [B, Hkv, C_B, L_B/grain, D]
    counts = torch.clamp(n - torch.arange(num_blocks, device=q.device) * block_size, max=block_size)
    means = within[..., -1, :] / counts[:, None].to(dtype)                                # [B, Hkv, C_B, D]
    within = within.flatten(2, 3)                                                         # [B, Hkv, C_B L_B/grain, D]
    positions = probe_positions(n, segment_size, probes, q.device, q_start=q_start).flatten()   # [R]
    step = scale / math.sqrt(dim)
    per_chunk = probe_rows_per_chunk(probes, PROBE_CHUNK_SCORES, batch * q_heads * num_blocks)
    blocks = torch.arange(num_blocks, device=q.device)
    masses = []
    for start in range(0, positions.shape[0], per_chunk):       # chunks of whole segments
        rows = positions[start:start + per_chunk]
        own = rows // block_size                                                          # [R] the probe's block
        count = (rows - own * block_size + 1).to(dtype)                                   # its keys the probe sees
        queries = rearrange(q[:, :, rows - q_start].to(dtype), "b (h g) r d -> b h g r d", g=group)
        logits = torch.einsum("bhgrd,bhcd->bhgrc", queries, means) * step + math.log(block_size)
        partial = within[:, :, rows // grain] / count[:, None]                            # [B, Hkv, R, D]
        own_logit = torch.einsum("bhgrd,bhrd->bhgr", queries, partial) * step + count.log()
        logits = torch.where(blocks == own[:, None], own_logit[..., None], logits)
        logits = logits.masked_fill(blocks > own[:, None], float("-inf"))
        masses.append(segment_means(rearrange(torch.softmax(logits, dim=-1), "b h g r c -> b (h g) r c"), probes))
    return torch.cat(masses, dim=-2)


def _scored_chunk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, scale: float,
                  block_size: int) -> torch.Tensor:
    """Block sums ``[B, Hq, R, ceil(K / block_size)]`` of the causal attention of the probe queries ``q[:, :, rows]``
    at ``positions`` over ``k [B, Hkv, K, D]`` (`positions_attention`'s softmax, logits in the input dtype), taken
    block-wise: each key block's log-sum-exp, then a softmax over the blocks. Equal to summing the softmax over each
    block, but the scores are read once (a reduction over the ``block_size`` keys of a block, which a compiled graph
    keeps in registers) instead of once for the row's maximum, once for its sum and once for the block sums."""
    logits = F.pad(causal_logits(q, k, positions, rows, scale, True), (0, -k.shape[-2] % block_size),
                   value=float("-inf"))
    blocks = rearrange(logits, "b h g i (c s) -> b h g i c s", s=block_size)
    peak = blocks.amax(dim=-1, keepdim=True)
    peak = peak.masked_fill(peak == float("-inf"), 0.0)                 # a block no probe sees: exp(-inf) = 0
    block_lse = peak.squeeze(-1) + torch.exp(blocks - peak).sum(dim=-1).log()
    return rearrange(torch.softmax(block_lse, dim=-1), "b h g i c -> b (h g) i c")


_compiled_scored_chunk = compiled(_scored_chunk, dynamic=True, fullgraph=True)


PROBE_KERNEL_OUTPUTS = 2**27
"""Most probe-mass kernel outputs alive at once (256 MiB in 16-bit): probe rows go through in chunks."""

PROBE_VALUE_DIM: int | None = None
"""Key blocks per chunk of the probe-mass kernel, which is the width of its one-hot values (a power of 2, at least
16); None: the head dim. A narrower value halves the kernel's ``P V`` work per halving, for more chunks (the
probe queries are repeated once per chunk). Timed per width by ``profiling/prefill_attention.py
--probe-value-dims``."""


def _probe_block_mask(rows: int, row0: int, chunks: int, width: int, segment_size: int, stride: int, last: int,
                      batch: int, device: torch.device, first_segment: int = 0) -> BlockMask:
    """BlockMask of the probe-mass kernel: batch entry ``c * batch + b`` holds key chunk ``c``; probe row ``i``
    (global row ``row0 + i``, of the segments from ``first_segment``) sees the keys of the chunk at or before its
    position (`probe_positions`).

    Built eagerly, outside the compiled kernel: built inside a compiled graph with dynamic shapes it lost part of a
    probe's mass on CUDA (docs/performance.md). The ``mask_mod`` reads its sizes from device tensors
    filled without a host-to-device copy, so the compiled kernel neither recompiles per length nor syncs."""
    probes = segment_size // stride
    sizes = torch.stack([torch.full((), value, dtype=torch.int64, device=device)       # fills: no host copy, no sync
                         for value in (probes, segment_size, stride, last, batch, width, row0, first_segment)])

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        position = probe_row_position(sizes[6] + q_idx, *sizes[:4], sizes[7])
        return position >= (b // sizes[4]) * sizes[5] + kv_idx

    q_blocks, kv_blocks = -(-rows // Q_BLOCK_SIZE), width // Q_BLOCK_SIZE
    first = row0 + torch.arange(q_blocks, device=device) * Q_BLOCK_SIZE
    lo = probe_row_position(first, probes, segment_size, stride, last, first_segment)   # [Qb] ascending with rows
    hi = probe_row_position(torch.clamp(first + Q_BLOCK_SIZE, max=row0 + rows) - 1, probes, segment_size, stride,
                            last, first_segment)
    start = (torch.arange(chunks * batch, device=device) // batch)[:, None] * width              # [C*B, 1]
    full = torch.clamp((lo[None] - start + 1) // Q_BLOCK_SIZE, 0, kv_blocks).to(torch.int32)  # [C*B, Qb]
    seen = torch.clamp(hi[None] - start + Q_BLOCK_SIZE, 0, kv_blocks * Q_BLOCK_SIZE) // Q_BLOCK_SIZE
    j = torch.arange(kv_blocks, device=device, dtype=torch.int32)
    partial_idx = torch.clamp(full[..., None] + j, max=kv_blocks - 1)
    return BlockMask.from_kv_blocks(
        (seen.to(torch.int32) - full)[:, None], partial_idx[:, None].contiguous(), full[:, None],
        j.expand(*full.shape, kv_blocks)[:, None].contiguous(),
        BLOCK_SIZE=(Q_BLOCK_SIZE, Q_BLOCK_SIZE), mask_mod=mask_mod, seq_lengths=(rows, width), compute_q_blocks=False)


_compiled_flex = compiled(flex_attention, dynamic=True)


def probe_mass_kernel(q: torch.Tensor, k: torch.Tensor, segment_size: int, block_size: int, probes: int,
                      scale: float = 1.0, *, compiled: bool = True) -> torch.Tensor:
    """`probe_block_mass` through compiled ``flex_attention``, with no score stored.

    The keys are cut into chunks of ``W = V * block_size`` (``V`` key blocks each: `PROBE_VALUE_DIM`, default the
    head dim ``D``), stacked on the batch dim; every probe row attends each chunk with one-hot values (column ``c``
    is 1 on the keys of the chunk's block ``c``), so the kernel's output is the probe's mass per block *within* the
    chunk, and its log-sum-exp the chunk's share: ``mass = out * exp(lse_chunk - logsumexp_chunks(lse))``. Memory
    ``O(B * Hq * rows * N / block_size)`` per call. The chunks are at least two (one may hold no key): the compiled
    call's batch dim is never 1, which dynamo would specialise, and its inputs are fresh tensors, not views whose
    bases it guards, so the graphs that two prompt lengths compile serve every length (flex specialises the head
    counts: the chunks cannot go on the head dim). ``compiled=False`` runs eager flex (every score evaluated: tests
    and small N only; torch's compiled CPU flex cannot return the log-sum-exp).

    Args:
        q: ``[B, Hq, M, D]`` the queries of the last M positions (as `probe_block_mass`). k: ``[B, Hkv, N, D]``.

    Returns:
        ``[B, Hq, C_S, C_B]`` float32.
    """
    batch, q_heads, _, dim = q.shape
    n = k.shape[-2]
    q_start = n - q.shape[-2]
    value_dim = PROBE_VALUE_DIM or dim
    width = value_dim * block_size
    chunks = max(2, -(-n // width))
    num_blocks = -(-n // block_size)
    dtype = q.dtype
    kv_heads = k.shape[1]
    key_chunks = k.new_empty(chunks * batch, kv_heads, width, dim)                       # [C*B, Hkv, W, D]
    key_chunks.view(chunks, batch, kv_heads, width, dim).copy_(
        rearrange(F.pad(k, (0, 0, 0, chunks * width - n)), "b h (c w) d -> c b h w d", w=width))
    block = torch.arange(width, device=q.device) // block_size
    one_hot = (block[:, None] == torch.arange(value_dim, device=q.device)).to(dtype)      # [W, V]
    positions = probe_positions(n, segment_size, probes, q.device, q_start=q_start).flatten()
    total = positions.shape[0]
    per_call = probe_rows_per_chunk(probes, PROBE_KERNEL_OUTPUTS, batch * chunks * q_heads * value_dim)
    # Triton: the FLASH backend cannot inline the mask's symbolic sizes (torch 2.11, "captures a dynamic scalar")
    options = {"BACKEND": "TRITON"} if q.is_cuda else None
    values = one_hot.repeat(chunks * batch, kv_heads, 1, 1)                              # [C*B, Hkv, W, V]
    masses = []
    run = _compiled_flex if compiled else flex_attention
    with compiled_region():
        for start in range(0, total, per_call):
            stop = min(start + per_call, total)
            block_mask = _probe_block_mask(stop - start, start, chunks, width, segment_size, segment_size // probes,
                                           n - 1, batch, q.device, q_start // segment_size)
            queries = q[:, :, positions[start:stop] - q_start].repeat(chunks, 1, 1, 1)      # [C*B, Hq, R, D]
            out, aux = run(queries, key_chunks, values, block_mask=block_mask, scale=scale / math.sqrt(dim),
                           return_aux=AuxRequest(lse=True), enable_gqa=q_heads != kv_heads,
                           kernel_options=options)
            # a chunk that starts after a probe is not read for it: out of the merge, whatever the kernel reports
            seen = (positions[start:stop][None, :] >= torch.arange(chunks, device=q.device)[:, None] * width)
            seen = seen[None, :, None]                                                      # [1, C, 1, R]
            out = rearrange(out.float(), "(c b) h r v -> b c h r v", b=batch).masked_fill(~seen[..., None], 0.0)
            lse = rearrange(aux.lse.float(), "(c b) h r -> b c h r", b=batch).masked_fill(~seen, float("-inf"))
            share = torch.exp(lse - torch.logsumexp(lse, dim=1, keepdim=True))
            mass = rearrange(out * share[..., None], "b c h r v -> b h r (c v)")[..., :num_blocks]
            masses.append(segment_means(mass, probes))
    return torch.cat(masses, dim=-2)
