"""The one owner of a decode step over a `StaticLatentKVCache`: `begin_step` (the host's work before the forward),
`end_step` (the device's counters one token on, the host's count), and `StepDriver`, which runs a whole step
between them; and `step_driver`, each model's drivers, in one table.

A step's order is fixed here: the cache's ``prepare`` (the current phase's: entering or leaving the static phase, the
decisions due; it sets the phase the step runs in), then the forward, then the phase's ``advance`` (device) and
``count`` (host). Nothing else calls those three: ``generate``
and the engine's loops run a `StepDriver`; a forward that no driver runs (an eager ``generate``, a model the user
compiled, a hand loop) gets `begin_step` and `end_step` from the decoder's hooks that `flexentropy.enable` installs
(`flexentropy.integrations.hf.hooks`), and a loop over modules without them (`EntropyAttention`) calls both itself. A
driver's forwards carry `DRIVER_KWARG`, so that the hooks leave those steps to it.

A static step is the model's forward with every decoder layer in one compiled function (inductor, no CUDA graphs of
its own), each layer handed its `StepLayer` (`flexentropy.engine.compiled_layer`): dynamo traces one layer per stage,
not the whole model. On CUDA the driver records that step in one CUDA graph per (cache buffers, stage, batch) and
replays it: no guard, no launch and no host work between the replays but the decisions on the steps where the policy
decides. Observers (`observe_steps`) see every step of a model's drivers, for instrumentation.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flexentropy._compile import no_silent_fallback
from flexentropy.caches.keywords import DRIVER_KWARG, cache_keyword
from flexentropy.caches.static_latent import StaticLatentKVCache
from flexentropy.engine.compiled_layer import compiled_layers, layer_region

Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor, Any], Any]
"""``(model, tokens [B, L] int64, position_ids [B, L] int64, cache) -> output``: a model's step (`StepDriver`); a
model with flexentropy's hooks gets ``DRIVER_KWARG=True`` from it (`hf_step`)."""

Observer = Callable[[Any, torch.Tensor], AbstractContextManager[Any]]
"""``(cache, tokens [B, L]) -> context manager``: entered before a driver's step (before its decisions) and left after
it (`observe_steps`)."""


def begin_step(cache: Any, tokens: int) -> None:
    """The host's part before a forward of ``tokens`` tokens over ``cache``: a `StaticLatentKVCache` takes the
    decisions due, enters or leaves its static phase and makes the phase the forward runs in its current one
    (`StaticLatentKVCache.prepare`); other caches need nothing. A second call before `end_step` finds nothing left
    to do."""
    if isinstance(cache, StaticLatentKVCache):
        cache.prepare(tokens)


def end_step(cache: Any, tokens: int) -> None:
    """After the forward of a step begun by `begin_step` whose layers ran over the cache (not a driver's compiled or
    recorded step, which advances inside its own graph): the current phase's device counters one token on, and the
    host's count of it (`CachePhase.advance`, `CachePhase.count`: the static phase's; the dynamic phase's layers
    counted their own)."""
    if isinstance(cache, StaticLatentKVCache):
        cache.phase.advance()
        cache.phase.count(tokens)


