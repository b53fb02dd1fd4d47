"""The two policy interfaces: `PrefillPolicy` (which key blocks a prompt attends to) and `CachePolicy` (which cache
entries survive decoding).

A policy is a frozen dataclass of knobs with defaults, validated on construction (kvpress "presses" style). Policies
import torch only. A cache policy sees its layer through `flexentropy.policies.layer_view.LayerView`; the storage that
runs it (`flexentropy.caches`) depends on the policies, never the reverse (design.md §3).

Prefill policies map post-RoPE ``q [B, Hq, M, D]``, ``k [B, Hkv, N, D]`` of one layer (a whole prompt, or a chunk: its
last ``M`` positions) to a `SparsePlan` run by the same FlexAttention kernel (dense attention by SDPA), and own the
one path from every front door to that kernel (`PrefillPolicy.run`, `attend`). Cache policies are rules the shared
cache consults per layer:

* **when** to decide: `CachePolicy.before_append` (at the start of ``update``, before the new tokens are appended:
  decode-time eviction) and `CachePolicy.when_settled` (once a forward's keys, queries and, for InfoKV, hidden states
  are all in: compression right after the prefill, or every so many tokens);
* **how to score**: `CachePolicy.scores` (window attention, accumulated attention, InfoKV fusion, positions);
* **how many to keep**, per KV head and layer: the target a decision returns, and `CachePolicy.select` (rectangular:
  the same count in every head) or `CachePolicy.select_ragged` (per-head counts, stored without padding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from flexentropy._checks import check_bool, check_layer_idx, check_qk, check_scale, plain_fields
from flexentropy.config import EntropyConfig, check_config
from flexentropy.kv.keep import keep_indices
from flexentropy.policies.layer_view import LayerView
from flexentropy.policies.prefill.fixed import dense_plan
from flexentropy.sparse.kernel import run_plan
from flexentropy.sparse.plan import SparsePlan, check_plan

# --------------------------------------------------------------------------------------------------------------
# prefill

PlanEdit = Callable[[int | None, torch.Tensor, torch.Tensor, SparsePlan], SparsePlan]
"""``(layer_idx, q [B, Hq, M, D], k [B, Hkv, N, D], plan) -> plan``: replaces a rule's sparse plan before the kernel
runs it (`PrefillPolicy.run`'s ``edit``; diagnostics such as hybrid dense/sparse runs)."""


@dataclass(frozen=True)
class PrefillPolicy:
    """Base of every prefill policy: which key blocks each query block of a prompt, or of a chunk of it, attends to,
    and the one path from a layer's post-RoPE ``q``, ``k``, ``v`` to its attention (design.md §1.8).

    Every policy shares the geometry and the dense fallbacks of ``config`` (segment and block sizes, sink blocks,
    ``dense_prefix``, ``dense_last_segment``, ``dense_layers``, kernel backend): only the selection rule
    (`sparse_plan`) differs, so the comparison is on the same kernel with the same dense parts. What every front door
    calls:

    * `runs_dense`: the one decision between dense attention and the rule's plan;
    * `plan` and `attention`: the public, checked calls (``fe.select_blocks`` and ``fe.sparse_prefill_attention`` are
      the ``entropy`` rule's);
    * `run`: the path itself on arguments a front door has checked or made (the transformers attention function,
      the vLLM backend, `flexentropy.EntropyAttention`): the decision, the plan, and the kernel call (`attend`).

    A chunk is the last ``M`` positions of a prompt's ``N`` (chunked prefill, design.md §1.7): ``q [B, Hq, M, D]``
    with ``k``, ``v [B, Hkv, N, D]``, its first query at ``q_start = N - M``; a whole prompt is ``M = N``.

    Class attributes (for the registry and the docs): ``name``, ``paper``, ``keeps`` (one line), ``per_head``;
    ``always_dense``: the rule computes dense attention in every layer (``"dense"``).
    """

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    keeps: ClassVar[str] = ""
    per_head: ClassVar[bool] = False
    always_dense: ClassVar[bool] = False

    config: EntropyConfig = field(default_factory=EntropyConfig)

    def __post_init__(self) -> None:
        plain_fields(self)
        check_config(self.config, type(self).__name__)

    @property
    def knobs(self) -> dict[str, Any]:
        """The rule's own knobs (every field but ``config``), e.g. ``{"threshold": 0.9, "stride": 8}``:
        ``make_prefill(policy.name, policy.config, **policy.knobs) == policy``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config"}

    def runs_dense(self, layer_idx: int | None, key_length: int | torch.Tensor) -> bool | torch.Tensor:
        """Whether a layer runs plain causal attention instead of the rule's plan: the one dense-or-sparse decision of
        every path (design.md §1.5). Dense: a rule dense everywhere (`always_dense`), a layer of
        ``config.dense_layers``, or at most ``config.dense_prefix`` keys (a whole prompt's ``N``, a chunk's
        ``q_start + M``).

        Args:
            layer_idx: the layer's index; None when no layer is given (then only the length decides).
            key_length: an int, or an int tensor of several lengths (a serving step's requests: then a bool tensor).
        """
        dense = self.always_dense or (layer_idx is not None and layer_idx in self.config.dense_layers)
        return (key_length <= self.config.dense_prefix) | dense

    def plan(self, q: torch.Tensor, k: torch.Tensor, layer_idx: int | None = None, *, q_start: int = 0,
             compiled: bool | None = None) -> SparsePlan:
        """The plan of one layer: `SparsePlan` ``[B, Hq, C_Q, C_B]`` of the queries ``q [B, Hq, M, D]`` (positions
        ``q_start ..``) over ``k [B, Hkv, q_start + M, D]``, post-RoPE; ``dense=True`` where the layer runs dense
        (`runs_dense`), else the rule's `sparse_plan`. ``compiled``: run the rule's selection compiled where it has a
        compiled graph (the entropy rules: default on CUDA)."""
        check_plan_call(type(self).__name__ + ".plan", q, k, layer_idx, compiled, q_start)
        return self.full_plan(q, k, layer_idx, compiled)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int | None = None, *,
                  scale: float | None = None, compiled: bool = True, plan: SparsePlan | None = None,
                  q_start: int = 0) -> torch.Tensor:
        """``[B, Hq, M, Dv]``: the attention of the queries ``q [B, Hq, M, D]`` (positions ``q_start ..``) over
        ``k``, ``v [B, Hkv, q_start + M, D]`` under this rule (`run`), or under ``plan`` when given (e.g. from `plan`
        with the same ``q_start``). Arguments as ``fe.sparse_prefill_attention``'s."""
        q, k, v, scale = check_prefill_call(type(self).__name__ + ".attention", q, k, v, layer_idx, scale, compiled,
                                            plan, q_start)
        return self.run(q, k, v, layer_idx, scale=scale, compiled=compiled, plan=plan)[0]

    def layer_plan(self, q: torch.Tensor, k: torch.Tensor, layer_idx: int | None,
                   compiled: bool | None = None) -> SparsePlan | None:
        """The rule's plan of a layer that goes sparse, None where it runs dense (`runs_dense`; no query either), on
        checked arguments: ``q`` the last ``M`` positions of ``k``."""
        if q.shape[-2] == 0 or self.runs_dense(layer_idx, k.shape[-2]):
            return None
        return self.sparse_plan(q, k, compiled)

    def full_plan(self, q: torch.Tensor, k: torch.Tensor, layer_idx: int | None,
                  compiled: bool | None = None) -> SparsePlan:
        """`layer_plan`, with the plan of every causal block (``dense=True``) where the layer runs dense, on checked
        arguments (`plan`'s)."""
        plan = self.layer_plan(q, k, layer_idx, compiled)
        return dense_plan(q, self.config, k.shape[-2] - q.shape[-2]) if plan is None else plan

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int | None, *,
            scale: float | None = None, compiled: bool = True, plan: SparsePlan | None = None,
            edit: PlanEdit | None = None) -> tuple[torch.Tensor, SparsePlan | None]:
        """The prefill of one layer on checked arguments (the front doors check theirs, or made them): ``q [B, Hq, M,
        D]`` the last ``M`` positions of ``k``, ``v [B, Hkv, N, D]``; ``scale`` a float or None. Returns ``([B, Hq,
        M, Dv], plan)``: the rule's plan (`layer_plan`; ``plan`` when given, ``edit``'s when given) run by the
        kernel (`attend`), or ``None`` where the layer ran dense.

        On CPU it is inference-only (flex attention has no CPU backward): inputs that require grad are refused while
        grad is enabled; under ``torch.no_grad()`` or ``torch.inference_mode()`` they run detached on every device
        (no graph is built there). Keys or values that lie in the queries' memory (``k = x[:, :2]`` of ``q = x``) are
        copied first: compiled, Inductor's CPU code fails on them ("not declared" in its C++)."""
        if any(t.requires_grad for t in (q, k, v)):
            if torch.is_grad_enabled() and q.device.type == "cpu":
                raise ValueError("sparse prefill is inference-only on CPU (flex attention has no CPU backward): "
                                 "call it under torch.no_grad() or torch.inference_mode()")
            if not torch.is_grad_enabled():   # no graph is built here; CPU flex refuses such inputs in any grad mode
                q, k, v = q.detach(), k.detach(), v.detach()
        if q.shape[-2] == 0:
            return q.new_empty(q.shape[:-1] + (v.shape[-1],)), None
        if not (q.is_meta or torch.compiler.is_compiling()):   # Inductor's CPU code fails on keys in q's memory
            k, v = (t.clone() if t is not q and overlapping(t, q) else t for t in (k, v))
        if plan is None:
            plan = self.layer_plan(q, k, layer_idx)
            if plan is not None and edit is not None:
                plan = edit(layer_idx, q, k, plan)
        return attend(q, k, v, plan, self.config, scale=scale, compiled=compiled), plan

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor, compiled: bool | None = None) -> SparsePlan:
        """The rule: the plan of a layer that goes sparse, on checked arguments. ``q [B, Hq, M, D]`` holds the last
        ``M`` positions of ``k [B, Hkv, N, D]`` (a chunk from ``q_start = N - M``; a whole prompt when ``M = N``);
        the plan's rows are the query blocks holding them, on the grid from position 0. ``compiled``: as `plan`'s."""
        raise NotImplementedError


