"""A static decode step whose decoder layers all run one compiled function, each layer handed its buffers as
arguments: `compiled_layers`, the context the step driver runs such a step in, and `layer_region`, that function.

Dynamo traces a whole forward for each graph it compiles: for a one-token step of a `StaticLatentKVCache`, every
decoder layer of the model, once per stage, and again in every new process (inductor's caches keep the compiled
kernels, not the tracing). Here the step's forward runs eagerly and each decoder layer calls the region, one
``torch.compile``\\ d function for every layer. Dynamo then traces one layer per stage, and nothing it guards on
differs between layers: a layer's index is read nowhere. What differs, the layer's buffers, enters as arguments.
Each layer gets its `StepLayer` (its buffers and the step's counters) under `STEP_KWARG`, and no cache argument, so
transformers' attention calls no ``update``; flexentropy's attention function runs
`flexentropy.caches.static_buffers.step_attention` on it, and the step driver advances the counters after the last
layer. On CUDA the driver records the whole step, its eager parts included, in one CUDA graph.

A layer runs its class's ``forward``: a hook another library set on the layers' instance ``forward`` (accelerate's
device placement) is not run in these steps.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from flexentropy._compile import compiled
from flexentropy.caches.keywords import CACHE_KEYWORDS, CACHE_KWARG, DRIVER_KWARG, STEP_KWARG


def decoder_module(model: nn.Module) -> nn.Module | None:
    """The decoder of an HF causal LM (``model.model``), or None."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers of an HF causal LM (``model.model.layers``), or None."""
    return getattr(decoder_module(model), "layers", None)


def run_layer(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A decoder layer's forward, its class's (not the instance's ``forward`` that `compiled_layers` sets)."""
    return type(layer).forward(layer, *args, **kwargs)


def layer_region(compile_options: dict[str, Any]) -> Callable[..., Any]:
    """`run_layer` compiled with ``compile_options`` (``torch.compile`` keywords): one function for every layer, its
    graphs kept where a folder is named (`flexentropy._compile.compiled`)."""
    return compiled(run_layer, **compile_options)


@contextlib.contextmanager
def compiled_layers(model: nn.Module, region: Callable[..., Any], cache: Any) -> Iterator[None]:
    """Inside, each decoder layer of ``model`` runs ``region`` (`layer_region`) on the static stage of ``cache`` (a
    `StaticLatentKVCache` whose current phase is its static one), handed its `StepLayer` (module docstring); on exit
    the layers are as they were."""
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (model.model.layers)")
    saved = [vars(layer).get("forward") for layer in layers]
    for layer in layers:
        layer.forward = LayerStep(_layer_step, layer, region, cache)
    try:
        yield
    finally:
        for layer, forward in zip(layers, saved, strict=True):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


class LayerStep(functools.partial):
    """A decoder layer's instance ``forward`` inside `compiled_layers`: `_layer_step` on the layer, the region and the
    cache. torch saves a graph compiled ahead of time with the callables of the modules its guards read, this one
    among them, and it holds the cache and the region: it is saved as None (the region's graphs never call it,
    `run_layer` runs the class's ``forward``)."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return type(None), ()


def _layer_step(layer: nn.Module, region: Callable[..., Any], cache: Any, /, *args: Any, **kwargs: Any) -> Any:
    for name in (*CACHE_KEYWORDS, CACHE_KWARG, DRIVER_KWARG):
        kwargs.pop(name, None)
    return region(layer, *args, **kwargs, **{STEP_KWARG: cache.phase.step_layer(layer.self_attn.layer_idx)})
