"""Per-(batch, query head, segment) token budgets from entropy fluctuation (paper Alg. 3, design.md §1.4).

The paper's recurrence ``B[s] = clamp(B[s-1] + alpha * B_0 * (r_s - delta_t), B_0, M * B_0)`` is sequential in s.
Each step is a *clamp-shift* map ``x -> clamp(x + a, lo, hi)`` and such maps are closed under composition, so
the recurrence is an associative prefix scan: `_clamp_shift_scan` evaluates it in 16 vectorised
Hillis-Steele steps, without a Python loop over segments or a host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexentropy.config import EntropyConfig, check_config
from flexentropy.policies.prefill.entropy.entropies import rigid_heads

_EPS = 1e-9


def fluctuation_rate(entropy: torch.Tensor, kind: str, fluctuation_threshold: float) -> torch.Tensor:
    """Relative entropy change between consecutive segments, ``r[s]`` for s >= 1 (``[..., C_S - 1]``).

    ``"abs"``: ``|e[s] - e[s-1]| / (e[s-1] + 1e-9)`` (paper); ``"signed"``: ``(e[s] - e[s-1]) / (e[s-1] + 1e-9)``
    clamped to ``[0, 1 + delta_t]`` (released code).
    """
    prev, cur = entropy[..., :-1], entropy[..., 1:]
    if kind == "abs":
        return (cur - prev).abs() / (prev + _EPS)
    return ((cur - prev) / (prev + _EPS)).clamp(0.0, 1.0 + fluctuation_threshold)


MAX_SEGMENTS = 2**16
"""Longest segment axis the budget scan covers (33M tokens at segment_size 512)."""


def _clamp_shift_scan(shift: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inclusive prefix composition of ``f_s(x) = clamp(x + shift[..., s], lo, hi)`` along the last dim.

    Returns ``(a, l, h)`` such that ``f_s o ... o f_0 (x) = clamp(x + a[s], l[s], h[s])``.
    Composition rule (first ``(a1, l1, h1)``, then ``(a2, l2, h2)``):
    ``(a1 + a2, clamp(l1 + a2, l2, h2), clamp(h1 + a2, l2, h2))``. Each of the fixed ``log2(MAX_SEGMENTS)``
    Hillis-Steele steps composes every entry with the one ``step`` places earlier, shifted in with the identity
    ``(0, -inf, inf)``, so no step branches on the length (one compiled graph for every length).
    """
    a = shift
    lo_t = torch.full_like(shift, lo)
    hi_t = torch.full_like(shift, hi)
    n = shift.shape[-1]
    for exponent in range(MAX_SEGMENTS.bit_length() - 1):
        step = 2**exponent
        a_prev = F.pad(a, (step, 0), value=0.0)[..., :n]
        l_prev = F.pad(lo_t, (step, 0), value=float("-inf"))[..., :n]
        h_prev = F.pad(hi_t, (step, 0), value=float("inf"))[..., :n]
        lo_t, hi_t = (torch.minimum(torch.maximum(l_prev + a, lo_t), hi_t),
                      torch.minimum(torch.maximum(h_prev + a, lo_t), hi_t))
        a = a_prev + a
    return a, lo_t, hi_t


def allocate_budgets(entropy: torch.Tensor, config: EntropyConfig) -> torch.Tensor:
    """Token budget of every (batch, query head, segment) (paper Alg. 3 with the released code's clamp).

    Rigid heads (`rigid_heads`) get ``B_0`` everywhere. Dynamic heads get ``B[0] = B[1] = B_0`` and for s >= 2
    ``B[s] = clamp(B[s-1] + alpha * B_0 * (r[s] - delta_t), B_0, max_budget_factor * B_0)`` with ``r`` from
    `fluctuation_rate`.

    Args:
        entropy: ``[B, Hq, C_S]`` from `segment_entropy`.
        config: supplies base_budget, budget_alpha, fluctuation_threshold, max_budget_factor, fluctuation,
            entropy_threshold.

    Returns:
        float32 ``[B, Hq, C_S]`` budgets in tokens.
    """
    if not isinstance(entropy, torch.Tensor) or entropy.dim() != 3:
        raise ValueError("entropy must be a 3-D tensor [B, Hq, C_S]")
    check_config(config)
    return fluctuation_budgets(entropy, config)


def fluctuation_budgets(entropy: torch.Tensor, config: EntropyConfig) -> torch.Tensor:
    """`allocate_budgets` on arguments already checked (the selection's own call)."""
    b0 = float(config.base_budget)
    e = entropy.double()
    budgets = torch.full_like(e, b0)
    if e.shape[-1] > 2:
        rate = fluctuation_rate(e, config.fluctuation, config.fluctuation_threshold)[..., 1:]   # r[2:]
        shift = config.budget_alpha * b0 * (rate - config.fluctuation_threshold)
        a, lo, hi = _clamp_shift_scan(shift, b0, config.max_budget_factor * b0)
        dynamic = torch.minimum(torch.maximum(b0 + a, lo), hi)
        budgets[..., 2:] = dynamic
        budgets = torch.where(rigid_heads(e, config.entropy_threshold)[..., None], b0, budgets)
    return budgets.float()
