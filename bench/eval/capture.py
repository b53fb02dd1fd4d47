"""The real model's own post-RoPE ``q``/``k``/``v`` of every attention layer on a prompt.

Captured through transformers' attention extension point: an attention function registered under
`CAPTURE_IMPLEMENTATION` records what each attention module hands it (post-RoPE queries, keys and values, exactly
what flexentropy's attention receives) and then runs HF's SDPA attention, so the forward is the dense model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

CAPTURE_IMPLEMENTATION = "flexentropy_eval_capture"

_captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _capture_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    _captured[module.layer_idx] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@dataclass
class LayerQKV:
    """One layer's post-RoPE ``q [B, Hq, N, D]``, ``k``/``v [B, Hkv, N, D]`` and its softmax ``scale``."""

    layer_idx: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float


def capture_qkv(model: Any, ids: list[int] | torch.Tensor) -> list[LayerQKV]:
    """Run ``model`` densely on the prompt ``ids`` and return every attention layer's q/k/v, in layer order.

    The model's attention implementation is restored afterwards. Only the last position's logits are computed.
    """
    from flexentropy.integrations.hf import attention_modules

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capture_forward)
    previous = model.config._attn_implementation
    prompt = ids if isinstance(ids, torch.Tensor) else torch.tensor([ids], device=model.device)
    _captured.clear()
    try:
        model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
        with torch.no_grad():
            model(prompt, use_cache=False, logits_to_keep=1)  # only q/k/v are needed, not [1, N, V] logits
        layers = [LayerQKV(m.layer_idx, *_captured[m.layer_idx], m.scaling) for m in attention_modules(model)]
    finally:
        model.set_attn_implementation(previous)
        _captured.clear()
    return layers
