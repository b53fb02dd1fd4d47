"""Segment attention entropy and the rigid/dynamic head split (paper sec. 4.2, design.md §1.3)."""

from __future__ import annotations

import torch

from flexentropy._checks import check_bool


def segment_entropy(a_obs: torch.Tensor, *, normalise: bool = False) -> torch.Tensor:
    """Shannon entropy (nats) of each segment's observation-attention row, ``0 * ln 0 = 0``.

    Args:
        a_obs: ``[B, Hq, C_S, C_B]`` from `observation_attention` (real: a complex tensor is refused).
        normalise: divide each row by its sum first (a ``"probe"`` or ``"pooled"`` row is mass, not a distribution).

    Returns:
        float32 ``[B, Hq, C_S]``: ``e[h, s] = -sum_j a[h, s, j] ln a[h, s, j]``.
    """
    if not isinstance(a_obs, torch.Tensor) or a_obs.dim() != 4:
        raise ValueError(f"a_obs must be a 4-D tensor [B, Hq, C_S, C_B], got "
                         f"{tuple(a_obs.shape) if isinstance(a_obs, torch.Tensor) else type(a_obs).__name__}")
    if a_obs.is_complex():
        raise TypeError(f"a_obs must be real (attention mass per block), got {a_obs.dtype}: its imaginary part "
                        "would be dropped; pass its .abs() or .real")
    check_bool("segment_entropy", "normalise", normalise)
    a = a_obs.float()
    if normalise:
        a = a / a.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return -torch.special.xlogy(a, a).sum(dim=-1)


def rigid_heads(entropy: torch.Tensor, threshold: float) -> torch.Tensor:
    """Heads whose largest segment entropy (segments 1.., segment 0 has no candidates) is below ``threshold``.

    Args:
        entropy: ``[B, Hq, C_S]``.

    Returns:
        bool ``[B, Hq]``; a head with a single segment is rigid.
    """
    later = entropy[..., 1:]
    if later.shape[-1] == 0:
        return torch.ones(entropy.shape[:-1], dtype=torch.bool, device=entropy.device)
    return later.amax(dim=-1) < threshold