def overlapping(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` lie in one storage over intersecting address ranges (views whose elements interleave,
    such as a fused projection's q/k/v, count; disjoint slices do not)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()

    (a_start, a_end), (b_start, b_end) = span(a), span(b)
    return a_start < b_end and b_start < a_end


def check_plan_call(owner: str, q: torch.Tensor, k: torch.Tensor, layer_idx: int | None, compiled: object,
                    q_start: int) -> None:
    """The checks of a public call for a plan (``owner`` names it in the messages), once: ``q``, ``k`` and ``q_start``
    agree, ``layer_idx`` is an int >= 0 or None, ``compiled`` a bool or None."""
    check_qk(q, k, q_start=q_start)
    check_layer_idx(layer_idx, optional=True)
    check_bool(owner, "compiled", compiled, optional=True)


def check_prefill_call(owner: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int | None,
                       scale: object, compiled: object, plan: SparsePlan | None, q_start: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None]:
    """The checks of a public prefill call (``owner`` names it in the messages), once: ``q``, ``k``, ``v`` and
    ``q_start`` agree, ``layer_idx`` is an int >= 0 or None, ``scale`` None or a finite number > 0 (returned as
    Python's float: a numpy number would reach the compiled kernel as a constant it cannot take), ``compiled`` a
    bool, ``plan`` None or a `SparsePlan` of these queries and keys. Returns ``(q, k, v, scale)``."""
    check_qk(q, k, v, q_start=q_start)
    check_layer_idx(layer_idx, optional=True)
    scale = check_scale(owner, scale)
    check_bool(owner, "compiled", compiled)
    if plan is not None:
        check_plan(plan, q, k, q_start)
    return q, k, v, scale


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SparsePlan | None, config: EntropyConfig, *,
           scale: float | None = None, compiled: bool = True) -> torch.Tensor:
    """The kernel call of every prefill: the queries ``q [B, Hq, M, D]`` (the last ``M`` positions) over ``k``, ``v
    [B, Hkv, N, D]`` under ``plan``, or dense causal attention where ``plan`` is None or dense (bottom-right aligned
    for a chunk). ``[B, Hq, M, Dv]``.

    A sparse plan, and a dense chunk (SDPA's ``is_causal`` is top-left aligned; no M x N mask is built), run the
    block-sparse kernel (`run_plan`, with ``config``'s backend; ``compiled=False``: eager flex, M x N scores, small
    N only); a whole prompt's dense attention runs SDPA's causal kernel. Meta tensors give the output's shape."""
    if plan is None or plan.dense:
        if q.shape[-2] == k.shape[-2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        if plan is None:
            plan = dense_plan(q, config, k.shape[-2] - q.shape[-2])
    if q.is_meta:     # meta tensors (shapes without data; flex has no meta form): the output's shape
        return q.new_empty(q.shape[:-1] + (v.shape[-1],))
    return run_plan(q, k, v, plan, scale=scale, compiled=compiled, backend=config.backend)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                           config: EntropyConfig | None = None, compiled: bool = True) -> torch.Tensor:
    """Plain causal attention with GQA (the dense fallback, `attend` without a plan), bottom-right aligned: ``q [B, Hq,
    M, D]`` holds the last M of the positions of ``k``/``v [B, Hkv, N, D]``. ``[B, Hq, M, D]``; a chunk runs with
    ``config``'s block size and backend (default `EntropyConfig`'s) and ``compiled`` as `run_plan`."""
    return attend(q, k, v, None, check_config(config, optional=True), scale=scale, compiled=compiled)


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
