"""The plugin's configuration, read from vLLM's ``additional_config`` and validated once, at start-up.

``--additional-config '{"flexentropy": {"dense_prefix": 8192, "coverage": 0.7}}'`` (or ``LLM(...,
additional_config={...})``) turns the plugin on and sets `EntropyConfig`'s prefill fields by their names, and
``"prefill"`` (a name of `flexentropy.PREFILL_POLICIES`, default ``"entropy"``) with ``"prefill_knobs"`` (that rule's
own knobs) picks the prefill rule: ``{"flexentropy": {"prefill": "xattention", "prefill_knobs": {"threshold": 0.9}}}``.
A field left out keeps its default (``{"flexentropy": {}}``: on, the ``entropy`` rule at the defaults). Without the
entry the plugin is off. The entry is read by the library's one reader of configuration
(`flexentropy.settings.read_settings`: once per entry and process, one policy object for every layer); this module
adds the plugin's own rules. It imports no vLLM: it reads plain values, so the checks run (and are tested) without
it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields

from flexentropy.config import EntropyConfig
from flexentropy.policies import PrefillPolicy
from flexentropy.settings import read_settings

CONFIG_KEY = "flexentropy"
"""The key of `EntropyConfig`'s fields in vLLM's ``additional_config``: the entry turns the plugin on."""

DECODE_FIELDS = frozenset(f.name for f in fields(EntropyConfig) if f.name.startswith("decode_")) | {
    "recompress_every"}
"""`EntropyConfig` fields of the KV-cache eviction, which does not run under vLLM (decoding is vLLM's own kernel over
its paged cache: docs/design.md §7)."""

DEFAULTS = EntropyConfig()
"""The values a decode field must keep under vLLM."""

DISABLE_HINT = (f"to serve this model without flexentropy, leave the {CONFIG_KEY!r} entry out of vLLM's "
                "additional_config (vLLM then runs as without the plugin)")


def plugin_policy(additional_config: object) -> PrefillPolicy | None:
    """The prefill policy that vLLM's ``additional_config`` gives the plugin (its rule, knobs and `EntropyConfig`), or
    None, the plugin off: no ``"flexentropy"`` entry (or ``null`` there). Read once per entry and process
    (`read_settings`): every caller of an engine gets the same policy object.

    Raises:
        TypeError, ValueError: an entry that is not a mapping of `EntropyConfig` prefill fields (and ``"prefill"``,
            ``"prefill_knobs"``), a value `EntropyConfig` or the rule refuses, an unknown rule, or a decode knob away
            from its default. The message names the entry and what to write instead.
    """
    entry = additional_config.get(CONFIG_KEY) if isinstance(additional_config, Mapping) else None
    if entry is None:
        return None
    where = f"additional_config[{CONFIG_KEY!r}]"
    policy = read_settings(entry, where).policy
    decode = sorted(name for name in DECODE_FIELDS if getattr(policy.config, name) != getattr(DEFAULTS, name))
    if decode:
        raise ValueError(f"{where}: {decode} configure flexentropy's KV-cache eviction, which does not run under "
                         "vLLM (decoding stays vLLM's kernel over its paged cache); remove them")
    return policy


def plugin_config(additional_config: object) -> EntropyConfig | None:
    """The `EntropyConfig` of `plugin_policy` (None: the plugin off)."""
    policy = plugin_policy(additional_config)
    return None if policy is None else policy.config


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
