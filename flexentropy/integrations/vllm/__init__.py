"""flexentropy's sparse prefill inside vLLM: an attention-backend plugin (docs/usage.md, "Serving with vLLM";
docs/design.md §7).

``pip install "flexentropy[vllm]"`` registers `register` under vLLM's ``vllm.general_plugins`` entry point. An engine
whose ``additional_config`` has a ``"flexentropy"`` entry (`plugin_policy`, the prefill rule it names with its knobs
and `EntropyConfig`; `plugin_config`, that config) then runs every long prompt chunk of ``FLASH_ATTN`` (CUDA) or
``CPU_ATTN`` (the CPU build) through that policy (`flexentropy.policies.PrefillPolicy.run`, the path of every front
door), and everything else (decoding, short prompts) through its own kernel; an engine without the entry runs vLLM's own
backend. vLLM is imported only inside this package, and only by `backends` (which vLLM loads by name) and `register`;
transformers is not imported.
"""

from flexentropy.integrations.vllm.plugin import register
from flexentropy.integrations.vllm.settings import CONFIG_KEY, plugin_config, plugin_policy
from flexentropy.integrations.vllm.stats import PrefillStats, prefill_stats, reset_prefill_stats

__all__ = ["CONFIG_KEY", "PrefillStats", "plugin_config", "plugin_policy", "prefill_stats", "register",
           "reset_prefill_stats"]
