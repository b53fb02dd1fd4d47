"""Torch-only operations on a KV cache (design.md §2): *score -> keep -> gather*, then attend over what is kept.

- :mod:`.scoring`: importance of cached keys under a window of queries (``window_attention_scores``, ``pool_scores``,
  ``spread_forward``);
- :mod:`.keep`: which entries survive (``keep_indices``) and the compressed tensors (``gather_kv``);
- :mod:`.decode`: ``decode_attention`` over the compressed, per-KV-head cache;
- :mod:`.ragged`: the ragged per-head layout (``RaggedKV``) and ``ragged_decode_attention`` over it.

Nothing here imports transformers or any other part of flexentropy: policies and cache storage build on it.
"""

from __future__ import annotations

from flexentropy.kv.decode_attention import decode_attention
from flexentropy.kv.keep import KeptKV, gather_kv, keep_indices
from flexentropy.kv.ragged import RaggedKV, ragged_decode_attention
from flexentropy.kv.scoring import SCORE_KINDS, pool_scores, spread_forward, window_attention_scores

__all__ = [
    "SCORE_KINDS",
    "KeptKV",
    "RaggedKV",
    "decode_attention",
    "gather_kv",
    "keep_indices",
    "pool_scores",
    "spread_forward",
    "ragged_decode_attention",
    "window_attention_scores",
]
