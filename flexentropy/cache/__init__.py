"""KV-cache compression during decoding (SPEC 2-3): *score -> keep -> gather*, then attend over what is kept.

- :mod:`.scoring`: importance of cached keys under a window of queries (``window_attention_scores``,
  ``pool_scores``);
- :mod:`.keep`: which entries survive (``keep_indices``) and the compressed tensors (``gather_kv``);
- :mod:`.base`: :class:`PolicyCache`, the transformers ``Cache`` every cache policy of :mod:`flexentropy.policies`
  plugs its rule into (rectangular or ragged per-head storage);
- :mod:`.latent`: :class:`LatentKVCache`, the paper's latent eviction (Alg. 4) as a transformers ``Cache``;
- :mod:`.attention`: ``decode_attention`` over the compressed, per-KV-head cache; :mod:`.ragged`:
  ``ragged_decode_attention`` over per-head budgets of different sizes.

The names that need transformers (``PolicyCache``, ``LatentKVCache``, ``LatentLayer``, ``PolicyLayer``) are imported
on first access, so the torch-only machinery can be used without it.
"""

from __future__ import annotations

import importlib
from typing import Any

from flexentropy.cache.attention import decode_attention
from flexentropy.cache.keep import KeptKV, gather_kv, keep_indices
from flexentropy.cache.ragged import ragged_decode_attention
from flexentropy.cache.scoring import SCORE_KINDS, pool_scores, window_attention_scores

_LAZY = {
    "LatentKVCache": "flexentropy.cache.latent",
    "LatentLayer": "flexentropy.cache.latent",
    "PolicyCache": "flexentropy.cache.base",
    "PolicyLayer": "flexentropy.cache.base",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flexentropy.cache' has no attribute {name!r}")


__all__ = [
    "SCORE_KINDS",
    "KeptKV",
    "LatentKVCache",
    "LatentLayer",
    "PolicyCache",
    "PolicyLayer",
    "decode_attention",
    "gather_kv",
    "keep_indices",
    "pool_scores",
    "ragged_decode_attention",
    "window_attention_scores",
]
