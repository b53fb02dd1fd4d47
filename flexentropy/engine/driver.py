"""`StepDriver`: the one owner of a model's decode-step order over `StaticLatentKVCache`s (the cache's `prepare`,
then the step of its stage, recorded once and replayed), and `step_driver`, each model's drivers.

A static step is the model's forward with every decoder layer in one compiled function (inductor, no CUDA graphs
of its own), each layer handed its buffers (`flexentropy.engine.compiled_layer`): dynamo traces one layer per
stage, not the whole model. On CUDA that step is recorded in one CUDA graph per (cache buffers, stage, batch) and
replayed: no guard, no launch and no host work between the replays but the cache's decisions on the steps where its
policy decides. Elsewhere the step runs as it is. ``generate`` reaches the driver through
``model.get_compiled_call`` (`flexentropy.integrations.hooks`), `flexentropy.greedy_generate`
directly; the drivers live here, per model (weakly), not on the model.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flexentropy._compile import no_silent_fallback
from flexentropy.caches.keywords import cache_keyword
from flexentropy.engine.compiled_layer import compiled_layers, layer_region

Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor, Any], Any]
"""``(model, tokens [B, 1] int64, position_ids [B, 1] int64, cache) -> output``: a model's one-token step
(`StepDriver`)."""


@dataclass
class Recording:
    """A static step recorded as a CUDA graph: its input buffers and its output (overwritten by each replay)."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    output: Any


class StepDriver:
    """Runs a model's one-token decode steps over `StaticLatentKVCache`s, in the order the cache needs them: the
    cache's `prepare` (its decisions, when due), then the step of the cache's stage.

    - on the dynamic path (the prompt's phase 1 outside the prompt buffers, a later turn), the eager forward;
    - in a static stage, the forward with its decoder layers compiled (`compiled_layers`), then the cache's
      ``advance``; with ``capture`` (CUDA), that step recorded once per (cache buffers, stage, batch) as a CUDA graph
      and replayed: recording runs the step twice on a side stream (compiling it the first time) and undoes what it
      changed (`StaticLatentKVCache.snapshot`), so the request's step is the first replay.

    A replay's output is the one object recorded with the graph; the next replay overwrites its tensors (read the
    logits before the next step, as ``generate`` and the greedy loops do).

    Args:
        model: the model (held weakly: the drivers live beside it, `step_driver`).
        forward: its step (`Forward`), eager.
        compile_options: ``torch.compile`` keywords of the static steps' decoder layers (None: static steps run
            ``forward`` eagerly, and nothing is recorded).
        capture: record static steps as CUDA graphs (the model on CUDA).
    """

    def __init__(self, model: nn.Module, forward: Forward, compile_options: dict[str, Any] | None,
                 capture: bool) -> None:
        self.model = weakref.ref(model)
        self.forward = forward
        self.region = None if compile_options is None else layer_region(compile_options)
        self.capture = capture and self.region is not None
        self.recordings: weakref.WeakKeyDictionary[Any, dict[tuple, Recording]] = weakref.WeakKeyDictionary()
        self.pool: Any = None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        """One step of ``tokens [B, L]`` at ``positions [B, L]`` over ``cache``; the forward's output."""
        model = self.model()
        cache.driven = True
        try:
            cache.prepare(tokens.shape[1])
            stage = cache.stage
            if stage is None or tokens.shape[1] != 1 or self.region is None:
                return self.forward(model, tokens, positions, cache)
            if self.capture:
                recording = self._recording(model, cache, stage, tokens, positions)
                recording.tokens.copy_(tokens)
                recording.positions.copy_(positions)
                recording.graph.replay()
                output = recording.output
            else:
                output = self._static_step(model, tokens, positions, cache)
            cache.end_step()
            return output
        finally:
            cache.driven = False

    def _static_step(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        """A static step: the forward with every decoder layer in the region (`compiled_layers`), then the
        counters advance. The region holds up to ``flexentropy._compile.RECOMPILE_LIMIT`` graphs (stages, batch sizes,
        models of a process) and says so past them, instead of running its layers eagerly from then on."""
        with no_silent_fallback(), compiled_layers(model, self.region, cache):
            output = self.forward(model, tokens, positions, cache)
        cache.advance()
        return output

    def _recording(self, model: nn.Module, cache: Any, stage: Any, tokens: torch.Tensor,
                   positions: torch.Tensor) -> Recording:
        recordings = self.recordings.setdefault(cache, {})
        key = (id(stage), stage.version, tuple(tokens.shape))
        if key not in recordings:
            saved = cache.snapshot()
            inputs = tokens.clone(), positions.clone()
            side = torch.cuda.Stream(tokens.device)
            side.wait_stream(torch.cuda.current_stream(tokens.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._static_step(model, *inputs, cache)
                    cache.restore(saved)
            torch.cuda.current_stream(tokens.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self._static_step(model, *inputs, cache)
            cache.restore(saved)
            self.pool = graph.pool()
            recordings[key] = Recording(graph, *inputs, output)
        return recordings[key]


def step_options(compile_config: Any, device: torch.device) -> dict[str, Any]:
    """``torch.compile`` keywords of a `StepDriver`'s static steps from transformers' ``CompileConfig`` (None: its
    defaults): its backend, options and ``fullgraph``, ``dynamic=False``; on CUDA without a mode of its own (the
    driver records the CUDA graphs), elsewhere with the config's mode."""
    from transformers.generation import CompileConfig

    settings = (compile_config or CompileConfig()).to_dict()
    options = {"backend": settings.get("backend", "inductor"), "fullgraph": settings.get("fullgraph", False),
               "dynamic": False}
    if settings.get("options"):
        options["options"] = settings["options"]
    if device.type != "cuda" and settings.get("mode") not in (None, "reduce-overhead"):
        options["mode"] = settings["mode"]
    return options


_DRIVERS: weakref.WeakKeyDictionary[nn.Module, dict[str, StepDriver]] = weakref.WeakKeyDictionary()
"""Model -> its `StepDriver` per compile settings."""


def step_driver(model: nn.Module, compile_config: Any, device: torch.device, *, compiled: bool = True) -> StepDriver:
    """``model``'s `StepDriver` for transformers' ``compile_config`` (None: its defaults), made once: its static
    steps compiled (unless ``compiled`` is False) and, on CUDA, recorded as CUDA graphs."""
    options = step_options(compile_config, device) if compiled else None
    key = repr(sorted(options.items())) if options is not None else "eager"
    drivers = _DRIVERS.setdefault(model, {})
    if key not in drivers:
        step = functools.partial(hf_step, keyword=cache_keyword(model))
        drivers[key] = StepDriver(model, step, options, capture=device.type == "cuda")
    return drivers[key]


def hf_step(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache: Any, *, keyword: str) -> Any:
    """An HF causal LM's one-token step (`Forward`, with the model's cache ``keyword``): its output, logits of the
    last token only."""
    return model(input_ids=tokens, position_ids=positions, **{keyword: cache}, use_cache=True, logits_to_keep=1)


def recorded_steps(model: nn.Module) -> int:
    """CUDA graphs ``model``'s drivers have recorded so far (every cache, stage and batch)."""
    return sum(len(recordings) for driver in _DRIVERS.get(model, {}).values()
               for recordings in driver.recordings.values())


def forget_drivers(model: nn.Module) -> None:
    """Drop ``model``'s drivers (and their recordings): `flexentropy.disable`."""
    _DRIVERS.pop(model, None)
