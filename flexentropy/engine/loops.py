"""The engine's decoding loop over a `StaticLatentKVCache` on the model's step driver (`flexentropy.engine.driver`),
as ``generate``: `greedy_generate`, the plain loop of an HF causal LM (a model of `EntropyAttention` layers decodes in
its own loop, with the driver's `begin_step` and `end_step` around each forward). transformers is imported inside
the functions.
"""

from __future__ import annotations

from typing import Any

import torch

from flexentropy._checks import check_bool, check_int, check_tokens
from flexentropy.engine.driver import step_driver
from flexentropy.settings import model_settings


def decode_settings(model: Any, device: torch.device, compile_config: Any, compiled: bool | None
                    ) -> tuple[Any, bool]:
    """``(compile_config, compiled)`` of a decoding loop, as ``generate`` chooses them: the model's
    ``CompileConfig`` when none is given; compiled on CUDA, or anywhere with a config whose
    ``_compile_all_devices`` is set, unless ``compiled`` says otherwise."""
    if compile_config is None:
        compile_config = getattr(model.generation_config, "compile_config", None)
    if compiled is None:
        compiled = device.type == "cuda" or bool(getattr(compile_config, "_compile_all_devices", False))
    return compile_config, compiled


def served_config(model: Any, cache: Any) -> Any:
    """The `EntropyConfig` a loop serves with: ``cache``'s, else the model's `Settings`' (`flexentropy.enable`'s)."""
    return cache.config if cache is not None else model_settings(model).config


def greedy_generate(model: Any, input_ids: torch.Tensor, cache: Any, max_new_tokens: int, *,
                    attention_mask: torch.Tensor | None = None, compile_config: Any = None,
                    compiled: bool | None = None) -> torch.Tensor:
    """Greedy decoding of an HF causal LM in a plain loop: what ``model.generate(..., do_sample=False)`` returns
    after the prompt, without its per-step host work and synchronisation (its stopping checks), so that the next
    step's launch overlaps the current step on the GPU. No stopping token: exactly ``max_new_tokens`` tokens.

    The decode steps of a `StaticLatentKVCache` run the model's `StepDriver` (the one ``generate`` runs through
    ``model.get_compiled_call``: one warm-up serves both); those of transformers' ``StaticCache`` its compiled call.

    Args:
        model: an HF causal LM (switched by `flexentropy.enable` or not).
        input_ids: int64 ``[B, N]`` the prompt.
        cache: a `StaticLatentKVCache` (left-padded batches allowed: it reads the padding from the prompt) or
            transformers' ``StaticCache`` (the dense baseline; no padding).
        max_new_tokens: tokens to generate, the prompt's greedy next token included.
        attention_mask: ``[B, N]`` of the prompt (1 real, 0 left padding); None: no padding.
        compile_config: transformers' ``CompileConfig`` of the decode steps (default: the model's).
        compiled: run the decode steps compiled; None: as ``generate`` does, on CUDA, or anywhere with a
            ``compile_config`` whose ``_compile_all_devices`` is set.

    Returns:
        int64 ``[B, max_new_tokens]``.
    """
    from transformers import StaticCache

    from flexentropy.caches.keywords import cache_keyword
    from flexentropy.caches.static_latent import StaticLatentKVCache

    max_new_tokens = check_int("greedy_generate", "max_new_tokens", max_new_tokens, 1)
    check_tokens("greedy_generate", "input_ids", input_ids)
    check_bool("greedy_generate", "compiled", compiled, optional=True)
    if input_ids.dtype != torch.long:
        raise ValueError(f"greedy_generate expects input_ids int64 [B, N], got {input_ids.dtype} "
                         f"{list(input_ids.shape)}")
    if not isinstance(cache, StaticLatentKVCache | StaticCache):
        raise TypeError(f"greedy_generate decodes over a StaticLatentKVCache or transformers' StaticCache, got "
                        f"{type(cache).__name__}; use model.generate for other caches")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {list(attention_mask.shape)} must match input_ids "
                             f"{list(input_ids.shape)}")
        real = attention_mask.bool()
        left = torch.arange(real.shape[1], device=real.device) >= (~real).sum(-1, keepdim=True)
        if not bool(real.any(-1).all()) or not torch.equal(left, real):
            raise ValueError("greedy_generate reads left padding only: each row of attention_mask must be 0s, then "
                             "1s to its end, with at least one 1 (pad on the left, as generate does)")
        if not isinstance(cache, StaticLatentKVCache) and not bool(real.all()):
            raise ValueError("greedy_generate runs a padded batch only over a StaticLatentKVCache (its decode "
                             "steps need no mask); a StaticCache batch must not be padded")
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    else:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    compile_config, compiled = decode_settings(model, input_ids.device, compile_config, compiled)
    keyword = {cache_keyword(model): cache}
    if isinstance(cache, StaticLatentKVCache):
        driver = step_driver(model, compile_config, input_ids.device, compiled=compiled)

        def call(tokens: torch.Tensor, position: torch.Tensor) -> Any:
            return driver(tokens, position, cache)
    else:
        compiled_call = model.get_compiled_call(compile_config) if compiled else model.__call__

        def call(tokens: torch.Tensor, position: torch.Tensor) -> Any:
            return compiled_call(input_ids=tokens, position_ids=position, **keyword, use_cache=True,
                                 logits_to_keep=1)
    with torch.no_grad():   # as generate: inference tensors would fail the compiled graphs' guards
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **keyword,
                       use_cache=True, logits_to_keep=1).logits
        tokens = logits[:, -1:].argmax(dim=-1)
        position = positions[:, -1:] + 1
        out = [tokens]
        for _ in range(max_new_tokens - 1):
            tokens = call(tokens, position).logits[:, -1:].argmax(dim=-1)
            position = position + 1
            out.append(tokens)
    return torch.cat(out, dim=1)
