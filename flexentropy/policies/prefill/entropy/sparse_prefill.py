"""`sparse_prefill_attention`: plan + kernel for one layer's prompt, or a chunk of it, with the dense fallbacks
(design.md §1.5-1.7)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexentropy._checks import check_layer_idx, check_qk, check_scale
from flexentropy.config import EntropyConfig, check_config
from flexentropy.policies.prefill.entropy.selection import plan_blocks
from flexentropy.policies.prefill.fixed import dense_plan
from flexentropy.sparse.kernel import run_plan
from flexentropy.sparse.plan import SparsePlan


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                           config: EntropyConfig | None = None, compiled: bool = True) -> torch.Tensor:
    """Plain causal attention with GQA (the dense fallback), bottom-right aligned: ``q [B, Hq, M, D]`` holds the last
    M of the positions of ``k``/``v [B, Hkv, N, D]``. ``[B, Hq, M, D]``.

    A whole prompt (M = N) runs SDPA's causal kernel. A chunk (M < N) runs the block-sparse kernel over every causal
    block with the chunk's offset (SDPA's ``is_causal`` is top-left aligned; no M x N mask is built), with
    ``config``'s block size and backend (default `EntropyConfig`'s) and ``compiled`` as `run_plan`.
    """
    if q.shape[-2] == k.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    config = check_config(config, optional=True)
    plan = dense_plan(q, config, k.shape[-2] - q.shape[-2])
    return run_plan(q, k, v, plan, scale=scale, compiled=compiled, backend=config.backend)


def sparse_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: EntropyConfig,
                             layer_idx: int = 1, *, scale: float | None = None, compiled: bool = True,
                             plan: SparsePlan | None = None, q_start: int = 0) -> torch.Tensor:
    """Entropy-guided block-sparse causal attention over a prompt (paper sec. 4.2), or over a chunk of its queries
    (chunked prefill: the chunk's queries against every key up to its last one, design.md §1.7).

    Dense layers (``layer_idx in config.dense_layers``) and short prompts (``q_start + M <= config.dense_prefix``
    keys) run plain causal attention (`dense_causal_attention`: SDPA for a whole prompt, the kernel with every causal
    block for a chunk). Otherwise the layer is planned as by `select_blocks` and compiled ``flex_attention`` runs the
    plan; a new ``q_start`` or chunk length compiles nothing new.

    Args:
        q: ``[B, Hq, M, D]`` post-RoPE queries of the positions ``q_start .. q_start + M - 1``; k, v:
            ``[B, Hkv, q_start + M, D]`` of the positions ``0 .. q_start + M - 1``.
        config: `EntropyConfig`.
        layer_idx: index of the layer (selects the dense layers).
        scale: softmax scale, > 0 (default ``1 / sqrt(D)``).
        compiled: False runs eager flex (M x N scores: tests and small N only). The compiled kernel takes
            float16, bfloat16 and float32 (a float64 input raises ``TypeError``; eager flex takes it; a whole
            prompt's dense fallback, SDPA, takes it too).
        plan: a precomputed plan for these q/k (e.g. from another policy, or `select_blocks` with the same
            ``q_start``); skips selection.
        q_start: position of the first query, an int >= 0 (0: a whole prompt).

    Returns:
        ``[B, Hq, M, D]`` in ``q.dtype``.

    On CPU it is inference-only (flex attention has no CPU backward): inputs that require grad are refused while
    grad is enabled. Under ``torch.no_grad()`` or ``torch.inference_mode()`` they run detached on every device,
    since no graph is built there (the output requires no grad, as any op's there).
    """
    check_qk(q, k, v, q_start=q_start)
    check_layer_idx(layer_idx)
    check_config(config)
    check_scale("sparse_prefill_attention", scale)
    if any(t.requires_grad for t in (q, k, v)):
        if torch.is_grad_enabled() and q.device.type == "cpu":
            raise ValueError("sparse_prefill_attention is inference-only on CPU (flex attention has no CPU "
                             "backward): call it under torch.no_grad() or torch.inference_mode()")
        if not torch.is_grad_enabled():   # no graph is built here; CPU flex refuses such inputs in any grad mode
            q, k, v = q.detach(), k.detach(), v.detach()
    if q.shape[-2] == 0:
        return q.new_empty(q.shape[:-1] + (v.shape[-1],))
    if plan is None:
        if config.is_dense_layer(layer_idx, k.shape[-2]):
            return dense_causal_attention(q, k, v, scale, config=config, compiled=compiled)
        plan = plan_blocks(q, k, config)
    elif (plan.q_start, plan.seq_len) != (q_start, k.shape[-2]) or plan.blocks.shape[:2] != q.shape[:2]:
        raise ValueError(f"plan is for q_start={plan.q_start}, N={plan.seq_len}, batch/heads "
                         f"{tuple(plan.blocks.shape[:2])} but q is {tuple(q.shape)} at q_start={q_start} over "
                         f"{k.shape[-2]} keys")
    if plan.dense:
        return dense_causal_attention(q, k, v, scale, config=config, compiled=compiled)
    return run_plan(q, k, v, plan, scale=scale, compiled=compiled, backend=config.backend)
