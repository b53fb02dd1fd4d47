"""Integrations with model libraries. Importing this package imports transformers and registers ``"flexentropy"``
in its attention interfaces (see :mod:`flexentropy.integrations.hf`)."""

from flexentropy.integrations.hf import (
    ATTN_IMPLEMENTATION,
    SUPPORTED_MODEL_TYPES,
    cache_keyword,
    disable,
    enable,
    enabled,
    local_heads,
    prefill_density,
    register,
)

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED_MODEL_TYPES", "cache_keyword", "disable", "enable", "enabled",
           "local_heads", "prefill_density", "register"]
