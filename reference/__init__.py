"""Dense reference oracle for flexentropy (design.md §4: "every function above has its twin there").

Plain PyTorch, float64 by default, explicit loops and full ``N x N`` masks (small ``N`` only), no FlexAttention.
Independent of ``flexentropy.policies``: use it to check the fast implementation, never the other way round.
"""

from reference.cache import LatentCacheOracle, evict, keep_indices, pool_scores, window_attention_scores
from reference.prefill import (
    ReferencePlan,
    allocate_budgets,
    blocks_to_dense_mask,
    candidate_blocks,
    coverage_budgets,
    masked_attention,
    observation_attention,
    rigid_heads,
    segment_entropy,
    segment_representatives,
    select_blocks,
    sparse_prefill_attention,
)

__all__ = [
    "LatentCacheOracle",
    "evict",
    "keep_indices",
    "pool_scores",
    "window_attention_scores",
    "ReferencePlan",
    "allocate_budgets",
    "coverage_budgets",
    "blocks_to_dense_mask",
    "candidate_blocks",
    "masked_attention",
    "observation_attention",
    "rigid_heads",
    "segment_entropy",
    "segment_representatives",
    "select_blocks",
    "sparse_prefill_attention",
]
