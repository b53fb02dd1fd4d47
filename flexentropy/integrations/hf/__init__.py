"""transformers integration, one name to import it by: every public name of the modules that hold its jobs.

- `flexentropy.integrations.hf.switch`: `enable`, `disable`, `enabled`, `register`, `check_supported`, `own_config`;
- `flexentropy.settings`: the model's `Settings` and their record on ``model.config.flexentropy`` (`settings_dict`,
  `parse_settings`);
- `flexentropy.integrations.hf.layer_state`: each attention module's `LayerState` (`layer_state`), `attention_modules`,
  `prefill_density`;
- `flexentropy.integrations.hf.tensor_parallel`: `local_heads`;
- `flexentropy.integrations.hf.mask`: `logical_mask`, the ``"flexentropy"`` mask function;
- `flexentropy.integrations.hf.attention`: `attention_forward`, the ``"flexentropy"`` attention function;
- `flexentropy.caches.keywords`: `cache_keyword`.

Importing it imports transformers and registers ``"flexentropy"`` in its attention interfaces.
"""

from __future__ import annotations

from flexentropy.caches.keywords import cache_keyword as cache_keyword  # re-exported: its earlier home
from flexentropy.integrations.hf.attention import attention_forward
from flexentropy.integrations.hf.layer_state import (
    STATE_ATTR,
    LayerState,
    PlanEdit,
    attention_modules,
    layer_state,
    prefill_density,
)
from flexentropy.integrations.hf.mask import logical_mask
from flexentropy.integrations.hf.switch import (
    ATTN_IMPLEMENTATION,
    SUPPORTED_MODEL_TYPES,
    check_supported,
    disable,
    enable,
    enabled,
    own_config,
    register,
)
from flexentropy.integrations.hf.tensor_parallel import local_heads
from flexentropy.settings import CONFIG_ATTR, KNOBS_KEY, PREFILL_MODES, Settings, parse_settings, settings_dict

__all__ = ["ATTN_IMPLEMENTATION", "CONFIG_ATTR", "KNOBS_KEY", "PREFILL_MODES", "STATE_ATTR", "SUPPORTED_MODEL_TYPES",
           "LayerState", "PlanEdit", "Settings", "attention_forward", "attention_modules", "cache_keyword",
           "check_supported", "disable", "enable", "enabled", "layer_state", "local_heads", "logical_mask",
           "own_config", "parse_settings", "prefill_density", "register", "settings_dict"]
