"""flexentropy: entropy-guided sparse prefill and KV-cache eviction for long-context LLMs on FlexAttention.

The algorithms depend on torch and einops only. Names that need transformers (`LatentKVCache`,
`StaticLatentKVCache`, `PolicyCache`, `make_cache`, `enable`, `warm_up`) are imported on first access, so
``import flexentropy`` stays light. The design, layer by layer: docs/design.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from flexentropy._compile import RecompileLimitError
from flexentropy.config import EntropyConfig
from flexentropy.kv.decode_attention import decode_attention
from flexentropy.policies import CACHE_POLICIES, PREFILL_POLICIES, make_prefill
from flexentropy.policies.prefill.entropy.budgets import allocate_budgets
from flexentropy.policies.prefill.entropy.entropies import segment_entropy
from flexentropy.policies.prefill.entropy.observation import observation_attention
from flexentropy.policies.prefill.entropy.policy import select_blocks, sparse_prefill_attention
from flexentropy.sparse.plan import SparsePlan

__version__ = "0.1.0"

_LAZY = {
    "LatentKVCache": "flexentropy.caches.latent_kv",
    "PolicyCache": "flexentropy.caches.policy_cache",
    "StaticLatentKVCache": "flexentropy.caches.static_latent",
    "make_cache": "flexentropy.caches.factory",
    "enable": "flexentropy.integrations.hf",
    "disable": "flexentropy.integrations.hf",
    "enabled": "flexentropy.integrations.hf",
    "EntropyAttention": "flexentropy.entropy_attention",
    "warm_up": "flexentropy.engine.warm_up",
    "greedy_generate": "flexentropy.engine.loops",
    "generate_batch": "flexentropy.engine.batch",
    "fuse_projections": "flexentropy.surgery.fusion",
    "chunk_mlp": "flexentropy.surgery.chunked_mlp",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flexentropy' has no attribute {name!r}")


__all__ = [
    "CACHE_POLICIES",
    "PREFILL_POLICIES",
    "EntropyAttention",
    "EntropyConfig",
    "LatentKVCache",
    "PolicyCache",
    "RecompileLimitError",
    "SparsePlan",
    "StaticLatentKVCache",
    "allocate_budgets",
    "chunk_mlp",
    "decode_attention",
    "disable",
    "enable",
    "enabled",
    "fuse_projections",
    "generate_batch",
    "greedy_generate",
    "make_cache",
    "make_prefill",
    "observation_attention",
    "segment_entropy",
    "select_blocks",
    "sparse_prefill_attention",
    "warm_up",
]
