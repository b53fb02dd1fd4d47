"""Model signals for information-aware cache policies (InfoKV, design.md §3): hidden states and the
predictive distribution, read off the forward the model runs anyway.

`attach_signals(model)` registers one forward hook per decoder layer (``model.get_decoder().layers``). Each hook
finds the forward's cache in the layer's ``cache`` (transformers >= 5.24) or ``past_key_values`` keyword and, when that
cache wants signals (`PolicyCache.wants_signals`), hands it the layer's output hidden states; the last layer's hook
also hands over its raw output with a function applying the final norm and the LM head, from which the cache takes
the predictive distribution of *every* token of the forward (``generate`` computes logits for the last token only).
Nothing runs the model twice: the extra cost is one LM-head matmul per token, in chunks. The hooks stay on the model
and do nothing for other caches; attaching twice is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flexentropy.caches.keywords import cache_argument

_HOOKS_ATTR = "_flexentropy_signal_hooks"


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, Callable[[torch.Tensor], torch.Tensor]]:
    """``(decoder layers, logits_fn)`` of an HF causal LM: ``logits_fn`` maps last-layer outputs ``[B, L, d]`` to
    logits ``[B, L, V]`` (final norm, LM head, final logit soft-capping where the model has it)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if layers is None or norm is None or head is None:
        raise ValueError(f"cannot find the decoder layers, final norm and LM head of {type(model).__name__}; "
                         "signal policies need an HF causal LM (model.model.layers / .norm, lm_head)")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    softcap = getattr(config, "final_logit_softcapping", None)

    def logits_fn(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(norm(hidden))
        return logits if softcap is None else torch.tanh(logits / softcap) * softcap

    return layers, logits_fn


def attach_signals(model: nn.Module) -> None:
    """Register the forward hooks that hand hidden states and the predictive distribution to signal caches
    (module docstring). Idempotent."""
    if getattr(model, _HOOKS_ATTR, None):
        return
    layers, logits_fn = decoder_parts(model)
    last = len(layers) - 1

    def make_hook(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
            cache = cache_argument(kwargs)
            if not getattr(cache, "wants_signals", False):
                return
            hidden = output[0] if isinstance(output, tuple) else output
            cache.observe_hidden(index, hidden)
            if index == last:
                cache.finish_forward(hidden, logits_fn)

        return hook

    handles = [layer.register_forward_hook(make_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    setattr(model, _HOOKS_ATTR, handles)
