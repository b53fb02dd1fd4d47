"""`DynamicPhase`: the dynamic half of a `StaticLatentKVCache` (design.md §2): the prompt, the ``decode_delay`` steps
before the first decision where they do not run in the prompt buffers, and a later turn's forward, on one
`PhaseOneLayer` per layer, the per-layer storage that transformers' cache protocol grows (`PolicyCache`'s reads and
checks).

Its `prepare` enters the static phase (`StaticPhase`) at the first decision point, or, with ``max_prompt_length``,
at the first step whose phase 1 fits the prompt buffers; before that, each layer's update is lent the prompt buffers
where its entries fit there (`StaticPhase.lend_prompt`), so that a prompt's KV is held once. Under compilation (a
model the user compiled whole) its reads and writes run eagerly, outside the graph, and ``update`` returns NaN
placeholders of the static shape: the attention reads the cache through ``attend``.
"""

from __future__ import annotations

from typing import Any

import torch

from flexentropy._compile import eager
from flexentropy.caches.latent_kv import LatentKVCache
from flexentropy.caches.layout import nan_entries
from flexentropy.caches.phase import CachePhase
from flexentropy.caches.policy_cache import PolicyCache
from flexentropy.caches.policy_layer import PolicyLayer
from flexentropy.caches.progress import Progress
from flexentropy.caches.static_phase import StaticPhase
from flexentropy.kv.decode_attention import decode_attention, grouped_attention


class PhaseOneLayer(PolicyLayer):
    """A `PolicyLayer` whose first ``decode_delay`` appends after its prompt write in place, into slots reserved past
    the prompt's entries (a phase-1 step on the dynamic path then copies nothing of the prompt)."""

    def __init__(self, policy: Any, *args: Any) -> None:
        super().__init__(policy, *args, reserve=policy.delay)


class DynamicPhase(CachePhase):
    """The dynamic phase of ``cache`` (module docstring).

    Args:
        cache: the `StaticLatentKVCache` (its layers, configuration, policy and checks).
        max_prompt_length: the longest prompt whose phase 1 runs in the prompt buffers (None: none does).

    Attributes:
        static: the static phase it enters, made with it (each of the two phases is the other's way out).
    """

    buffers = None

    def __init__(self, cache: LatentKVCache, max_prompt_length: int | None) -> None:
        self.cache = cache
        self.owner = type(cache).__name__
        self.static = StaticPhase(cache.config, cache.policy, cache.layers, self.owner, max_prompt_length, self)

    @property
    def layers(self) -> list[PolicyLayer]:
        return self.cache.layers

    @property
    def progress(self) -> Progress:
        return self.layers[0].progress

    # -- the step ------------------------------------------------------------------------------------------------
    def prepare(self, tokens: int) -> CachePhase:
        """Nothing for a prompt; for a later turn, the decisions due; at a one-token step the static phase where due
        (the first decision point, or phase 1 into the prompt buffers where it fits), else this phase (a phase-1
        step on the dynamic path)."""
        first = self.layers[0]
        if first.prompt_length is None:
            return self   # the prompt (or nothing yet)
        self._check_layers()
        if tokens != 1:   # a later turn: the dynamic path appends it
            self._decide_turn(tokens)
            return self
        if first.generated >= self.cache.config.decode_delay:
            return self.static.enter_from_layers(self.cache.policy.before_append(first, 1))
        if self.static.prompt_fits(first):
            return self.static.enter_prompt()
        return self

    def advance(self) -> None:
        """Nothing: the dynamic phase has no device counters."""

    def count(self, tokens: int) -> None:
        """Nothing: each layer counted its own appends (`PolicyLayer.update`)."""

    def _check_layers(self) -> None:
        missing = [layer.layer_idx for layer in self.layers if layer.prompt_length is None]
        if missing:
            raise RuntimeError(f"{self.owner} was built for {len(self.layers)} layers, but layers {missing} saw no "
                               f"prompt: pass model= (or num_layers= the model's count of attention layers)")
        sliding = [layer.layer_idx for layer in self.layers if layer.is_sliding]
        if sliding:
            raise ValueError(f"{self.owner} stores global-attention layers only; layers {sliding} attend a sliding "
                             f"window: use LatentKVCache")

    def _decide_turn(self, tokens: int) -> None:
        """A decision due at a later turn of ``tokens`` tokens, taken before the turn's queries are handed over (each
        layer's `PolicyLayer.update` would take it after them)."""
        for layer in self.layers:
            target = self.cache.policy.before_append(layer, tokens)
            if target is not None:
                layer.decide(target, tokens)

    # -- writes --------------------------------------------------------------------------------------------------
    def observe_queries(self, query_states: torch.Tensor, layer_idx: int) -> None:
        if torch.compiler.is_compiling():
            eager(PolicyCache.observe_queries, self.cache, query_states, layer_idx)
        else:
            PolicyCache.observe_queries(self.cache, query_states, layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            eager(self._update_layer, key_states, value_states, layer_idx)
            return nan_entries(key_states, value_states, self.static.capacity)
        return self._update_layer(key_states, value_states, layer_idx)

    def _update_layer(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer checked (`PolicyCache.checked_layer`), lent the prompt buffers where its entries fit there
        (`StaticPhase.lend_prompt`: a prompt's KV held once), then updated."""
        layer = self.cache.checked_layer(key_states, value_states, layer_idx)
        self.static.lend_prompt(layer, key_states, value_states)
        return layer.update(key_states, value_states)

    # -- reads ---------------------------------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, layer_idx: int, scale: float | None) -> torch.Tensor:
        layer = self.layers[layer_idx]
        if torch.compiler.is_compiling():
            return eager(layer_attention, layer, query, scale)
        return layer_attention(layer, query, scale)

    def entries(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        return layer.keys, layer.values

    def stored_length(self, layer_idx: int) -> int:
        if torch.compiler.is_compiling():   # 0 before the prompt, else the buffers' capacity
            return self.static.capacity if self.layers[layer_idx].is_initialized else 0
        return PolicyCache.stored_length(self.cache, layer_idx)

    def conversation(self) -> tuple[int, torch.Tensor | None]:
        return PolicyCache._conversation(self.cache)

    def seq_length(self, layer_idx: int) -> int:
        return self.layers[layer_idx].get_seq_length()

    def head_lengths(self, layer_idx: int) -> torch.Tensor:
        return self.layers[layer_idx].head_lengths()

    def mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """A prompt's own size; any later forward ``(C, 0)``, a constant (the steps ignore HF's mask)."""
        layer = self.layers[layer_idx]
        return layer.get_mask_sizes(query_length) if layer.prompt_length is None else (self.static.capacity, 0)

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        return PolicyCache.kept_positions(self.cache, layer_idx)

    def nbytes(self, layer_idx: int | None = None) -> int:
        return PolicyCache.nbytes(self.cache, layer_idx)


def layer_attention(layer: PolicyLayer, query: torch.Tensor, scale: float | None) -> torch.Tensor:
    """A step's attention on the dynamic path (a phase-1 step, or a later turn's tokens, causal among themselves),
    ``query [B, Hq, L, D]`` over the layer's entries under its own padding mask (HF's logical mask is not read) ->
    ``[B, Hq, L, Dv]``."""
    real = layer.real_entries()
    if real is None:
        return decode_attention(query, layer.keys, layer.values, scale=scale)
    entries = torch.arange(layer.keys.shape[-2], device=query.device)
    causal = entries <= entries[entries.shape[0] - query.shape[-2]:, None]    # [L, S]
    return grouped_attention(query, layer.keys, layer.values, real[:, :, None, :] & causal, scale)
