"""The hooks `flexentropy.enable` installs on a transformers model, and `flexentropy.disable` removes.

All of them do nothing for a cache that does not ask for them, so a model switched by `enable` serves transformers'
own caches unchanged.

- Each attention module's forward pre-hook (`hand_over_cache`) passes the module's cache on to the attention function
  under `CACHE_KWARG`, and hands a `PolicyCache` the prompt's padding and the layer's sliding window.
- The decoder's forward pre-hook refuses an input of no token (or without a batch dim) with a message, and a forward
  that a `PolicyCache` cannot continue (`PolicyCache.check_request`: another model's, another batch size, a new
  prompt on a used cache) before any layer writes to it, so that the cache's conversation goes on; it and the
  decoder's forward hook run the decode engine's `begin_step` and `end_step` eagerly around
  every forward that no step driver runs (one without `DRIVER_KWARG`): a `StaticLatentKVCache`'s decisions never
  run inside a compiled or captured step, and its counters advance once per step.
- ``model.get_compiled_call`` (what ``generate`` decodes with) runs the one-token steps of a `StaticLatentKVCache`
  through the model's `StepDriver` (`step_driver`: recorded once per stage and replayed on CUDA), and the other
  forwards of such a cache (a later turn) eagerly; other caches get transformers' own compiled call.
- ``model.prepare_inputs_for_generation`` (what ``generate`` prepares every forward's inputs with, from the whole
  conversation's ids) hands a `PolicyCache` those ids first (`GenerateIds`, `PolicyCache.observe_generate`): the
  cache refuses a new prompt on a used cache, which the forward cannot tell from a later turn (``generate`` feeds only
  the tokens past the cache's length).
- ``model.create_masks_for_generate`` (what ``generate`` builds a compileable cache's 4D mask with before every
  step) hands a `StaticLatentKVCache`'s one-token steps their 2D mask as it is: their attention reads the cache's
  own validity, and the mask would be host work in every step.
- One forward hook per decoder layer hands hidden states and the predictive distribution to a cache whose policy
  needs them (`PolicyCache.wants_signals`, InfoKV): ``observe_hidden`` per layer and, after the last layer,
  ``finish_forward`` with a function applying the final norm and the LM head (``generate`` computes logits for the
  last token only; nothing runs the model twice). A model without a final norm and LM head gets none.

Every hook is a module-level function or an object holding what it needs (the model, its final norm and head), never
a closure: a copy of the model (``copy.deepcopy``) gets hooks of its own, bound to the copy, and ``torch.save`` can
pickle a switched model. The handles live on the model (`HOOKS_ATTR`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.masking_utils import create_masks_for_generate

from flexentropy._checks import check_tokens
from flexentropy._compile import eager
from flexentropy.caches.keywords import CACHE_KWARG, DRIVER_KWARG, STEP_KWARG, cache_argument
from flexentropy.caches.policy_cache import PolicyCache
from flexentropy.caches.static_latent import StaticLatentKVCache
from flexentropy.engine.compiled_layer import decoder_module
from flexentropy.engine.driver import begin_step, end_step, forget_drivers, step_driver
from flexentropy.integrations.hf.mask import real_tokens

HOOKS_ATTR = "flexentropy_hooks"
"""Attribute of a switched model holding the handles of the hooks `install` registered on it: the record lives on the
model, so that a copy (``copy.deepcopy``) carries handles of its own hooks and ``torch.save`` keeps them."""


def installed(model: nn.Module) -> bool:
    """Whether `install` put its hooks on ``model`` (and `remove` has not taken them off)."""
    return HOOKS_ATTR in vars(model)


def install(model: nn.Module, attention: list[nn.Module]) -> None:
    """Register every hook of the module docstring on ``model`` (``attention``: its attention modules), once."""
    if installed(model):
        return
    handles = [module.register_forward_pre_hook(hand_over_cache, with_kwargs=True) for module in attention]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    handles.append(decoder.register_forward_pre_hook(begin_undriven_step, with_kwargs=True))
    handles.append(decoder.register_forward_hook(end_undriven_step, with_kwargs=True))
    handles.extend(_signal_hooks(model))
    if hasattr(model, "get_compiled_call"):
        model.get_compiled_call = StaticStepRouting(model)
    if hasattr(model, "prepare_inputs_for_generation"):
        model.prepare_inputs_for_generation = GenerateIds(model)
    model.create_masks_for_generate = StaticStepMasks(model)
    setattr(model, HOOKS_ATTR, handles)


def remove(model: nn.Module) -> bool:
    """Take `install`'s hooks off ``model`` and give it back its own ``get_compiled_call``; whether there were
    any."""
    handles = vars(model).pop(HOOKS_ATTR, None)
    if handles is None:
        return False
    for handle in handles:
        handle.remove()
    for name in ("get_compiled_call", "prepare_inputs_for_generation", "create_masks_for_generate"):
        vars(model).pop(name, None)
    forget_drivers(model)
    return True


def hand_over_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """An attention module's forward pre-hook: pass its cache (``cache`` or ``past_key_values``) on as
    `CACHE_KWARG`; before a prompt reaches a `PolicyCache`, hand it the prompt's padding (a decision may follow its
    ``update``) and, for a sliding-window layer, its window. A static step by layer arguments (`STEP_KWARG`) is
    left as it is."""
    if STEP_KWARG in kwargs:   # its attention reads the step's `StepLayer`, no cache
        return args, kwargs
    cache, mask = cache_argument(kwargs), kwargs.get("attention_mask")
    if isinstance(cache, PolicyCache) and cache.stored_length(module.layer_idx) == 0:  # a prompt
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 \
                and mask.shape[-2] == mask.shape[-1]:
            cache.observe_padding(real_tokens(mask), module.layer_idx)
        if getattr(module, "sliding_window", None):
            cache.observe_sliding(int(module.sliding_window), module.layer_idx)
    return args, {**kwargs, CACHE_KWARG: cache}


def _model_input(args: tuple, kwargs: dict[str, Any]) -> tuple[str, Any]:
    """``(name, value)`` of a decoder call's input: ``input_ids`` (keyword or first positional), else
    ``inputs_embeds``."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    return ("input_ids", tokens) if tokens is not None else ("inputs_embeds", kwargs.get("inputs_embeds"))


