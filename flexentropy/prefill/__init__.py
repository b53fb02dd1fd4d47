"""Entropy-guided sparse prefill: observation -> entropy -> budgets -> selection -> BlockMask -> kernel."""

from flexentropy._compile import RecompileLimitError
from flexentropy.prefill.attention import dense_causal_attention, sparse_prefill_attention
from flexentropy.prefill.budgets import allocate_budgets
from flexentropy.prefill.entropy import rigid_heads, segment_entropy
from flexentropy.prefill.observation import observation_attention
from flexentropy.prefill.plan import SparsePlan
from flexentropy.prefill.selection import select_blocks

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
