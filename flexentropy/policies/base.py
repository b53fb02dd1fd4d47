"""The two policy interfaces: `PrefillPolicy` (which key blocks a prompt attends to) and `CachePolicy` (which cache
entries survive decoding).

A policy is a frozen dataclass of knobs with defaults, validated on construction (kvpress "presses" style). Policies
import torch only. A cache policy sees its layer through `flexentropy.policies.layer_view.LayerView`; the storage that
runs it (`flexentropy.caches`) depends on the policies, never the reverse (design.md §3).

Prefill policies map post-RoPE ``q [B, Hq, N, D]``, ``k [B, Hkv, N, D]`` of one layer to a `SparsePlan` run by the
same FlexAttention kernel (dense plans by SDPA). Cache policies are rules the shared cache consults per layer:

* **when** to decide: `CachePolicy.before_append` (at the start of ``update``, before the new tokens are appended:
  decode-time eviction) and `CachePolicy.when_settled` (once a forward's keys, queries and, for InfoKV, hidden states
  are all in: compression right after the prefill, or every so many tokens);
* **how to score**: `CachePolicy.scores` (window attention, accumulated attention, InfoKV fusion, positions);
* **how many to keep**, per KV head and layer: the target a decision returns, and `CachePolicy.select` (rectangular:
  the same count in every head) or `CachePolicy.select_ragged` (per-head counts, stored without padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from flexentropy._checks import check_layer_idx, check_qk, plain_fields
from flexentropy.config import EntropyConfig, check_config
from flexentropy.kv.keep import keep_indices
from flexentropy.policies.layer_view import LayerView
from flexentropy.policies.prefill.entropy.sparse_prefill import sparse_prefill_attention
from flexentropy.policies.prefill.fixed import dense_plan
from flexentropy.sparse.plan import SparsePlan

# --------------------------------------------------------------------------------------------------------------
# prefill


@dataclass(frozen=True)
class PrefillPolicy:
    """Base of every prefill policy: which key blocks each query block of a prompt attends to.

    Every policy shares the geometry and the dense fallbacks of ``config`` (segment and block sizes, sink blocks,
    ``dense_prefix``, ``dense_last_segment``, ``dense_layers``, kernel backend): only the selection rule differs,
    so the comparison is on the same kernel with the same dense parts.

    Class attributes (for the registry and the docs): ``name``, ``paper``, ``keeps`` (one line), ``per_head``.
    """

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    keeps: ClassVar[str] = ""
    per_head: ClassVar[bool] = False

    config: EntropyConfig = field(default_factory=EntropyConfig)

    def __post_init__(self) -> None:
        plain_fields(self)
        check_config(self.config, type(self).__name__)

    @property
    def knobs(self) -> dict[str, Any]:
        """The rule's own knobs (every field but ``config``), e.g. ``{"threshold": 0.9, "stride": 8}``:
        ``make_prefill(policy.name, policy.config, **policy.knobs) == policy``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config"}

    def plan(self, q: torch.Tensor, k: torch.Tensor, layer_idx: int = 1) -> SparsePlan:
        """Plan of one layer: ``q [B, Hq, N, D]``, ``k [B, Hkv, N, D]`` post-RoPE -> `SparsePlan` ``[B, Hq, C_Q, C_B]``
        (``dense=True`` where the layer runs plain causal attention: `EntropyConfig.is_dense_layer`); the sparse
        layers' plan is the rule's `sparse_plan`."""
        check_qk(q, k)
        check_layer_idx(layer_idx)
        if self.config.is_dense_layer(layer_idx, q.shape[-2]):
            return dense_plan(q, self.config)
        return self.sparse_plan(q, k)

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor) -> SparsePlan:
        """The rule: the plan of a layer that goes sparse (inputs already checked), ``[B, Hq, C_Q, C_B]``."""
        raise NotImplementedError

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int = 1, *,
                  scale: float | None = None, compiled: bool = True) -> torch.Tensor:
        """``[B, Hq, N, Dv]``: the plan run by the shared kernel (`sparse_prefill_attention`), dense plans by SDPA."""
        plan = self.plan(q, k, layer_idx)
        return sparse_prefill_attention(q, k, v, self.config, layer_idx, scale=scale, compiled=compiled, plan=plan)


# --------------------------------------------------------------------------------------------------------------
# cache


