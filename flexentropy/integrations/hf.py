"""transformers integration: the ``"flexentropy"`` attention implementation and :func:`enable`.

Registered through transformers' extension points: ``AttentionInterface["flexentropy"]`` = :func:`attention_forward`,
and ``AttentionMaskInterface["flexentropy"]`` = :func:`logical_mask`, HF's SDPA mask indexed by *logical* key
position, so that it stays right after an eviction. The model itself gets hooks (`flexentropy.integrations.hooks`),
which :func:`disable` (or leaving ``with enabled(model): ...``) removes.

How the pieces reach :func:`attention_forward`: the layer index is the module's ``layer_idx``; the `EntropyConfig`
and the prefill policy live on ``model.config.flexentropy`` (a JSON-safe dict: ``save_pretrained`` keeps it), parsed
once per module into a `LayerState`; the cache argument (``cache`` from transformers 5.24, ``past_key_values``
before), which HF does not pass on to attention functions, is copied into ``flexentropy_cache`` by a forward pre-hook
that :func:`enable` registers (`hooks.hand_over_cache`). A flexentropy `PolicyCache` gets the queries, padding and
sliding windows it needs (the hand-over of design.md §3.2).

What runs: a prompt (no past) runs the layer's prefill policy on the layers that go sparse (global attention, not in
``dense_layers``), each left-padded row on its own real tokens; the others run HF's SDPA with HF's mask. Decode
steps over a `PolicyCache` go through ``cache.attend`` (kept positions, ragged layouts); over other caches, SDPA.
``torch.compile(model)`` traces all of this. Only `SUPPORTED_MODEL_TYPES`; inference only, causal attention only.

Tensor parallelism (transformers' ``DistributedConfig(tp_plan="auto")``, started with ``torchrun``): q/k/v are
sharded by heads, so each rank's attention function receives its own whole heads as plain tensors
(``[B, Hq / world, N, D]``, ``[B, Hkv / world, N, D]``) while ``module.config`` still counts every head. Nothing here
reads the head counts of the config: each rank plans its sparse prefill from its local heads and a `PolicyCache` keeps
its local KV heads; flexentropy adds no communication. `local_heads` says which of the model's heads a rank holds, and
:func:`enable` refuses a sharding that splits a head or a GQA group.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from flexentropy.caches.keywords import cache_keyword as cache_keyword  # re-exported: its earlier home
from flexentropy.caches.policy_cache import PolicyCache
from flexentropy.config import EntropyConfig, check_config
from flexentropy.integrations import hooks
from flexentropy.integrations.hooks import CACHE_KWARG, real_tokens
from flexentropy.policies import PREFILL_POLICIES, PrefillPolicy, make_prefill
from flexentropy.prefill import SparsePlan, sparse_prefill_attention
from flexentropy.sparse.kernel import COMPILED_DTYPES

ATTN_IMPLEMENTATION = "flexentropy"
"""The name under which flexentropy is registered in transformers' attention and mask interfaces."""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
"""``config.model_type`` values :func:`enable` accepts (each is tested against its dense twin)."""

PREFILL_MODES = tuple(PREFILL_POLICIES)
"""Names of `flexentropy.PREFILL_POLICIES`: ``"entropy"`` (sparse prefill, design.md §1) and the other sparse policies
(design.md §3, issue 15) on the layers that go sparse; ``"dense"``: SDPA everywhere."""

CONFIG_ATTR = "flexentropy"
"""Attribute of the model config holding ``{"prefill": mode, **EntropyConfig fields}``."""

STATE_ATTR = "flexentropy_state"
"""Attribute of each attention module holding its parsed `LayerState`."""

KNOBS_KEY = "prefill_knobs"
"""Key of ``model.config.flexentropy`` holding the prefill policy's own knobs (when set)."""

PlanEdit = Callable[[int, torch.Tensor, torch.Tensor, SparsePlan], SparsePlan]
"""``(layer_idx, query [B, Hq, N, D], key [B, Hkv, N, D], plan) -> plan``: applied to each sparse prefill plan before
the kernel runs it (`LayerState.plan_edit`; diagnostics such as hybrid dense/sparse runs)."""


