"""flexentropy: entropy-guided sparse prefill and KV-cache eviction for long-context LLMs on FlexAttention."""

from flexentropy.config import EntropyConfig
from flexentropy.prefill import (
    RecompileLimitError,
    SparsePlan,
    allocate_budgets,
    observation_attention,
    segment_entropy,
    select_blocks,
    sparse_prefill_attention,
)

__version__ = "0.1.0"

__all__ = [
    "EntropyConfig",
    "RecompileLimitError",
    "SparsePlan",
    "allocate_budgets",
    "observation_attention",
    "segment_entropy",
    "select_blocks",
    "sparse_prefill_attention",
]
