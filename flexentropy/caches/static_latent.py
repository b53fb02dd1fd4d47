"""`StaticLatentKVCache`: the latent cache (`LatentKVCache`) with static shapes after its first eviction, so that
decode steps can be captured (CUDA graphs) and replayed with no host work but the decisions.

Phases (design.md §2):

1. the prompt and the first ``decode_delay`` generated tokens run on the dynamic path, one `PolicyLayer` per layer
   (the prompt's whole KV is held; its length varies from request to request); or, for a cache with
   ``max_prompt_length``, the prompt's keys and values are written into the prompt buffers
   (``max_prompt_length + decode_delay`` entries per KV head; the layers read views of them, so the prompt's KV is
   held once) and the phase-1 steps run there, static like phase 2;
2. from the first decision point on, the buffers (``decode_budget + recompress_every`` entries per KV head).

This class is the transformers-facing facade: the ``Cache`` API over its current phase (`CachePhase`), the dynamic
one (`DynamicPhase`, ``cache.dynamic``: the layers) or the static one (`StaticPhase`, ``cache.static``: buffers,
batch rows, decisions, the step's attention), each offering the same reads and writes. Who prepares, runs and
advances a step is the decode engine's driver (`flexentropy.engine.driver`): its prepare step (`prepare`) sets the
current phase. ``generate``, `flexentropy.greedy_generate` and `flexentropy.generate_batch` run it, and on a model
switched by `flexentropy.enable` the decoder's hooks call it around the forwards no driver runs; a loop over modules
without the hooks (`EntropyAttention`) calls its `begin_step` and `end_step` itself. Decisions are taken before the
step's queries are handed over (transformers' order: ``update`` before the queries), so for an attention that hands
its queries over before ``update`` (`EntropyAttention`) the window of a decision ends one step earlier than with
`LatentKVCache`.

A cache serves one conversation at a time, or, `open` for batch rows, one request per row (`insert`, `free`). A
forward of several tokens after decoding began is the conversation's next turn: the entries go back to the layers
for that forward (the dynamic path appends it) and the next step enters the buffers again, at the same addresses.
``reset()`` empties the cache for a new request and keeps its buffers. Padding of a left-padded batch is read from
the prompt (``observe_padding``); decode steps ignore the logical attention mask and attend with the cache's own
validity. Beam search is not supported.
"""

from __future__ import annotations

from typing import Any

import torch

from flexentropy._checks import check_int
from flexentropy.caches.dynamic_phase import DynamicPhase, PhaseOneLayer
from flexentropy.caches.latent_kv import LatentKVCache
from flexentropy.caches.phase import CachePhase
from flexentropy.caches.progress import Progress
from flexentropy.caches.static_buffers import StaticBuffers
from flexentropy.config import EntropyConfig