@dataclass
class LayerState:
    """What :func:`attention_forward` knows about one attention module.

    Attributes:
        config: the `EntropyConfig`.
        prefill: one of `PREFILL_MODES`.
        knobs: the prefill policy's own knobs (`PrefillPolicy.knobs`; empty: its defaults).
        plans: the last prefill's plans, one per batch row run sparse (None for a row or layer run densely);
            empty before any prefill, for sliding-window layers, under ``torch.compile``, and when ``keep_plans`` is
            False. Kept as tensors so the prefill path never waits on the GPU.
        keep_plans: whether to keep ``plans``. A plan's block table is ``Hq * C_Q * C_B`` bools per row: 1 GiB per
            layer at 1M tokens with 16 query heads, held for every layer until the next prefill; False keeps only
            ``densities``.
        densities: the last prefill's `SparsePlan.density` per row, as 0-d tensors (None: run densely); empty
            when ``plans`` is (``keep_plans`` aside). `density` reads them on request.
        plan_edit: None, or a `PlanEdit` that replaces each sparse plan of this layer before it runs (the recorded
            plans are the edited ones); `enable` resets it.
    """

    config: EntropyConfig
    prefill: str
    knobs: dict[str, Any] = field(default_factory=dict)
    plans: list[SparsePlan | None] = field(default_factory=list)
    keep_plans: bool = True
    densities: list[torch.Tensor | None] = field(default_factory=list)
    plan_edit: PlanEdit | None = None
    policy: PrefillPolicy = field(init=False, repr=False)
    """The prefill policy named ``prefill``, on ``config``, with its own ``knobs``."""

    def __post_init__(self) -> None:
        self.policy = make_prefill(self.prefill, self.config, **self.knobs)

    @property
    def density(self) -> float | None:
        """Computed / causal key blocks of the layer's last prefill (mean over batch rows; 1.0 when dense)."""
        if not self.densities:
            return None
        return sum(1.0 if d is None else float(d) for d in self.densities) / len(self.densities)


def register() -> None:
    """Register ``"flexentropy"`` in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Runs when this module is imported; calling it again is harmless.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, logical_mask)


# --------------------------------------------------------------------------------------------------------------
# configuration


def settings_dict(config: EntropyConfig, prefill: str, knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON-safe ``{"prefill": prefill, "prefill_knobs": knobs, **fields of config}`` as stored on the model config
    (``"prefill_knobs"`` only when the policy has knobs set)."""
    own = {KNOBS_KEY: dict(knobs)} if knobs else {}
    return {"prefill": prefill, **own, **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}}


def parse_settings(value: object) -> tuple[EntropyConfig, str, dict[str, Any]]:
    """``(config, prefill, knobs)`` from a model config's ``flexentropy`` attribute.

    Accepts None (defaults), an `EntropyConfig`, or a dict of `EntropyConfig` fields plus optional ``"prefill"``
    and ``"prefill_knobs"`` keys (lists are read as tuples).
    """
    if value is None:
        return EntropyConfig(), "entropy", {}
    if isinstance(value, EntropyConfig):
        return value, "entropy", {}
    if not isinstance(value, dict):
        raise TypeError(f"config.{CONFIG_ATTR} must be a dict of EntropyConfig fields or an EntropyConfig, "
                        f"got {type(value).__name__}")
    knobs = dict(value)
    prefill = knobs.pop("prefill", "entropy")
    own = dict(knobs.pop(KNOBS_KEY, None) or {})
    _check_prefill(prefill)
    unknown = set(knobs) - {f.name for f in fields(EntropyConfig)}
    if unknown:
        raise ValueError(f"config.{CONFIG_ATTR} has unknown EntropyConfig field(s) {sorted(unknown)}")
    knobs = {k: tuple(v) if isinstance(v, list) else v for k, v in knobs.items()}
    return EntropyConfig(**knobs), prefill, own


def _check_prefill(prefill: object) -> None:
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")