@dataclass(frozen=True)
class CachePolicy:
    """Base of every cache policy: a scoring/keep rule that the shared storage (`flexentropy.caches.PolicyCache`)
    consults per layer, through a `LayerView`.

    Storage is per KV head (never expanded to the query heads). A rectangular policy keeps the same number of
    entries in every head (``select``); a ragged one (``ragged = True``) keeps per-head counts and the cache stores
    them without padding (``select_ragged``).

    Class attributes (for the cache and the docs):
        name, paper: registry name and source.
        keeps, decides: one-line descriptions of the kept set and of when it is decided.
        per_head: budgets differ per head (otherwise every head keeps the same count, chosen per head).
        ragged: per-head counts stored without padding.
        stats: per-entry statistics the cache stores and gathers with the entries, name -> fill value of new entries.
        accumulates: the cache hands every query to `on_queries` once its keys are stored (H2O).

    A policy that scores with queries (`uses_queries`) needs them handed over on every forward: the cache raises
    at the first forward that stored keys without them.
    """

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    keeps: ClassVar[str] = ""
    decides: ClassVar[str] = ""
    per_head: ClassVar[bool] = False
    ragged: ClassVar[bool] = False
    stats: ClassVar[dict[str, float]] = {}
    accumulates: ClassVar[bool] = False

    def __post_init__(self) -> None:
        plain_fields(self)

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        """The names `from_knobs` takes (e.g. ``("budget", "window")``)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_knobs(cls, **knobs: Any) -> CachePolicy:
        """The policy with ``knobs`` (names of `knob_names`), the others at their defaults."""
        return cls(**knobs)

    # -- what the cache needs from the model ----------------------------------------------------------------
    @property
    def query_window(self) -> int:
        """Most recent post-RoPE queries each layer keeps for scoring (0: none)."""
        return 0

    @property
    def needs_signals(self) -> bool:
        """Whether the rule needs the model's hidden states and predictive distribution (InfoKV)."""
        return False

    @property
    def uses_queries(self) -> bool:
        return self.query_window > 0 or self.accumulates

    def capacity(self) -> int | None:
        """Most entries per KV head the cache ever holds after a forward (None: unbounded)."""
        return None

    # -- when ------------------------------------------------------------------------------------------------
    def before_append(self, layer: LayerView, incoming: int) -> int | None:
        """Entries per KV head to keep before appending ``incoming`` tokens, or None (no decision). Pure: HF also
        calls it through ``get_mask_sizes`` to size its masks."""
        return None

    def when_settled(self, layer: LayerView) -> int | None:
        """Entries per KV head to keep once the layer's keys, queries (and signals) of a forward are all in."""
        return None

    # -- what ------------------------------------------------------------------------------------------------
    def scores(self, layer: LayerView) -> torch.Tensor:
        """Importance of every stored entry, ``[B, Hkv, S]`` (higher is kept first)."""
        raise NotImplementedError

    def forced(self, layer: LayerView, incoming: int) -> int | torch.Tensor:
        """Entries kept whatever their score: an int ``n`` (the last ``n``) or a bool mask ``[B, Hkv, S]``."""
        return 0

    def ranked_scores(self, layer: LayerView) -> torch.Tensor:
        """`scores` with left-padding entries at ``-inf`` (kept only when nothing real is left), ``[B, Hkv, S]``."""
        scores, real = self.scores(layer), layer.real_entries()
        return scores if real is None else scores.masked_fill(~real, float("-inf"))

    def select(self, layer: LayerView, target: int, incoming: int) -> torch.Tensor:
        """Indices ``[B, Hkv, min(target, S)]`` of the kept entries, ascending (same count in every head)."""
        return keep_indices(self.ranked_scores(layer), target, self.forced(layer, incoming))

    def select_ragged(self, layer: LayerView, target: int) -> torch.Tensor:
        """Ragged policies: bool keep mask ``[B, Hkv, S]`` with per-head counts."""
        raise NotImplementedError

    def on_queries(self, layer: LayerView, queries: torch.Tensor, first_position: int) -> None:
        """Accumulating policies: fold ``queries [B, Hq, L, D]`` (positions ``first_position ..``) into stats."""

    def signal(self, hidden: torch.Tensor, last_hidden: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """Signal policies: the per-token statistic ``[B, L]`` of a layer from its hidden states ``[B, L, d]``, the
        last layer's and the predictive entropy ``[B, L]``."""
        raise NotImplementedError

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Signal policies: the predictive entropy ``[B, l]`` of next-token ``logits [B, l, V]`` (passed to
        `signal`)."""
        raise NotImplementedError
