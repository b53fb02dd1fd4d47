"""`StaticLatentKVCache`: the latent cache (`LatentKVCache`) with static shapes after its first eviction, so that
decode steps can be captured (CUDA graphs, ``torch.compile(mode="reduce-overhead")``, transformers' compiled
``generate``).

Two phases per layer (design.md §2):

1. prompt and the first ``decode_delay`` generated tokens: the dynamic `PolicyLayer` path, unchanged (the prompt's
   whole KV is held, its length varies from request to request); or, for a cache with ``max_prompt_length``, the
   phase-1 steps in prompt buffers of ``max_prompt_length + decode_delay`` entries per KV head, static like phase 2
   (same attention, writes and bookkeeping over other buffers: one more captured graph, the same decisions);
2. from the step at which the latent policy first decides on: preallocated buffers ``keys [B, Hkv, C, D]``,
   ``values [B, Hkv, C, Dv]`` and the query window ``[B, Hq, W, D]``, ``C = decode_budget + recompress_every``
   (`StaticLatentLayer.capacity`). A decode step writes its token in place at a slot held in a tensor and attends
   over the whole buffer with a validity mask (or, unpadded, over the first ``slot + 1`` slots with flash-attn-4's
   kernel: `EntropyConfig.decode_kernel`); nothing of its shapes changes from step to step or request to request.

Every decision (the first eviction, each recompression) and the per-step bookkeeping run in `prepare`, eagerly,
*before* the forward of the step: a step never decides inside a captured region. `prepare(q_len)` must run before
every forward, once. On a model switched by `flexentropy.enable`, a forward pre-hook on the decoder calls it eagerly
(`before_forward`, unless it already ran for the step: a loop over an HF model may call it too, or not at all), and
transformers' compiled ``generate`` calls it before each compiled static step (`prepared`: the hook then traces to
nothing and the step is one graph); both are installed by `flexentropy.integrations.hooks`. A loop over a cache
without such a hook (own modules, ``num_layers=``) calls it itself before each forward
(`flexentropy.decoding.greedy_decode`). Decisions are therefore taken before the step's queries
are handed over (transformers' attention order: ``update`` before the queries), so for an attention that hands its
queries over before ``update`` (`EntropyAttention`) the window of a decision ends one step earlier than with
`LatentKVCache`.

A cache serves one conversation. A forward of several tokens after decoding began is its next turn: the layers leave
their buffers for that forward (`StaticLatentLayer.begin_turn`; the dynamic path appends it) and the next step
re-enters them. A new prompt needs a new cache, or ``reset()``.

Under ``torch.compile`` the phase-1 steps run their cache work eagerly (excluded from tracing) and return fixed-shape
placeholders, and the cache's size queries return constants, so one compiled decode graph per phase serves every
prompt length. Padding of a left-padded batch is read from the prompt (``observe_padding``); decode steps ignore the
logical attention mask and attend with the cache's own validity mask. Beam search (``reorder_cache``) is not
supported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from flexentropy._checks import check_int
from flexentropy._compile import eager
from flexentropy.caches.latent_kv import LatentKVCache
from flexentropy.caches.policy_cache import PolicyCache
from flexentropy.caches.policy_layer import PolicyLayer, nan_entries, tensor_bytes
from flexentropy.config import EntropyConfig
from flexentropy.kv.decode import decode_attention, flash_decode, flash_decode_usable, grouped_attention


def _taken_when_read(name: str) -> property:
    """`PolicyLayer` attribute ``name`` as a property of `StaticLatentLayer` that brings the layer's views up to date
    (`StaticLatentLayer._refresh`) before it is read or replaced."""
    private = f"_{name}"

    def get(self: StaticLatentLayer) -> torch.Tensor | None:
        if self._stale:
            self._refresh()
        return getattr(self, private)

    def set(self: StaticLatentLayer, value: torch.Tensor | None) -> None:
        if self._stale:
            self._refresh()
        setattr(self, private, value)

    return property(get, set)


class StaticLatentLayer(PolicyLayer):
    """One layer of a `StaticLatentKVCache` (module docstring). Besides `PolicyLayer`'s state:

    Attributes:
        static: whether the layer is in its static phase (buffers in use: the prompt buffers or the buffers).
        capacity: ``C``, entries per KV head the buffers hold.
        buffers: the static phase's buffers (``keys``, ``values``, ``real``, ``slots``, and the query ``window``).
        prompt_buffers: the captured phase 1's ``keys``, ``values``, ``real``, ``slots`` (`prompt_capacity` entries;
            the window stays in ``buffers``); empty unless the cache has a ``max_prompt_length``.
        prompt_capacity: entries per KV head of the prompt buffers, or None (phase 1 runs on the dynamic path).
        active: the buffers the steps write and read now (``buffers`` or ``prompt_buffers``).
        slot: int64 ``[1]`` the buffer slot the next token is written to (shared by the cache's layers).
        position: int64 0-dim, the logical position of the next token (shared; ``get_seq_length`` under compile).
        lengths: int32 ``[B]``, the slots written so far (``slot + 1`` per row; shared), for `flash_decode`.
        kernel: `EntropyConfig.decode_kernel`; ``flash``: whether the static steps run `flash_decode` (decided
            at the phase switch).
    """

    is_compileable = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.prompt_buffers: dict[str, torch.Tensor] = {}
        self.prompt_capacity: int | None = None
        self._stale = False   # `keys`/`values`/`window` lag behind `_live` until read (`_refresh`)
        super().__init__(*args, **kwargs)
        self.capacity = self.policy.budget + self.policy.recompress_every
        # phase 1 appends one token a step to the whole prompt's entries: in place, not a copy of them per step
        self.reserve = self.policy.delay
        self.slot: torch.Tensor | None = None
        self.position: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.kernel = "auto"

    def _clear(self) -> None:
        self._stale = False
        super()._clear()
        self.static = False
        self.flash = False
        self.active = self.buffers
        self._live = 0   # entries in the buffers (static): `stored`

    # -- the views of the buffers' live parts, taken when read: a static step only counts ----------------------------
    def _refresh(self) -> None:
        self._stale = False
        self._view(self._live)

    keys = _taken_when_read("keys")
    values = _taken_when_read("values")
    window = _taken_when_read("window")

    @property
    def stored(self) -> int:
        """Entries held per KV head (`PolicyLayer.stored`); static: the count, without taking the views."""
        return self._live if self.static else super().stored

    # -- phase 2: eager bookkeeping (`prepare`) ------------------------------------------------------------------
    def _allocate(self, stage: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], like: torch.Tensor,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
        """The preallocated buffer ``name`` of ``stage`` (`buffers` or `prompt_buffers`), kept across requests of the
        same shapes (`reset` leaves it)."""
        dtype = like.dtype if dtype is None else dtype
        buffer = stage.get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype or buffer.device != like.device:
            buffer = static_buffer(shape, dtype, like.device)
            stage[name] = buffer
        return buffer

    def prompt_fits(self) -> bool:
        """Whether phase 1 runs captured: the cache has prompt buffers, nothing was evicted yet, and the prompt with the
        tokens still to come before the first decision fits them."""
        delay = self.policy.delay
        return (self.prompt_capacity is not None and self.evictions == 0 and self.generated < delay
                and self.stored + delay - self.generated <= self.prompt_capacity)

    def _enter(self, stage: dict[str, torch.Tensor]) -> None:
        """Move the stored entries (and, from the dynamic path, the query window) into ``stage``'s buffers: the switch
        to the captured phase 1 (`prompt_buffers`) or to the static phase (`buffers`)."""
        if self.ragged is not None or self.window is None:
            raise RuntimeError(f"{self.owner} layer {self.layer_idx}: cannot switch to static buffers "
                               f"(ragged layer or no queries handed over)")
        batch, kv_heads, self._live, dim = self.keys.shape
        size = self.capacity if stage is self.buffers else self.prompt_capacity
        self._allocate(stage, "keys", (batch, kv_heads, size, dim), self.keys)
        self._allocate(stage, "values", (batch, kv_heads, size, self.values.shape[-1]), self.values)
        self._allocate(stage, "real", (batch, kv_heads, 1, size), self.keys, torch.bool)
        slots = self._allocate(stage, "slots", (size,), self.keys, torch.long)
        slots.copy_(torch.arange(size, device=self.keys.device))
        if not self.static:   # the window comes from the dynamic path; from the prompt buffers it is in place
            window = self.policy.window
            self._allocate(self.buffers, "window", (*self.window.shape[:2], window, self.window.shape[-1]), self.window)
            self.buffers["window"][:, :, window - self.window.shape[2]:].copy_(self.window)
        self.static = True
        self.active = stage
        self.flash = flash_decode_usable(self.kernel, self.keys, padded=self.padding is not None)
        self._store()
        self._spare.clear()   # phase 1's prompt-sized buffers

    def _store(self) -> None:
        """Write the compact `keys`/`values` to the buffers' front (`store_entries`)."""
        real = self.real_entries() if self.keys.shape[-2] else None
        store_entries([self], self.keys[None], self.values[None], None if real is None else real[None])

    def _view(self, stored: int) -> None:
        """Point ``keys``/``values``/``window`` (what policies and readers see) at the buffers' live parts."""
        self._live = stored
        self._keys = self.active["keys"][:, :, :stored]
        self._values = self.active["values"][:, :, :stored]
        held = min(self.policy.window, self.observed)
        self._window = self.buffers["window"][:, :, self.policy.window - held:]

    def due(self, q_len: int) -> bool:
        """Whether the next step (``q_len`` tokens) runs on static buffers: the layer is static, its policy has
        reached its first decision point (``decode_delay`` generated tokens), or the prompt fits the prompt buffers."""
        return self.static or (self.prompt_length is not None
                               and (self.generated >= self.policy.delay or self.prompt_fits()))

    def begin_step(self, q_len: int, target: int | None) -> int:
        """Eager part of a static step: apply the decision ``target`` (`policy.before_append`, None: none); enter the
        prompt buffers at the first step of a captured phase 1, the buffers at the first decision point; account for
        the step's token. Returns the slot it is written to."""
        if target is not None:
            self.decide(target, q_len)
        stage = self.prompt_buffers if target is None and self.prompt_fits() else self.buffers
        if not self.static or stage is not self.active:
            self._enter(stage)
        elif target is not None:
            self._store()  # the gathered entries: fresh tensors, not views of the buffers
        return self.advance(q_len)

    def advance(self, q_len: int) -> int:
        """Account for a static step's ``q_len`` tokens (after any decision); returns the slot the first is written
        to."""
        slot = self.stored
        self.previous_generated = self.generated
        self.seen += q_len
        self.observed += q_len
        self._live = slot + q_len
        self._stale = True
        return slot

    def begin_turn(self, q_len: int) -> None:
        """Eager part of a later turn's forward (``q_len`` tokens after decoding began): leave the buffers (the held
        entries and the query window are copied out; the forward appends to them on the dynamic path, and the next
        one-token step re-enters the buffers at the same addresses, `begin_step`), and apply a due decision now,
        before the turn's queries are handed over, as for every other step."""
        if self.static:
            self.keys, self.values, self.window = self.keys.clone(), self.values.clone(), self.window.clone()
            self.static = self.flash = False
        target = self.policy.before_append(self, q_len)
        if target is not None:
            self.decide(target, q_len)

    # -- phase 2: the captured step -----------------------------------------------------------------------------
    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token's ``[B, Hkv, 1, D]`` key and value at `slot`, in place; returns the whole buffers
        ``[B, Hkv, C, D]`` (static shapes)."""
        keys, values = self.active["keys"], self.active["values"]
        keys.index_copy_(2, self.slot, key_states.to(keys.dtype))
        values.index_copy_(2, self.slot, value_states.to(values.dtype))
        return keys, values

    def shift_window(self, query_states: torch.Tensor) -> None:
        """Append one step's queries ``[B, Hq, 1, D]`` to the window buffer, dropping its oldest, in place."""
        window = self.buffers["window"]
        window.copy_(torch.cat([window[:, :, query_states.shape[2]:], query_states.to(window.dtype)], dim=2))

    def valid(self) -> torch.Tensor:
        """bool ``[B, Hkv, 1, C]``: the slots written so far (this step's included) that are not padding."""
        return (self.active["slots"] <= self.slot) & self.active["real"]

    def attend_static(self, query: torch.Tensor, scale: float | None) -> torch.Tensor:
        """``[B, Hq, 1, Dv]``: the step's attention over the buffers, the first `lengths` slots of each row with
        `flash_decode`, else under `valid` (GQA folded, one SDPA call)."""
        if self.flash:
            return flash_decode(query, self.active["keys"], self.active["values"], self.lengths, scale)
        return grouped_attention(query, self.active["keys"], self.active["values"], self.valid(), scale)

    def placeholder(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-memory NaN tensors ``[B, Hkv, C, D]`` returned by a phase-1 step under compilation (fixed shapes)."""
        return nan_entries(key_states, value_states, self.capacity)

    def attend_own_mask(self, query: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Phase-1 decode attention (or a later turn's, causal over its ``L`` tokens) with the layer's own padding mask
        (HF's logical mask is not read)."""
        real = self.real_entries()
        if real is None:
            return decode_attention(query, self.keys, self.values, scale=scale)
        entries = torch.arange(self.keys.shape[-2], device=query.device)
        causal = entries <= entries[entries.shape[0] - query.shape[-2]:, None]    # [L, S]
        return grouped_attention(query, self.keys, self.values, real[:, :, None, :] & causal, scale)

    # -- readers ------------------------------------------------------------------------------------------------
    @property
    def slots_in_use(self) -> int:
        """Entries per KV head of the buffers a step writes now: `prompt_capacity` in a captured phase 1, else
        `capacity`."""
        return self.prompt_capacity if self.static and self.active is self.prompt_buffers else self.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """A prompt: its own size; a decode step: ``(C, 0)``, a constant (the step ignores HF's mask), also in a
        captured phase 1 and before the step that enters the buffers (HF may size the mask before `prepare`): one mask
        shape for every decode graph. A static step reads only the ``static`` flag: a traced read of the prompt's
        length would specialise the graph to it."""
        if not self.static and self.prompt_length is None:
            return super().get_mask_sizes(query_length)
        return self.capacity, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{self.owner} does not support beam search; use LatentKVCache")

    def reset(self) -> None:
        """Drop the state, keep the buffers (a new request of the same shapes reuses them and their addresses)."""
        self._clear()

    def nbytes(self) -> int:
        """Bytes held: the buffers once static (their full capacity), else `PolicyLayer.nbytes`."""
        if not self.static:
            return super().nbytes()
        return tensor_bytes(self._kept, *self.buffers.values(), *self.prompt_buffers.values())


class StaticLatentKVCache(LatentKVCache):
    """`LatentKVCache` with static shapes after the first eviction, for captured decoding (module docstring).

    Same decisions as `LatentKVCache` (with the decision taken before each step's queries are handed over), same
    configuration; ``recompress_every`` must be set (the buffers hold ``decode_budget + recompress_every``
    entries per KV head). ``transformers``' ``generate`` compiles its decode forward for it (the cache is
    ``is_compileable``); pass ``model=`` so that the cache's `prepare` runs before every forward::

        cache = fe.StaticLatentKVCache(cfg, model=model)
        out = model.generate(ids, cache=cache, max_new_tokens=256)   # past_key_values= before transformers 5.24

    Serve a server's requests with one cache and ``cache.reset()`` before each new prompt: the cache owns its buffers
    and `reset` keeps them, so the captured step replays at the addresses it was recorded with (`static_buffer`); a
    new cache allocates new ones, and the step is recorded again for them.

    With ``max_prompt_length``, phase 1 is captured too: the first step copies the prompt's entries into prompt buffers
    of ``max_prompt_length + decode_delay`` entries per KV head, kept across requests like the buffers, and the
    ``decode_delay`` steps before the first eviction run there as one more compiled graph (read over the valid entries
    only, with flash-attn-4's kernel where it runs); a longer prompt runs its phase 1 eagerly, as without it. The
    decisions, and so the tokens, are the same either way; the prompt buffers hold as much as a dense static cache of
    that length.

    Args:
        config: the `EntropyConfig` (its ``decode_*`` fields and ``recompress_every``).
        model: the HF model served: its layer count, and the pre-hook on its decoder that calls `prepare`.
        num_layers: layer count without a model (a plain loop then calls `prepare` itself).
        max_prompt_length: the longest prompt whose phase 1 runs captured (None: phase 1 runs eagerly on the prompt's
            own tensors, and nothing of the prompt is held between requests).
    """

    layer_class = StaticLatentLayer

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
        self.counters: dict[str, torch.Tensor] = {}
        self._place_counters(torch.device("cpu"), 1)
        self.max_prompt_length = max_prompt_length
        for layer in self.layers:
            layer.kernel = self.config.decode_kernel
            if max_prompt_length is not None and self.config.decode_delay:
                layer.prompt_capacity = max_prompt_length + self.config.decode_delay
        self._prepared = False      # set while a caller that already ran `prepare` runs the forward (`prepared`)
        self._hooked = False        # a pre-hook calls `before_forward` (set at its first call, the prompt's forward)
        self._armed = False         # `prepare` ran for the coming forward, which the hook must not prepare again

    def _place_counters(self, device: torch.device, batch: int) -> None:
        """(Re)allocate the shared counters `slot`, `position`, `lengths` on ``device`` for ``batch`` rows."""
        for name, shape, dtype in (("slot", (1,), torch.long), ("position", (), torch.long),
                                   ("lengths", (batch,), torch.int32)):
            self.counters[name] = static_buffer(shape, dtype, device)
        self.slot, self.position, self.lengths = (self.counters[name] for name in ("slot", "position", "lengths"))
        for layer in self.layers:
            layer.slot, layer.position, layer.lengths = self.slot, self.position, self.lengths

    def reset(self) -> None:
        """Empty every layer for a new request; the buffers stay (their addresses with them)."""
        super().reset()
        self._armed = False

    @property
    def capacity(self) -> int:
        """``C``: entries per KV head of each layer's buffers."""
        return self.layers[0].capacity

    def prepare(self, q_len: int) -> None:
        """Eager work before a forward of ``q_len`` tokens (module docstring): nothing for a prompt or a phase-1
        step; for a static step, every due decision (a recompression of every layer as one, `decide_together`),
        then the step's slot and position; before a later turn (several tokens after decoding began), the switch
        back to the dynamic path.

        Once per step: on a cache built with ``model=``, a second call before the step's forward does nothing, and
        the model's pre-hook does not prepare a step that was prepared by hand."""
        if self._armed:
            return
        layers = [layer for layer in self.layers if layer.due(q_len)]
        if not layers:
            return
        if len(layers) != len(self.layers):
            raise RuntimeError(f"{type(self).__name__}: layers disagree on the decode phase; every layer must see "
                               f"every forward")
        if q_len != 1:   # a later turn of the conversation: the dynamic path appends it (`begin_turn`)
            for layer in layers:
                layer.begin_turn(q_len)
            return
        targets = [layer.policy.before_append(layer, q_len) for layer in layers]
        if targets[0] is not None and len(set(targets)) == 1 and stackable(layers):
            decide_together(layers, targets[0], q_len)
            slots = {layer.advance(q_len) for layer in layers}
        else:
            slots = {layer.begin_step(q_len, target) for layer, target in zip(layers, targets, strict=True)}
        if len(slots) != 1:
            raise RuntimeError(f"{type(self).__name__}: layers hold different entry counts {sorted(slots)}")
        device, batch = layers[0].keys.device, layers[0].keys.shape[0]
        if self.slot.device != device or self.lengths.shape[0] != batch:
            self._place_counters(device, batch)
        slot = slots.pop()
        self.slot.fill_(slot)
        self.lengths.fill_(slot + 1)
        self.position.fill_(layers[0].seen - q_len)
        self._armed = self._hooked

    def before_forward(self, q_len: int) -> None:
        """What a pre-hook on the model's decoder runs before each forward (`flexentropy.enable` installs it):
        `prepare`, unless it already ran for this step."""
        self._hooked = True
        self.prepare(q_len)
        self._armed = False

    @property
    def prepared_by_caller(self) -> bool:
        """Whether the forward running now was prepared by its caller (`prepared`): a pre-hook then does nothing."""
        return self._prepared

    @contextlib.contextmanager
    def prepared(self, q_len: int) -> Iterator[None]:
        """Run `prepare` now, and let the forward inside the block skip it: the decoder's pre-hook then traces to
        nothing, so a compiled static step is one graph (an eager hook inside it would break it in two, each
        entered, guarded and replayed separately at every step)."""
        self.prepare(q_len)
        self._prepared = True
        try:
            yield
        finally:
            self._prepared = self._armed = False

    @property
    def is_static(self) -> bool:
        """Whether every layer is in its static phase (the next decode step can run captured)."""
        return all(layer.static for layer in self.layers)

    # -- the hand-over, static where it can be -------------------------------------------------------------------
    def observe_queries(self, query_states: torch.Tensor, layer_idx: int) -> None:
        layer = self.layers[layer_idx]
        if layer.static:
            layer.shift_window(query_states)
        elif torch.compiler.is_compiling():
            eager(PolicyCache.observe_queries, self, query_states, layer_idx)
        else:
            super().observe_queries(query_states, layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if layer.static:
            return layer.write(key_states, value_states)
        if torch.compiler.is_compiling():
            eager(PolicyCache.update, self, key_states, value_states, layer_idx)
            return layer.placeholder(key_states, value_states)
        return super().update(key_states, value_states, layer_idx)

    def attend(self, query: torch.Tensor, layer_idx: int, attention_mask: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
        """Decode attention of layer ``layer_idx``'s newest token over the buffers (static) or what it holds;
        ``attention_mask`` is not read (padding comes from ``observe_padding``)."""
        layer = self.layers[layer_idx]
        if layer.static:
            return layer.attend_static(query, scale)
        if torch.compiler.is_compiling():
            return eager(layer.attend_own_mask, query, scale)
        return layer.attend_own_mask(query, scale)

    def stored_length(self, layer_idx: int = 0) -> int:
        """Entries held per KV head; under compilation a constant (0 before the prompt, else ``C``), so that a
        compiled step never depends on the count."""
        layer = self.layers[layer_idx]
        if torch.compiler.is_compiling():
            return layer.capacity if layer.is_initialized else 0
        return layer.stored

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Logical length; under compilation in the static phase the 0-dim tensor `position` (as transformers'
        ``StaticCache``), so that the compiled step does not depend on it."""
        layer = self.layers[layer_idx]
        if layer.static and torch.compiler.is_compiling():
            return self.position
        return layer.get_seq_length()


# -- static buffers ------------------------------------------------------------------------------------------------
def static_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new zeroed buffer whose address a captured step may keep, marked a static address for dynamo.

    A CUDA graph reads its static inputs at the addresses it was recorded with, and torch's CUDA graph trees
    (``mode="reduce-overhead"``) record the whole step again for every new address, keeping every recording: the
    cache keeps its buffers across requests (`StaticLatentKVCache.reset`), so the graph recorded at warm-up replays.
    """
    buffer = torch.zeros(shape, dtype=dtype, device=device)
    torch._dynamo.mark_static_address(buffer, guard=False)
    torch._dynamo.mark_static(buffer)   # the prompt buffers and the buffers: one graph each, not one dynamic graph
    return buffer


# -- decisions and stores over several layers at once ----------------------------------------------------------------
def store_entries(layers: Sequence[StaticLatentLayer], keys: torch.Tensor, values: torch.Tensor,
                  real: torch.Tensor | None) -> None:
    """Write compact entries to the front of each layer's buffers, mark their real entries, point the layers' views
    at them.

    Args:
        layers: ``L`` static layers of equal shapes.
        keys, values: ``[L, B, Hkv, S, D]``, ``[L, B, Hkv, S, Dv]``, layer ``l``'s entries at ``[l]``.
        real: bool ``[L, B, Hkv, S]``, False at left-padding entries, or None (every entry real).
    """
    first, stored = layers[0], keys.shape[-2]
    if stored > first.slots_in_use - 1:
        raise RuntimeError(f"{first.owner} layer {first.layer_idx}: {stored} entries do not leave a free slot in the "
                           f"static buffers of {first.slots_in_use}")
    for name, entries in (("keys", keys), ("values", values)):
        torch._foreach_copy_([layer.active[name][:, :, :stored] for layer in layers], list(entries.unbind(0)))
    marks = keys.new_ones((len(layers), *first.active["real"].shape), dtype=torch.bool)
    if real is not None:
        marks[:, :, :, 0, :stored] = real
    torch._foreach_copy_([layer.active["real"] for layer in layers], list(marks.unbind(0)))
    for layer in layers:
        layer._view(stored)


def stackable(layers: Sequence[StaticLatentLayer]) -> bool:
    """Whether ``layers`` can take one decision together (`decide_together`): static, rectangular, the same counts,
    shapes, dtypes and device (layers on several GPUs, or of different head counts, decide one by one)."""
    def signature(layer: StaticLatentLayer) -> tuple:
        state = layer.decision_state()
        return (*(state[name] for name in ("seen", "observed", "evicted_at", "evictions")), state["kept"] is None,
                state["padding"] is None, tuple(state["stats"]), layer.keys.shape, layer.keys.dtype,
                layer.keys.device, layer.values.shape, layer.window.shape, layer.window.dtype)

    first = signature(layers[0])
    return (all(layer.static and layer.active is layer.buffers and layer.ragged is None for layer in layers)
            and all(signature(layer) == first for layer in layers[1:]))


def decide_together(layers: Sequence[StaticLatentLayer], target: int, incoming: int) -> None:
    """Apply one decision (keep ``target`` entries per KV head) to every layer of ``layers`` (`stackable`) at once:
    on their `PolicyLayer.stacked` layer (the same score -> keep -> gather, `PolicyLayer.decide`), each layer's part
    then loaded back (`PolicyLayer.split_decision`) and its entries stored (`store_entries`).

    The latent policy's rule is per (batch row, KV head), so each layer keeps what it would keep alone: the work is
    the same, in one set of kernel launches instead of one per layer (docs/performance.md, session 18).
    """
    count = len(layers)
    view = PolicyLayer.stacked(layers)
    view.decide(target, incoming)
    for layer, part in zip(layers, view.split_decision(count), strict=True):
        layer.load_decision_state(part)

    def split(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unflatten(0, (count, -1))

    real = view.real_entries()
    store_entries(layers, split(view.keys), split(view.values), None if real is None else split(real))