def layer_state(module: nn.Module) -> LayerState:
    """The module's `LayerState`, parsed from ``module.config.flexentropy`` on first use."""
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        state = LayerState(*parse_settings(getattr(module.config, CONFIG_ATTR, None)))
        setattr(module, STATE_ATTR, state)
    return state


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a supported model (``...layers.<i>.self_attn``), in layer order."""
    return [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "layer_idx")]


def check_supported(config: Any) -> None:
    """Raise ``ValueError`` unless ``config`` (a transformers config) is of a supported, causal architecture."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"flexentropy supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
                         f"got {model_type!r} ({type(config).__name__})")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("flexentropy does not support attention logit soft-capping "
                         f"(config.attn_logit_softcapping={config.attn_logit_softcapping})")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("flexentropy supports causal attention only (config.use_bidirectional_attention=True)")


def enable(model: PreTrainedModel, config: EntropyConfig | None = None, *, prefill: str | PrefillPolicy = "entropy",
           keep_plans: bool = True) -> PreTrainedModel:
    """Switch a loaded transformers model to flexentropy attention, in place; returns ``model``.

    Gives the model its own copy of its transformers config (another model built from the same config object keeps
    its attention and settings), sets ``attn_implementation="flexentropy"`` there, stores ``config`` and ``prefill``
    on ``model.config.flexentropy`` (a record for ``save_pretrained``: the layers read their settings from `enable`,
    so editing that dict later changes nothing) and on every attention module, and installs the hooks of
    `flexentropy.integrations.hooks` (among them the pre-hook that hands the cache argument, e.g. a `LatentKVCache`,
    to the attention function). Calling it again replaces the settings; `disable` undoes it.

    Args:
        model: a model of one of `SUPPORTED_MODEL_TYPES` (e.g. ``LlamaForCausalLM``).
        config: knobs of sparse prefill and of `LatentKVCache` (default ``EntropyConfig()``).
        prefill: a name of `flexentropy.PREFILL_POLICIES`: ``"entropy"`` (sparse prefill, design.md §1),
            ``"dense"`` (SDPA prefill, e.g. to measure a cache policy alone), or another sparse policy
            (``"critiprefill"``, ``"streaming"``, ``"flexprefill"``, ``"xattention"``, ``"vertical_slash"``: their
            own knobs at their defaults, budget and geometry from ``config``); or a `PrefillPolicy` with knobs of
            its own, e.g. ``make_prefill("xattention", cfg, threshold=0.8)``, which carries its config (leave
            ``config`` None or pass the same one).
        keep_plans: keep each layer's last prefill plans on its `LayerState` (``plans``). Pass False for prompts of
            several hundred thousand tokens: a plan's block table grows with the square of the length (1 GiB per
            layer at 1M tokens and 16 query heads); the prefill's density stays available either way.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"enable expects a transformers PreTrainedModel, got {type(model).__name__}")
    if isinstance(prefill, PrefillPolicy):
        if config is not None and config != prefill.config:
            raise TypeError("a PrefillPolicy carries its EntropyConfig: pass config=None (or the policy's own config)")
        config, prefill, knobs = prefill.config, prefill.name, prefill.knobs
    else:
        knobs = {}
    config = check_config(config, optional=True)
    _check_prefill(prefill)
    check_supported(model.config)
    if prefill != "dense" and model.dtype not in COMPILED_DTYPES:
        raise TypeError(f"flexentropy's sparse prefill runs compiled FlexAttention, which takes float16, bfloat16 or "
                        f"float32; the model is {model.dtype}: load it in one of those (or use prefill='dense')")
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"found no attention modules (`*.self_attn` with a layer_idx) in {type(model).__name__}")
    for module in modules:
        local_heads(module)  # a tensor-parallel sharding must keep whole heads and GQA groups on each rank
    missing = sorted(set(config.dense_layers) - {module.layer_idx for module in modules})
    if missing:
        raise ValueError(f"EntropyConfig.dense_layers names layer(s) {missing} that {type(model).__name__} does not "
                         f"have (its attention layers are 0..{len(modules) - 1})")
    register()
    own_config(model)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    setattr(model.config, CONFIG_ATTR, settings_dict(config, prefill, knobs))
    for module in modules:
        setattr(module, STATE_ATTR, LayerState(config, prefill, knobs, keep_plans=keep_plans))
    hooks.install(model, modules)
    return model


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Undo `enable` in place; returns ``model``: its hooks removed (`flexentropy.integrations.hooks`), its
    attention back to SDPA, its layers' settings and ``model.config.flexentropy`` dropped. A model that was not
    enabled is returned unchanged."""
    if not hooks.remove(model):
        return model
    for module in attention_modules(model):
        vars(module).pop(STATE_ATTR, None)
    if hasattr(model.config, CONFIG_ATTR):
        delattr(model.config, CONFIG_ATTR)
    model.set_attn_implementation("sdpa")
    return model


