"""KV-cache compression during decoding (SPEC 2-3): *score -> keep -> gather*, then attend over what is kept.

- :mod:`.scoring`: importance of cached keys under a window of queries (``window_attention_scores``,
  ``pool_scores``);
- :mod:`.keep`: which entries survive (``keep_indices``) and the compressed tensors (``gather_kv``);
- :mod:`.latent`: :class:`LatentKVCache`, the paper's latent eviction (Alg. 4) as a transformers ``Cache``;
- :mod:`.attention`: ``decode_attention`` over the compressed, per-KV-head cache.
"""

from flexentropy.cache.attention import decode_attention
from flexentropy.cache.keep import KeptKV, gather_kv, keep_indices
from flexentropy.cache.latent import LatentKVCache, LatentLayer
from flexentropy.cache.scoring import SCORE_KINDS, pool_scores, window_attention_scores

__all__ = [
    "SCORE_KINDS",
    "KeptKV",
    "LatentKVCache",
    "LatentLayer",
    "decode_attention",
    "gather_kv",
    "keep_indices",
    "pool_scores",
    "window_attention_scores",
]
