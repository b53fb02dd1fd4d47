"""``entropy``: entropy-guided sparse prefill (design.md §1; EntropyInfer, paper sec. 4.2, Alg. 1-3), and its two
public front doors, ``fe.select_blocks`` and ``fe.sparse_prefill_attention`` (the rule's `PrefillPolicy.plan` and
`PrefillPolicy.attention` on an `EntropyConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexentropy.config import EntropyConfig, check_config
from flexentropy.policies.base import PrefillPolicy, check_plan_call, check_prefill_call
from flexentropy.policies.prefill.entropy.selection import plan_blocks
from flexentropy.sparse.plan import SparsePlan


@dataclass(frozen=True)
class EntropyPrefill(PrefillPolicy):
    """Per-head, per-segment budgets from the observation attention; every knob is in ``config`` (default: the probe
    observation with coverage budgets, design.md §1.2b/§1.4b; `EntropyConfig.paper` or ``entropy_paper``: the
    paper's Alg. 2-3)."""

    name = "entropy"
    paper = "EntropyInfer (From Rigid to Dynamic, 2026), sec. 4.2"
    keeps = "own segment, sink/local blocks, top-k blocks by A_obs with k per (head, segment) from entropy"
    per_head = True

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor, compiled: bool | None = None) -> SparsePlan:
        """`select_blocks`'s plan (design.md §1.1-1.5, a chunk's §1.7)."""
        return plan_blocks(q, k, self.config, compiled=compiled)


@dataclass(frozen=True)
class EntropyPaperPrefill(EntropyPrefill):
    """The paper's method as published, whatever ``config`` says of the observation and the budget rule: Alg. 2's
    representatives and Alg. 3's fluctuation budgets from ``base_budget`` (`EntropyConfig.paper`)."""

    name = "entropy_paper"
    keeps = "own segment, sink/local blocks, top-k blocks by Alg. 2's A_obs with k per (head, segment) from Alg. 3"

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor, compiled: bool | None = None) -> SparsePlan:
        """`select_blocks`'s plan with ``observation="paper"`` and ``budget_rule="fluctuation"`` (a chunk's
        recurrence restarts at the chunk, design.md §1.7)."""
        return plan_blocks(q, k, self.config.replace(observation="paper", budget_rule="fluctuation"),
                           compiled=compiled)


def select_blocks(q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, layer_idx: int | None = None, *,
                  compiled: bool | None = None, q_start: int = 0) -> SparsePlan:
    """Entropy-guided sparse plan for one layer (paper Alg. 1-3, design.md §1.1-1.5), of a whole prompt or of a
    chunk of its queries (chunked prefill, design.md §1.7): the ``entropy`` rule's `PrefillPolicy.plan`.

    A chunk's segments and key blocks stay on the grid from position 0. A segment the chunk holds only part of at
    its start runs dense (its probes are in the previous chunk), and with ``dense_last_segment`` so do the
    segments holding the chunk's last ``segment_size`` tokens; the coverage is taken at the key length
    ``q_start + M``. Every other segment's observation uses its own queries (all in the chunk) and the keys before
    them, so it is the whole prompt's (under ``budget_rule="fluctuation"`` the recurrence restarts at the chunk).

    Args:
        q: ``[B, Hq, M, D]`` post-RoPE queries of the positions ``q_start .. q_start + M - 1`` (a whole prompt:
            ``q_start=0``, ``M = N``). k: ``[B, Hkv, q_start + M, D]`` post-RoPE keys of the positions
            ``0 .. q_start + M - 1``.
        config: knobs (segment/block sizes, budgets, dense fallbacks).
        layer_idx: the layer's index: layers in ``config.dense_layers`` get a dense plan. None (no layer given):
            only the length decides; ``q_start + M <= dense_prefix`` keys get a dense plan in any layer.
        compiled: run selection as one compiled graph (default: on CUDA, where it fuses ~100 small kernels;
            eager on CPU); a new ``q_start`` or length reuses it. If that graph fails to compile, a warning is given
            and selection runs eagerly.
        q_start: position of the first query, an int >= 0.

    Returns:
        `SparsePlan` with the block table (rows: the query blocks holding the queries), budgets, entropies and
        rigid-head flags.
    """
    policy = EntropyPrefill(check_config(config))
    check_plan_call("select_blocks", q, k, layer_idx, compiled, q_start)
    return policy.full_plan(q, k, layer_idx, compiled)


def sparse_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: EntropyConfig,
                             layer_idx: int | None = None, *, scale: float | None = None, compiled: bool = True,
                             plan: SparsePlan | None = None, q_start: int = 0) -> torch.Tensor:
    """Entropy-guided block-sparse causal attention over a prompt (paper sec. 4.2), or over a chunk of its queries
    (chunked prefill: the chunk's queries against every key up to its last one, design.md §1.7): the ``entropy``
    rule's `PrefillPolicy.attention`.

    Dense layers (``layer_idx in config.dense_layers``) and short prompts (``q_start + M <= config.dense_prefix``
    keys) run plain causal attention (SDPA for a whole prompt, the kernel with every causal block for a chunk).
    Otherwise the layer is planned as by `select_blocks` and compiled ``flex_attention`` runs the plan; a new
    ``q_start`` or chunk length compiles nothing new.

    Args:
        q: ``[B, Hq, M, D]`` post-RoPE queries of the positions ``q_start .. q_start + M - 1``; k, v:
            ``[B, Hkv, q_start + M, D]`` of the positions ``0 .. q_start + M - 1``.
        config: `EntropyConfig`.
        layer_idx: index of the layer (selects the dense layers); None (no layer given): only the length decides.
        scale: softmax scale, > 0 (default ``1 / sqrt(D)``).
        compiled: False runs eager flex (M x N scores: tests and small N only). The compiled kernel takes
            float16, bfloat16 and float32 (a float64 input raises ``TypeError``; eager flex takes it; a whole
            prompt's dense fallback, SDPA, takes it too).
        plan: a precomputed plan for these q/k (e.g. from another policy, or `select_blocks` with the same
            ``q_start``); skips selection. Checked against the queries and keys.
        q_start: position of the first query, an int >= 0 (0: a whole prompt).

    Returns:
        ``[B, Hq, M, D]`` in ``q.dtype`` (on meta tensors, which hold no data, an empty one of that shape).

    On CPU it is inference-only (flex attention has no CPU backward): inputs that require grad are refused while
    grad is enabled. Under ``torch.no_grad()`` or ``torch.inference_mode()`` they run detached on every device,
    since no graph is built there (the output requires no grad, as any op's there).
    """
    policy = EntropyPrefill(check_config(config))
    q, k, v, scale = check_prefill_call("sparse_prefill_attention", q, k, v, layer_idx, scale, compiled, plan,
                                        q_start)
    return policy.run(q, k, v, layer_idx, scale=scale, compiled=compiled, plan=plan)[0]
