"""The entropy method's sparse prefill: observation -> entropy -> budgets -> selection, a `SparsePlan` run by the
generic kernel of `flexentropy.sparse`."""

from flexentropy._compile import RecompileLimitError
from flexentropy.prefill.budgets import allocate_budgets
from flexentropy.prefill.entropies import rigid_heads, segment_entropy
from flexentropy.prefill.observation import observation_attention
from flexentropy.prefill.selection import select_blocks
from flexentropy.prefill.sparse_prefill import dense_causal_attention, sparse_prefill_attention
from flexentropy.sparse.plan import SparsePlan

__all__ = [
    "RecompileLimitError",
    "SparsePlan",
    "allocate_budgets",
    "dense_causal_attention",
    "observation_attention",
    "rigid_heads",
    "segment_entropy",
    "select_blocks",
    "sparse_prefill_attention",
]
