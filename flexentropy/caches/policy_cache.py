"""`PolicyCache`: one transformers ``Cache`` for every KV-cache policy (design.md §3.2).

A `flexentropy.policies.CachePolicy` is the rule; `PolicyLayer` the per-layer storage; this class the transformers
``Cache`` around them: layer creation, shape checks across layers, and the hand-over of what ``update`` does not
bring: post-RoPE queries (``observe_queries``), left padding (``observe_padding``), sliding windows
(``observe_sliding``) and, for signal policies, hidden states and the predictive distribution (``observe_hidden`` and
``finish_forward``, called by the hooks that `flexentropy.enable` installs, `flexentropy.integrations.hf.hooks`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from flexentropy._checks import check_int, check_layer_idx, plain
from flexentropy.caches.conversation import ConversationIds
from flexentropy.caches.policy_layer import PolicyLayer
from flexentropy.policies.base import CachePolicy

NEW_PROMPT = ("new prompt on a used cache: call cache.reset() (or use a new cache) before a new prompt; a later turn "
              "of the same conversation passes generate the whole conversation (the tokens the cache holds, then the "
              "new ones)")
"""The end of the message that refuses a new prompt on a used cache."""


def model_depth(model: Any, owner: str) -> int:
    """Decoder layers of the transformers model ``model`` (its text config's ``num_hidden_layers``); ``TypeError``
    for anything else (``owner``: the class that asks, for the message)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    depth = getattr(text, "num_hidden_layers", None)
    if depth is None:
        shown = repr(model) if len(repr(model)) <= 60 else f"{repr(model)[:57]}..."
        raise TypeError(f"{owner}: model must be the transformers model the cache serves (its "
                        f"config.num_hidden_layers gives the layer count), got {type(model).__name__} {shown}; or "
                        f"pass num_layers=")
    return depth


class PolicyCache(Cache):
    """A transformers 5.x ``Cache`` running a :class:`~flexentropy.policies.base.CachePolicy` on every layer.

    Build one with ``flexentropy.make_cache(name, model=model, **knobs)`` and
    pass it as ``past_key_values`` to ``generate`` or a forward. From a plain attention module::

        cache.observe_queries(q, layer_idx)          # q [B, Hq, q_len, D], post-RoPE (policies that score with q)
        k, v = cache.update(k_new, v_new, layer_idx)  # [B, Hkv, S, D]: compressed, per KV head
        out = cache.attend(q, layer_idx)              # decode attention (also over a ragged layer)

    Args:
        policy: the rule.
        model: the HF model served (its layer count; the hooks that hand signals over come with `flexentropy.enable`).
        num_layers: layer count when no model is given (PyramidKV needs it).
    """

    layer_class: type[PolicyLayer] = PolicyLayer

    def __init__(self, policy: CachePolicy, *, model: Any = None, num_layers: int | None = None) -> None:
        if not isinstance(policy, CachePolicy):
            raise TypeError(f"policy must be a CachePolicy, got {type(policy).__name__}")
        super().__init__(layers=[])
        self.policy = policy
        if num_layers is None and model is not None:
            num_layers = model_depth(model, type(self).__name__)
        if num_layers is not None:
            check_int("", "num_layers", num_layers, 1)
        self.num_layers = plain(num_layers)
        self._dims: dict[str, tuple[int, str]] = {}  # name -> (size, the call that fixed it)
        self._depth: int | None = None  # decoder layers of the model that filled the cache (`_check_depth`)
        self._hidden: dict[int, torch.Tensor] = {}
        self.token_ids = ConversationIds()
        self._checked_end: int | None = None  # the logical length after the forward `check_request` last passed

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.policy!r}, layers={len(self.layers)})"

    def _layer(self, layer_idx: int) -> PolicyLayer:
        check_layer_idx(layer_idx)
        while len(self.layers) <= layer_idx:
            self.layers.append(self.layer_class(self.policy, len(self.layers), type(self).__name__, self.num_layers))
        return self.layers[layer_idx]

    def reset(self) -> None:
        """Empty every layer for a new request, which may have another batch size (or another model)."""
        super().reset()
        self._dims.clear()
        self._depth = None
        self._hidden.clear()
        self.token_ids.clear()
        self._checked_end = None

    def _check_dims(self, where: str, **sizes: int) -> None:
        """Every layer and call must agree on batch size, heads and head dims; GQA needs Hq % Hkv == 0."""
        for name, size in sizes.items():
            expected, origin = self._dims.setdefault(name, (size, where))
            if size != expected:
                raise ValueError(f"{where}: expected {name} {expected} (as in {origin}), got {size}; every layer of "
                                 f"a {type(self).__name__} must share batch size, heads and head dims within a "
                                 f"request (call cache.reset() before a request of another batch size)")
        if "query_heads" in self._dims and "kv_heads" in self._dims:
            (q_heads, _), (kv_heads, _) = self._dims["query_heads"], self._dims["kv_heads"]
            if q_heads % kv_heads:
                raise ValueError(f"{where}: query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")

    # -- hand-over -----------------------------------------------------------------------------------------------
    def observe_queries(self, query_states: torch.Tensor, layer_idx: int) -> None:
        """Hand over one forward's post-RoPE queries ``[B, Hq, q_len, D]`` of layer ``layer_idx`` (every forward)."""
        if not isinstance(query_states, torch.Tensor) or query_states.dim() != 4 or query_states.shape[2] == 0:
            got = list(query_states.shape) if isinstance(query_states, torch.Tensor) else type(query_states).__name__
            raise ValueError(f"observe_queries expects post-RoPE query_states [B, Hq, q_len >= 1, D], got {got}")
        batch, q_heads, _, dim = query_states.shape
        where = f"observe_queries(layer_idx={layer_idx}) query_states {list(query_states.shape)}"
        self._check_dims(where, batch_size=batch, query_heads=q_heads, head_dim=dim)
        layer = self._layer(layer_idx)
        if layer.is_initialized and query_states.device != layer.keys.device:
            raise ValueError(f"{where} is on {query_states.device}, expected {layer.keys.device} like the keys")
        layer.observe(query_states)

    def observe_padding(self, real_tokens: torch.Tensor, layer_idx: int) -> None:
        """Hand over which prompt tokens are real, ``real_tokens [B, N]`` bool (before `observe_queries`).

        A left-padded row's padding entries are then never attended by the scores, rank below every real entry
        when entries are evicted, and are not sinks, so each row keeps what it would keep alone. Left padding
        (each row's real tokens last and contiguous, as ``generate`` pads) is read; a row whose prompt ends in
        padding (right padding) raises ``ValueError``: its next tokens would follow the padding; other patterns
        (a masked token inside a prompt) are ignored.
        """
        if not isinstance(real_tokens, torch.Tensor) or real_tokens.dtype != torch.bool or real_tokens.dim() != 2:
            got = (f"{real_tokens.dtype} {list(real_tokens.shape)}" if isinstance(real_tokens, torch.Tensor)
                   else type(real_tokens).__name__)
            raise ValueError(f"observe_padding expects a bool [B, N] mask of real tokens, got {got}")
        right = (real_tokens.any(dim=-1) & ~real_tokens[:, -1]).nonzero().flatten()
        if right.numel():
            raise ValueError(
                f"{type(self).__name__}: batch row {int(right[0])} of the prompt ends in padding (right padding): the "
                f"tokens generated next would follow its padding. Pad on the left (tokenizer.padding_side = 'left'), "
                f"as generate expects. A prompt that holds the pad token id needs its attention_mask passed: without "
                f"one, generate masks every token equal to pad_token_id")
        layer = self._layer(layer_idx)
        pads = (~real_tokens).sum(dim=-1)
        left = torch.arange(real_tokens.shape[-1], device=real_tokens.device) >= pads[:, None]
        layer.padding = pads if bool(pads.any()) and torch.equal(left, real_tokens) else None

    def observe_sliding(self, window: int, layer_idx: int) -> None:
        """Mark layer ``layer_idx`` as a sliding-window layer of ``window`` tokens (before its first ``update``): it
        then keeps only its last ``window - 1`` tokens, as transformers' own cache does, and the policy does not
        apply to it (flexentropy's HF attention calls this for Gemma3's local layers and the like)."""
        check_int("observe_sliding", "window", window, 1)
        self._layer(layer_idx).sliding_window = window

    def observe_generate(self, input_ids: torch.Tensor, length: int, *, first: bool,
                         embeds: int | None = None, positions: torch.Tensor | None = None) -> None:
        """Hand over ``generate``'s ids before one of its forwards (the hook that `flexentropy.enable` installs on
        ``model.prepare_inputs_for_generation`` calls it), so that the cache tells a later turn of its conversation
        from a new prompt, which it refuses with a ``ValueError`` before anything is written
        (`flexentropy.caches.conversation`).

        A forward that ``generate`` begins (its prefill, ``first``) is checked on the host: its conversation must go
        past the tokens the cache holds and agree with the ids the cache knows of them (a batch of another size is
        left to `check_request`, which refuses it); its ids are recorded once the forward is checked
        (`check_request`). A decode step (one token past the cache's) is recorded as it is, with neither a copy nor
        a host read.

        Args:
            input_ids: ``[B, T]`` ``generate``'s ids, the conversation's last ``T`` tokens (the whole conversation,
                or with an attention mask longer than them the new tokens only, as ``generate`` takes them).
            length: the conversation's tokens once the forward has run (the length of ``generate``'s attention mask
                or position ids, which cover the whole conversation; T without either).
            first: whether the forward is the first of a ``generate`` call.
            embeds: the tokens of the ``inputs_embeds`` that a first forward takes instead of ids (None: it takes
                the ids): they have no ids, so only their count is checked.
            positions: ``[..., T]`` ``generate``'s position ids of the forward's tokens, or None. Where ``length``
                does not go past the tokens the cache holds, a first forward's conversation ends at its last position
                instead if that is later (read on the host): a prefill in chunks (``prefill_chunk_size``) on
                transformers >= 5.24 hands over each chunk's ids and positions, and no mask when it is all ones.
        """
        held = self._conversation()[0]
        if held and self._dims.get("batch_size", (input_ids.shape[0],))[0] != input_ids.shape[0]:
            return   # another batch size: `check_request` refuses it
        if embeds is not None:
            if held and embeds <= held:
                raise ValueError(self._new_prompt(held, f"generate's inputs_embeds of {embeds} tokens do not go past "
                                                        f"them"))
            return
        if first and held and length <= held and positions is not None:
            length = max(length, int(positions[..., -1].max()) + 1)
        start = length - input_ids.shape[1]
        if not first and length == held + 1:   # a decode step
            self.token_ids.put(start, input_ids)
            return
        if held:
            if length <= held:
                raise ValueError(self._new_prompt(held, f"generate's {length} tokens do not go past them"))
            differs = self.token_ids.first_difference(start, input_ids, held)
            if differs is not None:
                raise ValueError(self._new_prompt(held, f"generate's {length} tokens differ from them at token "
                                                        f"{differs}"))
        self.token_ids.staged = (start, input_ids)

    def _new_prompt(self, held: int, why: str) -> str:
        """The message refusing a new prompt on the cache, which holds ``held`` tokens (``why``: what is wrong)."""
        return f"{type(self).__name__} holds a conversation of {held} tokens, and {why}: a {NEW_PROMPT}"

    def check_request(self, num_layers: int, inputs: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Refuse a forward that this cache cannot serve before any of it is written, so that a refused forward leaves
        the cache as it was (its entries, lengths and counters) and the conversation it holds goes on as if the
        forward had never come; then record the forward's ids (`observe_generate`). The decoder's pre-hook that
        `flexentropy.enable` installs calls it before every forward (`flexentropy.integrations.hf.hooks`); not while
        compiling.

        Refused with a ``ValueError``: a model of another depth than the one that filled the cache since it was made
        or last `reset` (`_check_depth`); another batch size than the conversation's; tokens that do not continue
        the conversation (`_check_positions`).

        Args:
            num_layers: decoder layers of the model that runs the forward.
            inputs: the forward's ``input_ids [B, q_len]`` or ``inputs_embeds [B, q_len, d]``.
            position_ids: ``[B or 1, q_len]`` the positions the model gives the forward's tokens, or None
                (transformers then numbers them on from the cache's length: they continue it).
        """
        if torch.compiler.is_compiling():
            return
        staged = self.token_ids.take_staged()
        held, padding = self._conversation()
        batch, tokens = inputs.shape[:2]
        self._check_depth(num_layers, held)
        if held and "batch_size" in self._dims:
            self._check_dims(f"a forward of {batch} batch rows", batch_size=batch)
        self._check_positions(position_ids, held, padding)
        self._checked_end = held + tokens
        if staged is not None and staged[0] <= held and staged[0] + staged[1].shape[1] == held + tokens:
            self.token_ids.put(*staged)
        elif inputs.dim() == 2 and tokens > 1:   # a forward of several tokens outside generate: its ids, copied
            self.token_ids.put(held, inputs.clone())

    def _check_driven(self, layer_idx: int, tokens: int) -> None:
        """Raise ``RuntimeError`` when ``tokens`` tokens go into layer ``layer_idx`` of a conversation that a model
        switched by `flexentropy.enable` ran (`check_request`), in a forward that its hooks did not check: a model
        after `flexentropy.disable` (its attention would hand over no queries, and a static phase would not
        advance). Nothing is checked while compiling (`check_request` is not run there)."""
        if torch.compiler.is_compiling() or self._checked_end is None:
            return
        if self._seen(layer_idx) + tokens <= self._checked_end:
            return
        raise RuntimeError(f"a model without flexentropy's hooks runs on a {type(self).__name__} that a model switched "
                           f"by flexentropy.enable filled (after flexentropy.disable(model)?): call "
                           f"flexentropy.enable(model) before running the model with this cache")

    def _conversation(self) -> tuple[int, torch.Tensor | None]:
        """``(tokens, padding)`` of the conversation the cache holds: its logical length, the host's int (0: none),
        and its rows' left padding ``[B]`` int64 (None: none)."""
        if not self.layers:
            return 0, None
        first = self.layers[0]
        return first.seen, first.padding

    def _check_depth(self, num_layers: int, held: int) -> None:
        """Raise ``ValueError`` when a model of ``num_layers`` decoder layers runs on this cache while it holds
        ``held`` tokens of a model of another depth (a cache holds one model's request; the other model would
        continue from its entries); an empty cache takes any model."""
        if held and self._depth is not None and num_layers != self._depth:
            raise ValueError(f"a model of {num_layers} layers runs on a {type(self).__name__} that a model of "
                             f"{self._depth} layers filled: a cache holds one model's request. Call cache.reset() "
                             f"(or use a new cache) before running another model on it")
        self._depth = num_layers

    def _check_positions(self, position_ids: torch.Tensor | None, held: int, padding: torch.Tensor | None) -> None:
        """Raise ``ValueError`` when the tokens of a forward on a cache that holds a conversation of ``held`` tokens
        (rows left-padded by ``padding [B]``, or None) do not continue it: a new prompt on a used cache, which would
        attend over the old conversation's entries.

        ``position_ids`` ``[B or 1, q_len]`` are the positions the model gives the tokens (None, a single token or
        an empty cache: nothing to check, so a decode step reads no tensor). A continuation starts where the cache
        ends: ``generate`` with a used cache takes the whole conversation and feeds the tokens past the cache's
        length; a prompt fed in several forwards continues too. A left-padded row counts its positions from its
        first real token. A later turn reads its rows' first positions once (a host sync).
        """
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] < 2 or not held:
            return
        starts = position_ids[:, 0]
        expected = torch.full_like(starts, held) if padding is None else held - padding
        starts = starts.expand_as(expected)
        wrong = (starts != expected).nonzero().flatten()
        if wrong.numel():
            row = int(wrong[0])
            raise ValueError(
                f"{type(self).__name__} already holds a conversation of {held} tokens, but the "
                f"{position_ids.shape[-1]} new tokens of batch row {row} start at position {int(starts[row])}, not "
                f"{int(expected[row])}: a {NEW_PROMPT}"
            )

    @property
    def wants_signals(self) -> bool:
        """Whether the policy needs ``observe_hidden``/``finish_forward`` (decoder hooks of `flexentropy.enable`)."""
        return self.policy.needs_signals

    def observe_hidden(self, layer_idx: int, hidden_states: torch.Tensor) -> None:
        """Hand over decoder layer ``layer_idx``'s output hidden states ``[B, L, d]`` of the current forward (kept
        unit-normalised until `finish_forward`)."""
        self._hidden[layer_idx] = F.normalize(hidden_states.detach().float(), dim=-1).to(hidden_states.dtype)

    def finish_forward(self, last_hidden: torch.Tensor, logits_fn: Any, *, chunk: int = 1024) -> None:
        """End of a forward: the predictive entropy ``H [B, L]`` of its tokens, then every handed-over layer's signal
        ``policy.signal(h_l, h_L, H)`` recorded at its tokens' entries (and the layers settled).

        Args:
            last_hidden: the last decoder layer's output ``[B, L, d]`` (the final norm's input).
            logits_fn: maps ``[B, l, d]`` last-layer states to next-token logits ``[B, l, V]`` (final norm and LM
                head); applied in chunks of ``chunk`` tokens, so ``[B, L, V]`` is never built for long prompts.
        """
        hidden, self._hidden = self._hidden, {}
        if not hidden:
            return
        with torch.no_grad():
            last_hidden = last_hidden.detach()
            unit_last = F.normalize(last_hidden.float(), dim=-1)
            entropy = torch.cat([self.policy.entropy(logits_fn(part)) for part in last_hidden.split(chunk, dim=1)],
                                dim=1)
            for layer_idx, states in hidden.items():
                self.layers[layer_idx].record_signal(self.policy.signal(states, unit_last, entropy))

    # -- the cache API -------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states [B, Hkv, q_len, D]``, ``value_states [B, Hkv, q_len, Dv]`` to layer ``layer_idx``
        (deciding first when due) and return the layer's stored ``(keys, values)``, ``[B, Hkv, S, D]``."""
        layer = self.checked_layer(key_states, value_states, layer_idx)
        self._check_driven(layer_idx, key_states.shape[-2])
        return layer.update(key_states, value_states)

    def _seen(self, layer_idx: int) -> int:
        """Tokens layer ``layer_idx`` has seen (0 before its first ``update``)."""
        return self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0

    def checked_layer(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> PolicyLayer:
        """Layer ``layer_idx``, once an ``update`` of ``key_states`` and ``value_states`` is checked (shapes, dims
        across layers, the previous layer's queries)."""
        for name, tensor in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 or tensor.shape[2] == 0:
                got = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"update expects {name} [B, Hkv, q_len >= 1, D], got {got}")
            if not tensor.is_floating_point():
                raise TypeError(f"update expects floating {name} (float16/bfloat16/float32/float64, the attention's "
                                f"projections), got {tensor.dtype}")
        where = f"update(layer_idx={layer_idx}) key_states {list(key_states.shape)}"
        if value_states.shape[:3] != key_states.shape[:3]:
            raise ValueError(f"{where}: expected value_states [B, Hkv, q_len, Dv] = {list(key_states.shape[:3])} "
                             f"+ [Dv], got {list(value_states.shape)}")
        batch, kv_heads, _, dim = key_states.shape
        self._check_dims(where, batch_size=batch, kv_heads=kv_heads, head_dim=dim, value_dim=value_states.shape[-1])
        previous = self.layers[layer_idx - 1] if 0 < layer_idx <= len(self.layers) else None
        if self.policy.uses_queries and previous is not None and previous.seen and not previous.observed:
            previous.missing_queries()  # its attention ran without handing over queries: fail at the first forward
        return self._layer(layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Refused (``NotImplementedError``) unless it removes nothing: ``crop(-k)`` would remove the last ``k``
        tokens, ``crop(n)`` with ``n > 0`` keep the first ``n`` (transformers 5.17's form), and what the cache keeps
        (the policy's choice of entries, the window of recent queries that scores them, the counters its decisions
        follow) depends on every token it has seen, which cropping cannot undo. ``crop(0)`` changes nothing."""
        tokens_to_remove = check_int("crop", "tokens_to_remove", tokens_to_remove, None)
        held = self._conversation()[0]
        if tokens_to_remove == 0 or not held or tokens_to_remove >= held:
            return
        raise NotImplementedError(
            f"{type(self).__name__} cannot crop: what it keeps (its policy's choice of entries, the window of recent "
            f"queries that scores them, the counters its decisions follow) depends on every token it has seen, which "
            f"cropping cannot undo. To go back to the conversation's first tokens, call cache.reset() and run them "
            f"again (generate with them); assisted decoding, which crops after each step, needs transformers' "
            f"DynamicCache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (row ``i`` becomes rows ``i * repeats ..``), as
        transformers' caches do (e.g. for ``num_return_sequences``): entries, positions, query windows, padding,
        statistics and the conversation's ids."""
        repeats = check_int("batch_repeat_interleave", "repeats", repeats, 1)
        batch = self._dims.get("batch_size", (0, ""))[0]
        self._select_rows(torch.arange(batch).repeat_interleave(repeats), f"batch_repeat_interleave({repeats})")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (int64 ``[R]``, repeats allowed, or a bool mask ``[B]``) in place, as
        transformers' caches do."""
        batch = self._dims.get("batch_size", (0, ""))[0]
        rows = torch.as_tensor(indices)
        if rows.dtype == torch.bool and rows.shape == (batch,):
            rows = rows.nonzero().flatten()
        if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or \
                (rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < batch):
            raise ValueError(f"batch_select_indices expects int64 indices [R] in [0, {batch}) or a bool mask "
                             f"[{batch}], got {rows.dtype} {list(rows.shape)}")
        self._select_rows(rows.long(), "batch_select_indices")

    def _select_rows(self, rows: torch.Tensor, where: str) -> None:
        """Batch rows ``rows`` of everything held per row (`PolicyLayer.reorder_cache`); the batch size they make."""
        if "batch_size" not in self._dims:
            return   # nothing held
        for layer in self.layers:
            layer.reorder_cache(rows)
        self.token_ids.select_rows(rows)
        self._dims["batch_size"] = (rows.numel(), where)

    def attend(self, query: torch.Tensor, layer_idx: int, attention_mask: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
        """Decode attention of layer ``layer_idx``'s newest tokens over what it holds (`PolicyLayer.attend`)."""
        return self.layers[layer_idx].attend(query, attention_mask, scale)

    def is_ragged(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` stores per-head counts without padding (read it through `attend`)."""
        return layer_idx < len(self.layers) and self.layers[layer_idx].ragged is not None

    def stored_length(self, layer_idx: int = 0) -> int:
        """Entries held per KV head in layer ``layer_idx`` (ragged: the longest head; ``get_seq_length`` is the
        logical length)."""
        return self.layers[layer_idx].stored if layer_idx < len(self.layers) else 0

    def head_lengths(self, layer_idx: int = 0) -> torch.Tensor:
        """int64 ``[B, Hkv]`` entries held by every (batch row, KV head) of layer ``layer_idx``."""
        return self.layers[layer_idx].head_lengths()

    def kept_positions(self, layer_idx: int = 0) -> torch.Tensor:
        """``[B, Hkv, S]`` int64 original token position of each stored entry of layer ``layer_idx``."""
        if layer_idx >= len(self.layers):
            raise ValueError(f"layer {layer_idx} of the {type(self).__name__} holds nothing yet "
                             f"({len(self.layers)} layers)")
        if self.layers[layer_idx].ragged is not None:
            raise ValueError(f"layer {layer_idx} is ragged (per-head counts): read it through attend()")
        return self.layers[layer_idx].positions()

    def nbytes(self, layer_idx: int | None = None) -> int:
        """Real bytes held by layer ``layer_idx`` (all layers when None): keys, values, positions, statistics and
        the query window."""
        layers = self.layers if layer_idx is None else self.layers[layer_idx : layer_idx + 1]
        return sum(layer.nbytes() for layer in layers)
