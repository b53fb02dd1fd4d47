"""Switching a transformers model to flexentropy and back: `enable`, `disable`, `enabled`.

`enable` registers ``"flexentropy"`` in transformers' attention and mask interfaces (`register`: the functions of
`flexentropy.integrations.hf.attention` and `flexentropy.integrations.hf.mask`), gives the model its own config, puts
its `Settings` on it (`flexentropy.settings`, shared with every attention module's `LayerState`) and installs the
hooks of `flexentropy.integrations.hf.hooks`, which `disable` (or leaving ``with enabled(model): ...``) removes. It
also runs the MLPs of long forwards over chunks of tokens (`flexentropy.surgery.chunked_mlp`), which `disable`
undoes. Only `SUPPORTED_MODEL_TYPES`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from flexentropy._checks import check_bool, check_int
from flexentropy.config import EntropyConfig
from flexentropy.integrations.hf import hooks
from flexentropy.integrations.hf.attention import attention_forward
from flexentropy.integrations.hf.layer_state import STATE_ATTR, LayerState, attention_modules
from flexentropy.integrations.hf.mask import logical_mask
from flexentropy.integrations.hf.tensor_parallel import local_heads
from flexentropy.policies import PrefillPolicy, prefill_policy
from flexentropy.settings import CONFIG_ATTR, SETTINGS_ATTR, Settings, check_prefill, settings_dict
from flexentropy.sparse.kernel import COMPILED_DTYPES
from flexentropy.surgery.chunked_mlp import MLP_CHUNK, chunk_mlp, chunked_tokens, mlp_modules

ATTN_IMPLEMENTATION = "flexentropy"
"""The name under which flexentropy is registered in transformers' attention and mask interfaces."""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
"""``config.model_type`` values :func:`enable` accepts (each is tested against its dense twin)."""

MLP_CHUNK_ATTR = "flexentropy_enabled_mlp_chunk"
"""Attribute of a switched model holding the tokens per chunk `enable` gave its MLPs (absent: `enable` left them as
they were), so that `disable` gives back whole only what `enable` chunked."""


def register() -> None:
    """Register ``"flexentropy"`` in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Runs when this module is imported; calling it again is harmless.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, logical_mask)


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
           keep_plans: bool = True, mlp_chunk: int | None = MLP_CHUNK) -> PreTrainedModel:
    """Switch a loaded transformers model to flexentropy attention, in place; returns ``model``.

    Gives the model its own copy of its transformers config (another model built from the same config object keeps
    its attention and settings), sets ``attn_implementation="flexentropy"`` there, puts one `Settings` (the prefill
    policy, built once here, on ``config``) on the model and every attention module, records them on
    ``model.config.flexentropy``
    (for ``save_pretrained``: nothing reads that dict back while the model is enabled, so editing it changes
    nothing), and installs the hooks of
    `flexentropy.integrations.hf.hooks` (among them the pre-hook that hands the cache argument, e.g. a `LatentKVCache`,
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
        mlp_chunk: the MLPs of a forward longer than this many tokens run over chunks of it (`fe.chunk_mlp`): an
            MLP acts on each token alone, so the outputs are the same, and a long prompt's MLP activations are one
            chunk's (at 128k tokens on the Llama-3.1-8B shape, 14 GiB for a whole-sequence MLP, 1.75 GiB for a
            chunk of the default 16,384). Decode steps and shorter prompts run whole. ``None``: the MLPs are left
            whole (and those an earlier `enable` chunked are given back whole). MLPs chunked by a call of
            `fe.chunk_mlp` before `enable` keep their chunks; `disable` gives back whole the MLPs `enable` chunked.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"enable expects a transformers PreTrainedModel, got {type(model).__name__}")
    if not isinstance(prefill, PrefillPolicy):
        check_prefill(prefill)
    policy = prefill_policy(prefill, config)
    config = policy.config
    check_bool("enable", "keep_plans", keep_plans)
    if mlp_chunk is not None:
        check_int("enable", "mlp_chunk", mlp_chunk, 1)
    check_supported(model.config)
    if not policy.always_dense and model.dtype not in COMPILED_DTYPES:
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
    settings = Settings(policy)
    setattr(model, SETTINGS_ATTR, settings)
    setattr(model.config, CONFIG_ATTR, settings_dict(config, policy.name, policy.knobs))
    for module in modules:
        setattr(module, STATE_ATTR, LayerState(settings, keep_plans=keep_plans))
    hooks.install(model, modules)
    chunk_mlps(model, mlp_chunk)
    return model


def chunk_mlps(model: PreTrainedModel, tokens: int | None) -> None:
    """`enable`'s MLP chunks: ``tokens`` per chunk (None: whole) for MLPs that are whole or that `enable` chunked;
    MLPs the user chunked (`chunk_mlp`) stay as they are. Records what it set on the model (`MLP_CHUNK_ATTR`)."""
    owned = MLP_CHUNK_ATTR in vars(model)
    if not mlp_modules(model) or (not owned and chunked_tokens(model) is not None):
        return
    if tokens is None:
        if owned:
            chunk_mlp(model, None)
            delattr(model, MLP_CHUNK_ATTR)
        return
    chunk_mlp(model, tokens)
    setattr(model, MLP_CHUNK_ATTR, tokens)


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Undo `enable` in place; returns ``model``: its hooks removed (`flexentropy.integrations.hf.hooks`), its
    attention back to SDPA, the MLPs `enable` chunked whole again, its `Settings`, its layers' states and
    ``model.config.flexentropy`` dropped. A model that was not enabled is returned unchanged."""
    if not hooks.remove(model):
        return model
    chunk_mlps(model, None)
    for module in attention_modules(model):
        vars(module).pop(STATE_ATTR, None)
    vars(model).pop(SETTINGS_ATTR, None)
    if hasattr(model.config, CONFIG_ATTR):
        delattr(model.config, CONFIG_ATTR)
    model.set_attn_implementation("sdpa")
    return model


@contextlib.contextmanager
def enabled(model: PreTrainedModel, config: EntropyConfig | None = None, *, prefill: str | PrefillPolicy = "entropy",
            keep_plans: bool = True, mlp_chunk: int | None = MLP_CHUNK) -> Iterator[PreTrainedModel]:
    """``with fe.enabled(model, cfg): ...``: `enable` on entry (arguments as `enable`); on exit the model as it was:
    `disable` for a model that was not enabled, else `enable` again with the settings it had."""
    previous = vars(model).get(SETTINGS_ATTR) if hooks.installed(model) else None
    modules = attention_modules(model)
    kept = getattr(modules[0], STATE_ATTR).keep_plans if previous is not None and modules else True
    chunk = vars(model).get(MLP_CHUNK_ATTR)
    enable(model, config, prefill=prefill, keep_plans=keep_plans, mlp_chunk=mlp_chunk)
    try:
        yield model
    finally:
        if previous is None:
            disable(model)
        else:
            enable(model, prefill=previous.policy, keep_plans=kept, mlp_chunk=chunk)


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


register()
