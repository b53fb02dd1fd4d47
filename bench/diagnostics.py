"""`forward_influence`: how much one cached token matters to the model's future predictions (InfoKV eq. 3, design.md
§3).

For a sequence split into a cached context ``[0, c)`` and a future chunk ``[c, c + horizon)``::

    FI(i) = 1/horizon * sum_{t = c}^{c + horizon - 1} KL( p_t || p_t^(-i) )

where ``p_t`` is the model's next-token distribution at position ``t`` and ``p_t^(-i)`` the same with token ``i``
removed from the cache: the chunk's tokens cannot attend to position ``i`` in any layer, while the context itself was
computed with it (that is what evicting a cached entry does). Removal is implemented by masking: the context is run
once, its cache copied for each ablation, and the chunk run for a batch of ablations at a time with a 4-D attention
mask whose column ``i`` is off. Needs an attention implementation that reads 4-D boolean masks (``"sdpa"``,
``"eager"``, ``"flexentropy"``).
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Sequence
from typing import Any

import torch


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` over the last dim from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


@torch.no_grad()
def forward_influence(model: Any, input_ids: torch.Tensor, positions: Sequence[int] | torch.Tensor, horizon: int,
                      *, batch_size: int = 16) -> torch.Tensor:
    """Forward influence of cached tokens on the last ``horizon`` tokens' predictions (module docstring).

    Args:
        model: an HF causal LM (eval mode).
        input_ids: ``[1, T]`` (or ``[T]``) token ids; the last ``horizon`` are the future chunk, the rest the cache.
        positions: cached positions ``i`` to ablate, each in ``[0, T - horizon)``.
        horizon: length of the future chunk, ``1 <= horizon < T``.
        batch_size: ablations run together (memory: ``batch_size`` copies of the context's KV cache).

    Returns:
        float32 ``[len(positions)]``: mean KL divergence (nats) over the chunk, >= 0.
    """
    from transformers import DynamicCache

    from flexentropy.integrations.hf import cache_keyword

    ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T] or [T], got {list(input_ids.shape)}")
    total = ids.shape[1]
    if isinstance(horizon, bool) or not isinstance(horizon, numbers.Integral) or not 1 <= horizon < total:
        raise ValueError(f"horizon must be an int in [1, T={total}), got {horizon!r}")
    context = total - horizon
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    if positions.numel() and not bool(((positions >= 0) & (positions < context)).all()):
        raise ValueError(f"positions must lie in the cached context [0, {context}), got {positions.tolist()}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")

    keyword = cache_keyword(model)
    prefix = DynamicCache(config=model.config)
    model(ids[:, :context], **{keyword: prefix}, use_cache=True, logits_to_keep=1)  # only the cache is needed
    chunk = ids[:, context:]
    reference = model(chunk, **{keyword: copy.deepcopy(prefix)}, use_cache=True).logits.float().log_softmax(-1)

    device = ids.device
    causal = torch.ones(horizon, horizon, dtype=torch.bool, device=device).tril()
    influence = []
    for part in positions.split(batch_size):
        n = part.numel()
        allowed = torch.ones(n, 1, horizon, total, dtype=torch.bool, device=device)
        allowed[..., context:] = causal
        allowed[torch.arange(n, device=device), 0, :, part.to(device)] = False
        cache = copy.deepcopy(prefix)
        cache.batch_repeat_interleave(n)
        logits = model(chunk.expand(n, -1), **{keyword: cache}, attention_mask=allowed, use_cache=True).logits
        influence.append(_kl(reference, logits.float().log_softmax(-1)).mean(dim=-1))
    return torch.cat(influence) if influence else torch.zeros(0)
