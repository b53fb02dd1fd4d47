"""The plugin's configuration, read from vLLM's ``additional_config`` and validated once, at start-up.

``--additional-config '{"flexentropy": {"dense_prefix": 8192, "coverage": 0.7}}'`` (or ``LLM(...,
additional_config={...})``) sets `EntropyConfig`'s prefill fields by their names; a field left out keeps its default.
This module imports no vLLM: it reads plain values, so the checks run (and are tested) without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from flexentropy.config import EntropyConfig

CONFIG_KEY = "flexentropy"
"""The key of `EntropyConfig`'s fields in vLLM's ``additional_config``."""

PREFILL_POLICY = "entropy"
"""The one prefill policy the plugin runs (``"prefill"`` in the config may name it, nothing else)."""

DECODE_FIELDS = frozenset(f.name for f in fields(EntropyConfig) if f.name.startswith("decode_")) | {
    "recompress_every"}
"""`EntropyConfig` fields of the KV-cache eviction, which does not run under vLLM (decoding is vLLM's own kernel over
its paged cache: docs/design.md §7)."""

PREFILL_FIELDS = frozenset(f.name for f in fields(EntropyConfig)) - DECODE_FIELDS
"""The fields the plugin accepts."""

TUPLE_FIELDS = ("coverage", "dense_layers")
"""Fields whose JSON form is a list and whose `EntropyConfig` form is a tuple."""

DISABLE_HINT = ("to serve without flexentropy, leave it out of vLLM's plugins: set VLLM_PLUGINS to the comma-separated "
                "names of the other plugins you use (VLLM_PLUGINS= with none)")


def plugin_config(additional_config: object) -> EntropyConfig:
    """The `EntropyConfig` that vLLM's ``additional_config`` gives the plugin (defaults without a ``"flexentropy"``
    entry).

    Raises:
        TypeError, ValueError: an entry that is not a mapping of `EntropyConfig` prefill fields, a value
            `EntropyConfig` refuses, a decode knob, or a prefill policy other than ``"entropy"``. The message names
            the entry and what to write instead.
    """
    entry: Any = additional_config.get(CONFIG_KEY) if isinstance(additional_config, Mapping) else None
    if entry is None:
        return EntropyConfig()
    where = f"additional_config[{CONFIG_KEY!r}]"
    if not isinstance(entry, Mapping):
        raise TypeError(f"{where} must be a mapping of EntropyConfig fields, e.g. "
                        f'{{"{CONFIG_KEY}": {{"dense_prefix": 8192}}}}, got {type(entry).__name__} {entry!r}')
    values = dict(entry)
    policy = values.pop("prefill", PREFILL_POLICY)
    if policy != PREFILL_POLICY:
        raise ValueError(f"{where}: prefill={policy!r} is not supported under vLLM: the plugin runs the "
                         f"{PREFILL_POLICY!r} prefill only (leave 'prefill' out)")
    decode = sorted(set(values) & DECODE_FIELDS)
    if decode:
        raise ValueError(f"{where}: {decode} configure flexentropy's KV-cache eviction, which does not run under "
                         "vLLM (decoding stays vLLM's kernel over its paged cache); remove them")
    unknown = sorted(set(values) - PREFILL_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected EntropyConfig's prefill fields: "
                         f"{sorted(PREFILL_FIELDS)}")
    for name in TUPLE_FIELDS:
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    try:
        config = EntropyConfig(**values)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{where}: {err}") from None
    return config


def check_layer(*, alibi_slopes: object, sliding_window: object, logits_soft_cap: object, kv_cache_dtype: str,
                attn_type: str, sinks: object) -> None:
    """Raise `ValueError` (at start-up, when vLLM builds the layer) for an attention layer whose function the sparse
    prefill does not compute: ALiBi, a sliding window, a logit soft-cap, attention sinks, a quantized (fp8) KV cache
    or any attention type but the decoder's own causal self-attention."""
    unsupported = [what for what, present in (
        ("ALiBi slopes", alibi_slopes is not None),
        (f"a sliding window of {sliding_window} tokens", sliding_window is not None),
        (f"a logit soft-cap of {logits_soft_cap}", logits_soft_cap not in (None, 0, 0.0)),
        ("attention sinks", sinks is not None),
        (f"a {kv_cache_dtype} KV cache (the plugin reads the cache in the model's dtype)",
         kv_cache_dtype not in ("auto", "float16", "bfloat16", "float32")),
        (f"{getattr(attn_type, 'value', attn_type)} attention (the plugin runs decoder self-attention)",
         attn_type != "decoder"),
    ) if present]
    if unsupported:
        raise ValueError(f"flexentropy's vLLM plugin cannot run a layer with {' and '.join(unsupported)}: its sparse "
                         f"prefill computes plain causal softmax attention; {DISABLE_HINT}")
