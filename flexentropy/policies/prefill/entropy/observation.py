"""Observation attention between segment and block representatives (paper Alg. 2, design.md §1.2)."""

from __future__ import annotations

import torch
from einops import rearrange

from flexentropy._checks import check_number, check_qk, is_int
from flexentropy.config import MASS_OBSERVATIONS, OBSERVATIONS, Q_BLOCK_SIZE
from flexentropy.policies.prefill.entropy.probe_mass import pooled_block_mass, probe_block_mass
from flexentropy.policies.prefill.entropy.representatives import chunk_extrema
from flexentropy.policies.prefill.fixed import candidate_blocks, chunk_segments


def _masked_softmax(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``allowed``; rows with nothing allowed are all 0."""
    p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return p.masked_fill(~allowed, 0.0)


def observation_attention(q: torch.Tensor, k: torch.Tensor, segment_size: int, block_size: int, *,
                          observation: str = "paper", scale: float = 1.0, probes: int = 16) -> torch.Tensor:
    """Block-level attention of each segment over the key blocks before it.

    Representatives (Alg. 1): ``Qmax/Qmin`` per segment and query head, ``Kmax/Kmin`` per key block and KV
    head; logits ``S1 = Qmax.Kmax, S2 = Qmax.Kmin, S3 = Qmin.Kmax, S4 = Qmin.Kmin`` times ``scale``.

    * ``"paper"`` (Alg. 2): ``max((softmax(S1) + softmax(S2)) / 2, (softmax(S3) + softmax(S4)) / 2)``.
    * ``"critiprefill"`` (released code): ``softmax(max(mean(S1, S3), mean(S2, S4)))``.

    Every softmax runs over the candidate blocks of the segment (`candidate_blocks`), in float32.

    * ``"probe"`` (not in the paper; design.md §1.2b): the true attention of ``probes`` strided queries of the
      segment (`probe_mass.probe_block_mass`, logits ``scale * q.k / sqrt(D)``), its mass per
      candidate block averaged over the probes. A row is *not* a distribution over the candidates: it sums to the
      probes' mass outside their own segment, the rest being on the segment's own (always computed) keys.
    * ``"pooled"`` (not in the paper; design.md §1.2c): the same probes, each block scored by its mean key
      (`probe_mass.pooled_block_mass`): ``L_B`` times cheaper than ``"probe"``, an estimate of it.

    Args:
        q: ``[B, Hq, N, D]``. k: ``[B, Hkv, N, D]`` with ``Hq % Hkv == 0``.
        segment_size: L_S, tokens per query segment. block_size: L_B, tokens per key block.
        probes: probe queries per segment (``"probe"``, ``"pooled"``), a divisor of ``segment_size``.

    Returns:
        float32 ``[B, Hq, C_S, C_B]``; non-candidates (and all of segment 0) exactly 0.
    """
    check_qk(q, k)
    if observation not in OBSERVATIONS:
        raise ValueError(f"observation must be one of {OBSERVATIONS}, got {observation!r}")
    for name, value in (("segment_size", segment_size), ("block_size", block_size)):
        if not is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if segment_size % block_size or segment_size % Q_BLOCK_SIZE:
        raise ValueError(f"segment_size ({segment_size}) must be a multiple of block_size ({block_size}) "
                         f"and of {Q_BLOCK_SIZE}")
    check_number("observation_attention", "scale", scale, 0, open_low=True)    # finite: inf gives NaN rows
    if observation in MASS_OBSERVATIONS and (not is_int(probes) or probes <= 0 or segment_size % probes):
        raise ValueError(f"probes must be a positive divisor of segment_size ({segment_size}), got {probes!r}")
    return _observation(q, k, segment_size, block_size, observation, float(scale), probes)


def _observation(q: torch.Tensor, k: torch.Tensor, segment_size: int, block_size: int, observation: str,
                 scale: float, probes: int = 16, kernel: bool = False, compiled: bool = False) -> torch.Tensor:
    """`observation_attention` on checked arguments, also of a chunk's queries: ``q [B, Hq, M, D]`` the last M of the
    ``N`` positions of ``k``, from a segment's start (``N - M`` a multiple of ``segment_size``: the selection pads a
    chunk's queries to it, design.md §1.7). ``[B, Hq, C_S, C_B]`` over the segments holding the queries."""
    first_segment = (k.shape[-2] - q.shape[-2]) // segment_size
    if observation in MASS_OBSERVATIONS:
        mass = (probe_block_mass(q, k, segment_size, block_size, probes, scale, kernel=kernel, compiled=compiled)
                if observation == "probe" else pooled_block_mass(q, k, segment_size, block_size, probes, scale)).float()
        segments = chunk_segments(mass.shape[-2], first_segment, q.device)
        return mass * candidate_blocks(segments, mass.shape[-1], segment_size, block_size)
    group = q.shape[1] // k.shape[1]
    qmax, qmin = chunk_extrema(q, segment_size)                     # [B, Hq, C_S, D]
    kmax, kmin = chunk_extrema(k, block_size)                       # [B, Hkv, C_B, D]
    qmax, qmin = (rearrange(t, "b (g r) s d -> b g r s d", r=group) for t in (qmax, qmin))

    def logits(qr: torch.Tensor, kr: torch.Tensor) -> torch.Tensor:
        s = torch.einsum("bgrsd,bgjd->bgrsj", qr, kr) * scale
        return rearrange(s, "b g r s j -> b (g r) s j")

    s1, s2, s3, s4 = logits(qmax, kmax), logits(qmax, kmin), logits(qmin, kmax), logits(qmin, kmin)
    segments = chunk_segments(s1.shape[-2], first_segment, q.device)
    allowed = candidate_blocks(segments, s1.shape[-1], segment_size, block_size)
    if observation == "paper":
        upper = (_masked_softmax(s1, allowed) + _masked_softmax(s2, allowed)) / 2
        lower = (_masked_softmax(s3, allowed) + _masked_softmax(s4, allowed)) / 2
        return torch.maximum(upper, lower)
    return _masked_softmax(torch.maximum((s1 + s3) / 2, (s2 + s4) / 2), allowed)
