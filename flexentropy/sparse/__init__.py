"""Generic block-sparse attention, whatever rule chose the blocks (design.md §1.6): a `SparsePlan` (a per-head block
table and its `BlockMask`, :mod:`.plan`) run by compiled ``flex_attention`` (`run_plan`, :mod:`.kernel`). Every prefill
policy's plan runs here; the rules that make plans are in `flexentropy.policies.prefill`."""

from flexentropy.sparse.kernel import run_plan
from flexentropy.sparse.plan import SparsePlan, causal_blocks

__all__ = ["SparsePlan", "causal_blocks", "run_plan"]