@dataclass
class Recording:
    """A static step recorded as a CUDA graph: its input buffers and its output (overwritten by each replay)."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    output: Any


class StepDriver:
    """Runs a model's decode steps over `StaticLatentKVCache`s, each in the step's order (module docstring).

    - on the dynamic path (a prompt's phase 1 outside the prompt buffers, a later turn) and without compile options,
      the forward as it is, between `begin_step` and `end_step`;
    - in a static stage, the forward with its decoder layers compiled (`compiled_layers`) and the device counters'
      advance after it; with ``capture`` (CUDA), that step recorded once per (cache buffers, stage, batch) as a CUDA
      graph and replayed: recording runs the step twice on a side stream (compiling it the first time) and undoes
      what it changed (`StaticPhase.snapshot`), so the request's step is the first replay.

    A replay's output is the one object recorded with the graph; the next replay overwrites its tensors (read the
    logits before the next step, as ``generate`` and the greedy loops do).

    Args:
        model: the model (held weakly: the drivers live beside it, `step_driver`).
        forward: its step (`Forward`), eager.
        compile_options: ``torch.compile`` keywords of the static steps' decoder layers (None: static steps run
            ``forward`` eagerly, and nothing is recorded).
        capture: record static steps as CUDA graphs (the model on CUDA).
        observers: the `Observer` list the driver runs its steps inside (shared by a model's drivers).
    """

    def __init__(self, model: nn.Module, forward: Forward, compile_options: dict[str, Any] | None,
                 capture: bool, observers: list[Observer] | None = None) -> None:
        self.model = weakref.ref(model)
        self.forward = forward
        self.region = None if compile_options is None else layer_region(compile_options)
        self.capture = capture and self.region is not None
        self.recordings: weakref.WeakKeyDictionary[Any, dict[tuple, Recording]] = weakref.WeakKeyDictionary()
        self.pool: Any = None
        self.observers = [] if observers is None else observers

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        """One step of ``tokens [B, L]`` at ``positions [B, L]`` over ``cache``; the forward's output."""
        if not self.observers:
            return self._step(tokens, positions, cache)
        with contextlib.ExitStack() as stack:
            for observer in list(self.observers):
                stack.enter_context(observer(cache, tokens))
            return self._step(tokens, positions, cache)

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        model, length = self.model(), tokens.shape[1]
        begin_step(cache, length)
        phase = cache.phase if isinstance(cache, StaticLatentKVCache) else None
        if phase is None or phase.buffers is None or self.region is None:   # not a static stage, or not compiled
            output = self.forward(model, tokens, positions, cache)
            end_step(cache, length)
            return output
        if self.capture:
            recording = self._recording(model, cache, phase, tokens, positions)
            recording.tokens.copy_(tokens)
            recording.positions.copy_(positions)
            recording.graph.replay()
            output = recording.output
        else:
            output = self._static_step(model, tokens, positions, cache)
        phase.count(length)
        return output

    def _static_step(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        """A static step's device work: the forward with every decoder layer in the region (`compiled_layers`), then
        the counters' advance. The region holds up to ``flexentropy._compile.RECOMPILE_LIMIT`` graphs (stages,
        batch sizes, models of a process) and says so past them, instead of running its layers eagerly from then
        on."""
        with no_silent_fallback(), compiled_layers(model, self.region, cache):
            output = self.forward(model, tokens, positions, cache)
        cache.phase.advance()
        return output

    def _recording(self, model: nn.Module, cache: Any, phase: Any, tokens: torch.Tensor,
                   positions: torch.Tensor) -> Recording:
        """The recording of the step in ``phase`` (the cache's static phase) for its stage and this batch: made the
        first time (the step run twice, then recorded, each time undone: `StaticPhase.snapshot`)."""
        recordings = self.recordings.setdefault(cache, {})
        key = (id(phase.buffers), phase.buffers.version, tuple(tokens.shape))
        if key not in recordings:
            saved = phase.snapshot()
            inputs = tokens.clone(), positions.clone()
            side = torch.cuda.Stream(tokens.device)
            side.wait_stream(torch.cuda.current_stream(tokens.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._static_step(model, *inputs, cache)
                    phase.restore(saved)
            torch.cuda.current_stream(tokens.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self._static_step(model, *inputs, cache)
            phase.restore(saved)
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


def hf_step(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache: Any, *, keyword: str) -> Any:
    """An HF causal LM's one-token step (`Forward`, with the model's cache ``keyword``), marked as the driver's
    (`DRIVER_KWARG`): its output, logits of the last token only."""
    return model(input_ids=tokens, position_ids=positions, **{keyword: cache}, use_cache=True, logits_to_keep=1,
                 **{DRIVER_KWARG: True})


@dataclass
class ModelDrivers:
    """A model's drivers, per compile settings, and the observers they share."""

    drivers: dict[str, StepDriver] = field(default_factory=dict)
    observers: list[Observer] = field(default_factory=list)


_MODELS: weakref.WeakKeyDictionary[nn.Module, ModelDrivers] = weakref.WeakKeyDictionary()
"""Model -> its drivers: the one table of drivers."""


def step_driver(model: nn.Module, compile_config: Any, device: torch.device, *, compiled: bool = True) -> StepDriver:
    """``model``'s `StepDriver` for transformers' ``compile_config`` (None: its defaults), made once: its static
    steps compiled (unless ``compiled`` is False) and, on CUDA, recorded as CUDA graphs."""
    options = step_options(compile_config, device) if compiled else None
    key = repr(sorted(options.items())) if options is not None else "eager"
    entry = _MODELS.setdefault(model, ModelDrivers())
    if key not in entry.drivers:
        step = functools.partial(hf_step, keyword=cache_keyword(model))
        entry.drivers[key] = StepDriver(model, step, options, capture=device.type == "cuda",
                                        observers=entry.observers)
    return entry.drivers[key]


@contextlib.contextmanager
def observe_steps(model: nn.Module, observer: Observer) -> Iterator[None]:
    """Inside, every step a driver of ``model`` runs (its drivers now and later) runs inside ``observer(cache,
    tokens)``, e.g. to time it (``profiling/decode_timeline.py``)."""
    observers = _MODELS.setdefault(model, ModelDrivers()).observers
    observers.append(observer)
    try:
        yield
    finally:
        observers.remove(observer)


def recorded_steps(model: nn.Module) -> int:
    """CUDA graphs ``model``'s drivers have recorded so far (every cache, stage and batch)."""
    entry = _MODELS.get(model)
    drivers = entry.drivers.values() if entry is not None else ()
    return sum(len(recordings) for driver in drivers for recordings in driver.recordings.values())


def forget_drivers(model: nn.Module) -> None:
    """Drop ``model``'s drivers (and their recordings): `flexentropy.disable`."""
    _MODELS.pop(model, None)
