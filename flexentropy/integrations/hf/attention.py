"""The ``"flexentropy"`` entry of transformers' ``AttentionInterface``: `attention_forward`.

How the pieces reach it: the layer index is the module's ``layer_idx``; the `EntropyConfig` and the prefill policy
come from the module's `LayerState` (`flexentropy.integrations.hf.layer_state`); the cache argument (``cache`` from
transformers 5.24, ``past_key_values`` before), which HF does not pass on to attention functions, is copied into
``flexentropy_cache`` by a forward pre-hook that `flexentropy.enable` registers (`hooks.hand_over_cache`). A
flexentropy `PolicyCache` gets the queries, padding and sliding windows it needs (the hand-over of design.md §3.2).

What runs: a prompt (no past) goes to the layer's prefill policy (`PrefillPolicy.run`), which decides dense or sparse
(`PrefillPolicy.runs_dense`), plans and runs the kernel, each left-padded row on its own real tokens; sliding-window
layers, and the layers the policy runs dense, run HF's SDPA with HF's mask. Decode
steps over a `PolicyCache` go through ``cache.attend`` (kept positions, ragged layouts), or, in a static step run by
layer arguments, through `step_attention` on the layer's `StepLayer`; over other caches, SDPA.
``torch.compile(model)`` traces all of this. Inference only, causal attention only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flexentropy.caches.keywords import CACHE_KWARG, STEP_KWARG
from flexentropy.caches.policy_cache import PolicyCache
from flexentropy.caches.static_buffers import step_attention
from flexentropy.integrations.hf.layer_state import LayerState, layer_state
from flexentropy.integrations.hf.mask import real_tokens
from flexentropy.sparse.plan import SparsePlan


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"flexentropy"`` entry of ``AttentionInterface`` (what runs when: module docstring).

    Args:
        module: the calling attention module (``layer_idx``, ``config``, ``num_key_value_groups``).
        query: ``[B, Hq, L, D]`` post-RoPE; key, value: ``[B, Hkv, S, D]`` as returned by the cache (``S == L``
            at prefill).
        attention_mask: from :func:`logical_mask`: bool ``[B, 1, L, T]`` over logical key positions, or None.
        dropout: must be 0 (inference only). scaling: softmax scale. sliding_window: set on sliding layers.
        kwargs: ``flexentropy_cache`` (from the pre-hook), ``flexentropy_step`` (a static step by layer arguments:
            `flexentropy.engine.compiled_layer`, its `StepLayer`) and HF's pass-through kwargs.

    Returns:
        ``([B, L, Hq, Dv], None)`` like HF's SDPA attention.
    """
    if dropout:
        raise ValueError(f"flexentropy attention is inference-only (dropout={dropout}); call model.eval()")
    if not kwargs.get("is_causal", True):
        raise ValueError("flexentropy attention is causal only (got is_causal=False)")
    cache = kwargs.get(CACHE_KWARG)
    step = kwargs.get(STEP_KWARG)
    if step is not None:   # a static step by layer arguments: nothing of the module is read (one graph, all layers)
        return step_attention(step, query, key, value, scaling).transpose(1, 2).contiguous(), None
    state = layer_state(module)
    policy = isinstance(cache, PolicyCache)
    if policy:
        cache.observe_queries(query, module.layer_idx)
    if query.shape[-2] == key.shape[-2]:
        return _prefill(module, state, query, key, value, attention_mask, scaling, sliding_window)
    if policy:  # per-head kept entries (or a ragged layout): the cache reads the logical mask at their positions
        return cache.attend(query, module.layer_idx, attention_mask, scaling).transpose(1, 2).contiguous(), None
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        if attention_mask.shape[-1] < key.shape[-2]:
            raise ValueError(f"layer {module.layer_idx}: attention mask covers {attention_mask.shape[-1]} keys but "
                             f"the cache returned {key.shape[-2]}")
        attention_mask = attention_mask[..., -key.shape[-2]:]  # the cache holds the last positions
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)


def _prefill(module: nn.Module, state: LayerState, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             mask: torch.Tensor | None, scaling: float | None, sliding_window: int | None
             ) -> tuple[torch.Tensor, None]:
    """A prompt's attention (``query``, ``key``, ``value``: ``[B, H, N, D]``); see the module docstring."""
    if sliding_window is not None or state.policy.runs_dense(module.layer_idx, query.shape[-2]):
        _record(state, [] if sliding_window is not None else [None])
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)
    if mask is None:
        out, plan = _sparse(query, key, value, state, module.layer_idx, scaling)
        _record(state, [plan])
        return out.transpose(1, 2).contiguous(), None
    if mask.dtype != torch.bool:
        raise TypeError(f"flexentropy sparse prefill reads a boolean attention mask (causal + padding), "
                        f"got {mask.dtype}")
    out = query.new_zeros(*query.shape[:-1], value.shape[-1])
    plans: list[SparsePlan | None] = []
    real = real_tokens(mask)
    for row in range(query.shape[0]):
        tokens = real[row].nonzero().flatten()
        if tokens.numel() == 0:
            continue
        start, stop = int(tokens[0]), int(tokens[-1]) + 1
        rows = slice(row, row + 1)
        if stop - start == tokens.numel():
            # contiguous copies: a view's strides and offset vary with the row and its padding, and each variant
            # would compile the kernel again
            span = slice(start, stop)
            row_q, row_k, row_v = (t[rows, :, span].contiguous() for t in (query, key, value))
            out[rows, :, span], plan = _sparse(row_q, row_k, row_v, state, module.layer_idx, scaling)
            if stop < query.shape[-2]:   # right padding: its queries attend every real token, as under HF's mask
                out[rows, :, stop:] = F.scaled_dot_product_attention(query[rows, :, stop:], row_k, row_v,
                                                                     scale=scaling, enable_gqa=True)
        else:
            out[rows] = F.scaled_dot_product_attention(query[rows], key[rows], value[rows], attn_mask=mask[rows],
                                                       scale=scaling, enable_gqa=True)
            plan = None
        plans.append(plan)
    _record(state, plans)
    return out.transpose(1, 2).contiguous(), None


def _sparse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, state: LayerState, layer_idx: int,
            scaling: float | None) -> tuple[torch.Tensor, SparsePlan | None]:
    """The prefill of one layer (or row) by the layer's prefill policy (`PrefillPolicy.run`; its sparse plans through
    ``state.plan_edit`` when given): ``([B, Hq, N, Dv], plan)``, the plan None where it ran dense."""
    return state.policy.run(query, key, value, layer_idx, scale=scaling, edit=state.plan_edit)


def _record(state: LayerState, plans: list[SparsePlan | None]) -> None:
    """Keep the prefill's densities and (``state.keep_plans``) ``plans`` (None: a row run densely) on ``state``,
    except while compiling."""
    if not torch.compiler.is_compiling():
        state.densities = [None if p is None else p.density_tensor() for p in plans]
        state.plans = plans if state.keep_plans else []
