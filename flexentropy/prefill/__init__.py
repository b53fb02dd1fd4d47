"""Deprecated: the entropy rule's stages moved beside the other prefill rules, to
`flexentropy.policies.prefill.entropy`; their public names are `flexentropy`'s (``fe.select_blocks``,
``fe.sparse_prefill_attention``, ``fe.observation_attention``, ``fe.segment_entropy``, ``fe.allocate_budgets``,
``fe.SparsePlan``, ``fe.RecompileLimitError``).

Every old name still works, here and in the old modules (``flexentropy.prefill.selection``, ...), which this
package registers, with a ``DeprecationWarning`` naming the new place.
"""

import sys
import types

from flexentropy._deprecated import moved

ENTROPY = "flexentropy.policies.prefill.entropy"
FIXED = "flexentropy.policies.prefill.fixed"

OLD_MODULES = {
    "budgets": (f"{ENTROPY}.budgets",),
    "entropies": (f"{ENTROPY}.entropies",),
    "observation": (f"{ENTROPY}.observation", FIXED),
    "peer_estimates": ("flexentropy.policies.prefill.estimates",),
    "probe_mass": (f"{ENTROPY}.probe_mass",),
    "representatives": (f"{ENTROPY}.representatives",),
    "selection": (f"{ENTROPY}.selection", f"{ENTROPY}.policy", FIXED, "flexentropy.policies.prefill.ranking"),
    "sparse_prefill": (f"{ENTROPY}.policy", "flexentropy.policies.base"),
}
"""The old modules and where their names went (searched in order)."""

for _old, _homes in OLD_MODULES.items():
    _module = types.ModuleType(f"{__name__}.{_old}", f"Deprecated: moved to {', '.join(_homes)}.")
    _module.__getattr__ = moved(_module.__name__, _homes)  # type: ignore[method-assign]
    sys.modules[_module.__name__] = _module
    globals()[_old] = _module

__getattr__ = moved(__name__, {
    "RecompileLimitError": "flexentropy",
    "SparsePlan": "flexentropy",
    "allocate_budgets": "flexentropy",
    "dense_causal_attention": "flexentropy.policies.base",
    "observation_attention": "flexentropy",
    "rigid_heads": f"{ENTROPY}.entropies",
    "segment_entropy": "flexentropy",
    "select_blocks": "flexentropy",
    "sparse_prefill_attention": "flexentropy",
})