def begin_undriven_step(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """The decoder's forward pre-hook, before any layer runs: an input of no token (or without a batch dim) is
    refused with a message (transformers' own error comes from deep inside the attention); so is a flexentropy cache
    handed to a forward with ``use_cache=False``, or one the forward cannot continue (`PolicyCache.check_request`:
    another model's, another batch size, a new prompt), before anything is written to it; then `begin_step` for a
    `StaticLatentKVCache`'s forward that no driver runs."""
    name, tokens = _model_input(args, kwargs)
    if tokens is None:   # transformers says what it takes
        return
    check_tokens("the model", name, tokens, dims=2 if name == "input_ids" else 3)
    cache = cache_argument(kwargs)
    if not isinstance(cache, PolicyCache):
        return
    if kwargs.get("use_cache") is False:
        raise ValueError(f"a {type(cache).__name__} was passed with use_cache=False: the model then runs the whole "
                         f"sequence again at every step (as generate(use_cache=False) does), which a cache that keeps "
                         f"what it saw cannot serve. Pass use_cache=True (generate's default) with the cache, or no "
                         f"cache with use_cache=False")
    cache.check_request(module.config.num_hidden_layers, tokens, kwargs.get("position_ids"))
    if isinstance(cache, StaticLatentKVCache) and not kwargs.get(DRIVER_KWARG):
        eager(begin_step, cache, tokens.shape[1])


def end_undriven_step(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    """The decoder's forward hook: `end_step` after a `StaticLatentKVCache`'s forward that no driver runs."""
    cache = cache_argument(kwargs)
    if isinstance(cache, StaticLatentKVCache) and not kwargs.get(DRIVER_KWARG):
        eager(end_step, cache, _model_input(args, kwargs)[1].shape[1])


class StaticStepRouting:
    """``model.get_compiled_call`` of a switched model: its calls run a `StaticLatentKVCache`'s one-token steps through
    the model's `StepDriver` and its other forwards eagerly (module docstring); other caches get the class's own
    compiled call. An object holding the model, not a closure, so that a copy of the model routes to itself and
    pickling works."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, compile_config: Any = None) -> Callable[..., Any]:
        model = self.model
        compiled = type(model).get_compiled_call(model, compile_config)
        driver = None   # the model's driver for ``compile_config`` (`step_driver`), found at the first step

        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal driver
            cache = cache_argument(kwargs)
            if not isinstance(cache, StaticLatentKVCache):
                return compiled(*args, **kwargs)
            tokens, positions = kwargs.get("input_ids", args[0] if args else None), kwargs.get("position_ids")
            if tokens is None or tokens.shape[1] != 1 or positions is None:
                return model(*args, **kwargs)
            if driver is None:
                driver = step_driver(model, compile_config, tokens.device)
            return driver(tokens, positions, cache)

        return call


class GenerateIds:
    """``model.prepare_inputs_for_generation`` of a switched model (what ``generate`` prepares each forward's inputs
    with, from the ids of the whole conversation): hands a `PolicyCache` those ids first
    (`PolicyCache.observe_generate`: a new prompt on a used cache is refused there), then prepares the inputs as the
    model's class does. Its signature is the class's (``generate`` reads it to see which inputs the model takes,
    ``inputs_embeds`` among them)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.model).prepare_inputs_for_generation.__get__(self.model))

    def __call__(self, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        cache = cache_argument(kwargs)
        if isinstance(cache, PolicyCache) and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            mask, embeds = kwargs.get("attention_mask"), kwargs.get("inputs_embeds")
            first = bool(kwargs.get("is_first_iteration"))
            # the conversation's tokens: generate's 2D attention mask and its position ids cover them all (transformers
            # >= 5.24 drops a mask of ones), where input_ids may be the new tokens only
            positions, lengths = kwargs.get("position_ids"), [input_ids.shape[1]]
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                lengths.append(mask.shape[1])
            if isinstance(positions, torch.Tensor):
                lengths.append(positions.shape[-1])
            length = max(lengths)
            cache.observe_generate(input_ids, length, first=first,
                                   embeds=embeds.shape[1] if first and isinstance(embeds, torch.Tensor) else None,
                                   positions=positions if isinstance(positions, torch.Tensor) else None)
        return type(self.model).prepare_inputs_for_generation(self.model, input_ids, *args, **kwargs)


class StaticStepMasks:
    """``model.create_masks_for_generate`` of a switched model: the 2D ``attention_mask`` of a
    `StaticLatentKVCache`'s one-token steps unchanged (module docstring), the model's own masks for everything
    else."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, **kwargs: Any) -> Any:
        cache, embeds = kwargs.get("past_key_values"), kwargs.get("inputs_embeds")
        if isinstance(cache, StaticLatentKVCache) and embeds is not None and embeds.shape[1] == 1:
            return kwargs.get("attention_mask")
        own = inspect.getattr_static(type(self.model), "create_masks_for_generate", None)
        create = create_masks_for_generate if own is None else own.__get__(self.model, type(self.model))
        return create(**kwargs)


class FinalLogits:
    """Last-layer outputs ``[B, L, d]`` to logits ``[B, L, V]``: the final norm, the LM head and the final logit
    soft-capping where the model has it."""

    def __init__(self, norm: nn.Module, head: nn.Module, softcap: float | None) -> None:
        self.norm, self.head, self.softcap = norm, head, softcap

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(hidden))
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, FinalLogits]:
    """``(decoder layers, logits_fn)`` of an HF causal LM (`FinalLogits`)."""
    decoder = decoder_module(model)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if layers is None or norm is None or head is None:
        raise ValueError(f"cannot find the decoder layers, final norm and LM head of {type(model).__name__}; "
                         "signal policies need an HF causal LM (model.model.layers / .norm, lm_head)")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return layers, FinalLogits(norm, head, getattr(config, "final_logit_softcapping", None))


class SignalHook:
    """Decoder layer ``index``'s forward hook: hands its hidden states to a cache whose policy needs them, and after
    the last layer (``logits``: `FinalLogits`, only there) finishes the forward's signals (module docstring)."""

    def __init__(self, index: int, logits: FinalLogits | None) -> None:
        self.index, self.logits = index, logits

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        cache = cache_argument(kwargs)
        if not getattr(cache, "wants_signals", False):
            return
        hidden = output[0] if isinstance(output, tuple) else output
        cache.observe_hidden(self.index, hidden)
        if self.logits is not None:
            cache.finish_forward(hidden, self.logits)


def _signal_hooks(model: nn.Module) -> list[RemovableHandle]:
    """The decoder layers' forward hooks handing signals to caches that want them (module docstring); none for a
    model without a final norm and LM head."""
    try:
        layers, logits = decoder_parts(model)
    except ValueError:
        return []
    last = len(layers) - 1
    return [layer.register_forward_hook(SignalHook(i, logits if i == last else None), with_kwargs=True)
            for i, layer in enumerate(layers)]