class StaticLatentKVCache(LatentKVCache):
    """`LatentKVCache` with static shapes after the first eviction, for captured decoding (module docstring).

    Same decisions as `LatentKVCache` (taken before each step's queries are handed over), same configuration;
    ``recompress_every`` must be set (the buffers hold ``decode_budget + recompress_every`` entries per KV head).
    transformers' ``generate`` decodes over it with flexentropy's step driver (the cache is ``is_compileable``); pass
    ``model=``::

        cache = fe.StaticLatentKVCache(cfg, model=model)
        out = model.generate(ids, cache=cache, max_new_tokens=256)   # past_key_values= before transformers 5.24

    Serve a server's requests with one cache and ``cache.reset()`` before each new prompt: the cache owns its buffers
    and `reset` keeps them, so the recorded steps replay at the addresses they were recorded with. Another batch
    size after ``reset()`` allocates new buffers (and records the steps again).

    With ``max_prompt_length``, phase 1 is static too: the prompt's keys and values go straight into prompt buffers
    of ``max_prompt_length + decode_delay`` entries per KV head, kept across requests (made at the first prompt, or
    by `flexentropy.warm_up`), which the layers read as views, and the ``decode_delay`` steps before the first
    eviction run there as one more recorded step; a longer prompt keeps tensors of its own and runs its phase 1 on
    the dynamic path, beside the prompt buffers (size ``max_prompt_length`` for the longest prompt served). The
    decisions, and so the tokens, are the same either way; the prompt buffers hold as much as a dense static cache
    of that length, and the prompt's KV is held once.

    Args:
        config: the `EntropyConfig` (its ``decode_*`` fields and ``recompress_every``).
        model: the HF model served: its layer count.
        num_layers: the layer count without a model (a plain loop then calls the driver's `begin_step` and
            `end_step` itself).
        max_prompt_length: the longest prompt whose phase 1 runs static (None: phase 1 on the dynamic path).

    Attributes:
        phase: the current phase (`CachePhase`), ``dynamic`` or ``static``.
        dynamic: the dynamic phase (`DynamicPhase`: the layers).
        static: the static phase (`StaticPhase`: its buffers ``main`` and ``prompt``, the stage in use, the query
            windows and the batch rows with their counts).
    """

    layer_class = PhaseOneLayer

    def __init__(self, config: EntropyConfig | None = None, *, model: Any = None,
                 num_layers: int | None = None, max_prompt_length: int | None = None) -> None:
        super().__init__(config, model=model, num_layers=num_layers)
        if max_prompt_length is not None:
            check_int(type(self).__name__, "max_prompt_length", max_prompt_length, 1)
        if self.config.recompress_every is None:
            raise ValueError("StaticLatentKVCache needs EntropyConfig.recompress_every (its buffers hold "
                             "decode_budget + recompress_every entries per KV head); None grows without bound")
        if self.num_layers is None:
            raise ValueError("StaticLatentKVCache needs model= or num_layers= (its layers exist before the prompt, "
                             "so that transformers sees a compileable cache)")
        self._layer(self.num_layers - 1)
        self.max_prompt_length = max_prompt_length
        self.dynamic = DynamicPhase(self, max_prompt_length)
        self.static = self.dynamic.static
        self.phase: CachePhase = self.dynamic

    def reset(self) -> None:
        """Empty the cache for a new request; the buffers stay (their addresses with them)."""
        super().reset()
        self.static.clear()
        self.phase = self.dynamic

    def prepare(self, tokens: int) -> None:
        """The host's part of a step before a forward of ``tokens`` tokens: the current phase's `CachePhase.prepare`
        (the decisions due, entering or leaving the static buffers), whose answer is the phase the forward runs in.
        The decode engine's driver calls it (`flexentropy.engine.begin_step`)."""
        self.phase = self.phase.prepare(tokens)

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def capacity(self) -> int:
        """``C``: entries per KV head of the static phase's buffers."""
        return self.static.capacity

    @property
    def main(self) -> StaticBuffers:
        """The static phase's buffers (`capacity` entries per KV head)."""
        return self.static.main

    @property
    def prompt(self) -> StaticBuffers | None:
        """The captured phase 1's buffers, or None."""
        return self.static.prompt

    @property
    def stage(self) -> StaticBuffers | None:
        """The buffers the steps use now (``main`` or ``prompt``), None on the dynamic path."""
        return self.phase.buffers

    @property
    def is_static(self) -> bool:
        """Whether the cache is in its static phase proper (the next one-token step reads ``main``)."""
        return self.phase.buffers is self.main

    @property
    def evictions(self) -> int:
        """Decisions that evicted so far (the first eviction, then the recompressions)."""
        return self.phase.evictions

    @property
    def progress(self) -> Progress:
        """The cache's counts, when every row shares them (one request, or a left-padded batch taken together); rows
        served one by one (`insert`) have their own."""
        return self.phase.progress

    # -- rows served one by one ----------------------------------------------------------------------------------------
    def open(self, rows: int, source: LatentKVCache) -> None:
        """Serve ``rows`` requests at once, each entered on its own (`insert`): the cache emptied, buffers for
        ``rows`` batch rows shaped like ``source``'s (a one-row cache after its prompt), every row idle; the rows then
        decode together, each deciding on its own count."""
        self.reset()
        self.static.open(rows, source)
        self.phase = self.static

    def insert(self, row: int, source: LatentKVCache) -> None:
        """Put the request that ``source`` holds (a one-row latent cache after its prompt, evicted to the budget:
        ``decode_delay=0``) in batch row ``row`` of an `open` cache; the row's next step is that request's."""
        self.static.insert(row, source)

    def free(self, row: int) -> None:
        """Batch row ``row`` of an `open` cache is idle from its next step (its entries are left to be overwritten)."""
        self.static.free(row)

    # -- the Cache API, on the current phase ---------------------------------------------------------------------------
    def _conversation(self) -> tuple[int, torch.Tensor | None]:
        """``(tokens, padding)`` of the conversation held (`PolicyCache._conversation`): the current phase's."""
        return self.phase.conversation()

    def _check_depth(self, num_layers: int, held: int) -> None:
        """Raise ``ValueError`` unless the model has the layer count the cache was built for (its layers and buffers
        are that many), whatever it holds (``held``)."""
        if num_layers != len(self.layers):
            raise ValueError(f"{type(self).__name__} was built for {len(self.layers)} layers, but a model of "
                             f"{num_layers} layers runs on it: pass model= (or num_layers= the model's count of "
                             f"attention layers)")

    def _seen(self, layer_idx: int) -> int:
        """Tokens layer ``layer_idx`` has seen: its own count on the dynamic path, the conversation's in a static
        stage (every layer's, counted after the step)."""
        return self.layers[layer_idx].seen if self.phase.buffers is None else self.phase.conversation()[0]

    def _check_layer_idx(self, layer_idx: int) -> None:
        if layer_idx >= len(self.layers):
            raise ValueError(f"{type(self).__name__} was built for {len(self.layers)} layers, got layer_idx "
                             f"{layer_idx}: pass model= (or num_layers= the model's count of attention layers)")

    def observe_queries(self, query_states: torch.Tensor, layer_idx: int) -> None:
        self.phase.observe_queries(query_states, layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer_idx(layer_idx)
        self._check_driven(layer_idx, key_states.shape[-2])
        return self.phase.update(key_states, value_states, layer_idx)

    def attend(self, query: torch.Tensor, layer_idx: int, attention_mask: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
        """Decode attention of layer ``layer_idx``'s newest tokens over what it holds; ``attention_mask`` is not read
        (padding comes from ``observe_padding``)."""
        return self.phase.attend(query, layer_idx, scale)

    def stored_entries(self, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[B, Hkv, S, D]`` layer ``layer_idx`` holds now (views of the buffers when static)."""
        return self.phase.entries(layer_idx)

    def stored_length(self, layer_idx: int = 0) -> int:
        """Entries held per KV head; under compilation a constant (0 before the prompt, else ``C``), so that a
        compiled step never depends on the count."""
        self._check_layer_idx(layer_idx)
        return self.phase.stored_length(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Logical length (the next token's position); under compilation in a static stage the 0-dim tensor of the
        counters (as transformers' ``StaticCache``), so that the compiled step does not depend on it."""
        return self.phase.seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """A prompt: its own size; any later forward ``(C, 0)``, a constant (the steps ignore HF's mask): one mask
        shape for every decode graph."""
        return self.phase.mask_sizes(query_length, layer_idx)

    def head_lengths(self, layer_idx: int = 0) -> torch.Tensor:
        return self.phase.head_lengths(layer_idx)

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor:
        return self.phase.kept_positions(layer_idx)

    def nbytes(self, layer_idx: int | None = None) -> int:
        """Bytes held: on the dynamic path the layers' (`PolicyCache.nbytes`); in a static stage the buffers' whole
        capacity, prompt buffers and query windows included (a layer's share for ``layer_idx``)."""
        return self.phase.nbytes(layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support beam search; use LatentKVCache")

    def _select_rows(self, rows: torch.Tensor, where: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps its batch rows in buffers of its batch size and does "
                                  f"not repeat or select them ({where}): call cache.reset() and run the prompt with "
                                  f"the rows you want, or use LatentKVCache")