@contextlib.contextmanager
def enabled(model: PreTrainedModel, config: EntropyConfig | None = None, *, prefill: str | PrefillPolicy = "entropy",
            keep_plans: bool = True) -> Iterator[PreTrainedModel]:
    """``with fe.enabled(model, cfg): ...``: `enable` on entry, `disable` on exit (arguments as `enable`)."""
    enable(model, config, prefill=prefill, keep_plans=keep_plans)
    try:
        yield model
    finally:
        disable(model)


def own_config(model: PreTrainedModel) -> None:
    """Give ``model`` and its submodules a private copy of its config (and of the sub-configs they hold), so that
    what `enable` sets there (the attention implementation, ``config.flexentropy``) changes no other model built
    from the same config object."""
    old = model.config
    new = copy.deepcopy(old)
    copies = {id(old): new}
    for name in getattr(old, "sub_configs", {}):
        if isinstance(getattr(old, name, None), PretrainedConfig):
            copies[id(getattr(old, name))] = getattr(new, name)
    for module in model.modules():
        held = getattr(module, "config", None)
        if held is not None and id(held) in copies:
            module.config = copies[id(held)]


def local_heads(module: nn.Module) -> tuple[range, range]:
    """``(query heads, KV heads)``: the model's heads, as global indices, that this process's attention ``module``
    computes.

    Without tensor parallelism, every head. Under transformers' tensor parallelism (``q_proj`` and ``k_proj`` weights
    DTensors sharded on their output dimension, the ``"colwise"`` style of ``tp_plan="auto"``), this rank's slice:
    the heads :func:`attention_forward` receives, the rows of the plans in `LayerState.plans` and the heads a
    `PolicyCache` stores for the layer. Query heads ``q`` read KV heads ``q // G`` (``G`` = ``num_key_value_groups``).
    Read from the weights' sharding: a style that gathers a projection's output (``"colwise_gather_output"``) would
    hand the attention every head, which this does not see.

    Raises:
        ValueError: the sharding splits a head, or a rank's query heads read KV heads of another rank.
    """
    group = module.num_key_value_groups
    query = _sharded_heads(module.q_proj.weight, module.head_dim, "q_proj")
    kv = _sharded_heads(module.k_proj.weight, module.head_dim, "k_proj")
    if query != range(kv.start * group, kv.stop * group):
        raise ValueError(f"layer {module.layer_idx}: this rank holds query heads {query.start}..{query.stop - 1} and "
                         f"KV heads {kv.start}..{kv.stop - 1}, which are not the same GQA groups (G={group}): "
                         f"shard q_proj and k_proj/v_proj alike, over a number of ranks that divides the KV heads")
    return query, kv


def _sharded_heads(weight: torch.Tensor, head_dim: int, name: str) -> range:
    """Global heads of a projection ``weight`` ``[heads * head_dim, hidden]`` held by this rank (all of them unless
    it is a DTensor sharded on dim 0)."""
    heads = weight.shape[0] // head_dim
    if not torch.distributed.is_available():
        return range(heads)
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return range(heads)
    dims = [i for i, p in enumerate(weight.placements) if p.is_shard(0)]
    if not dims:
        return range(heads)
    if len(dims) > 1:
        raise ValueError(f"{name} is sharded by heads over {len(dims)} mesh dimensions; flexentropy supports one")
    world, rank = weight.device_mesh.size(dims[0]), weight.device_mesh.get_local_rank(dims[0])
    if heads % world:
        raise ValueError(f"{name} has {heads} heads, which {world} tensor-parallel ranks cannot share without "
                         f"splitting a head: use a number of ranks that divides {heads}")
    per = heads // world
    return range(rank * per, (rank + 1) * per)


def prefill_density(model: nn.Module) -> float | None:
    """Mean density of the last prefill over the layers that recorded one (None if none did).

    Density is computed / causal key blocks; dense layers count 1.0, sliding-window layers are left out. Under tensor
    parallelism it is over this rank's heads (`local_heads`).
    """
    densities = [s.density for m in attention_modules(model)
                 if (s := getattr(m, STATE_ATTR, None)) is not None and s.density is not None]
    return sum(densities) / len(densities) if densities else None


# --------------------------------------------------------------------------------------------------------------
# mask


def logical_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 **kwargs: Any) -> torch.Tensor | None:
    """HF's SDPA mask (``AttentionMaskInterface`` signature) over logical key positions ``0 .. kv_offset + kv_length``.

    A cache reports ``(kv_length, kv_offset)`` through ``get_mask_sizes``; HF numbers the mask's columns
    ``kv_offset ..``. After a `LatentKVCache` eviction the stored entries are not those positions, so this mask
    keeps every logical position and :func:`attention_forward` picks the columns of the keys it is given.

    Returns:
        bool ``[B, 1, q_length, kv_offset + kv_length]`` (True: attend), or None where SDPA's ``is_causal`` (or no
        mask) is exact, as for ``"sdpa"``.
    """
    length = kv_offset + kv_length
    if kwargs.get("attention_mask") is None and kwargs.get("local_size") is None and q_length in (1, length):
        return None  # plain causal attention; also under torch.compile, where HF's sdpa_mask never skips
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=length, q_offset=q_offset, kv_offset=0,
                     **kwargs)


# --------------------------------------------------------------------------------------------------------------
# attention


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
        kwargs: ``flexentropy_cache`` (from the pre-hook) and HF's pass-through kwargs.

    Returns:
        ``([B, L, Hq, Dv], None)`` like HF's SDPA attention.
    """
    if dropout:
        raise ValueError(f"flexentropy attention is inference-only (dropout={dropout}); call model.eval()")
    if not kwargs.get("is_causal", True):
        raise ValueError("flexentropy attention is causal only (got is_causal=False)")
    state = layer_state(module)
    cache = kwargs.get(CACHE_KWARG)
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
    dense = state.prefill == "dense" or state.config.is_dense_layer(module.layer_idx, query.shape[-2])
    if sliding_window is not None or dense:
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
        else:
            out[rows] = F.scaled_dot_product_attention(query[rows], key[rows], value[rows], attn_mask=mask[rows],
                                                       scale=scaling, enable_gqa=True)
            plan = None
        plans.append(plan)
    _record(state, plans)
    return out.transpose(1, 2).contiguous(), None


def _sparse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, state: LayerState, layer_idx: int,
            scaling: float | None) -> tuple[torch.Tensor, SparsePlan]:
    """Sparse prefill of one layer under the layer's prefill policy (its plan through ``state.plan_edit`` when given):
    ``([B, Hq, N, Dv], plan)``."""
    plan = state.policy.plan(query, key, layer_idx)
    if state.plan_edit is not None:
        plan = state.plan_edit(layer_idx, query, key, plan)
    return sparse_prefill_attention(query, key, value, state.config, layer_idx, scale=scaling, plan=plan), plan


def _record(state: LayerState, plans: list[SparsePlan | None]) -> None:
    """Keep the prefill's densities and (``state.keep_plans``) ``plans`` (None: a row run densely) on ``state``,
    except while compiling."""
    if not torch.compiler.is_compiling():
        state.densities = [None if p is None else p.density_tensor() for p in plans]
        state.plans = plans if state.keep_plans else []


register()
