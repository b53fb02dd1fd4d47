"""`sparse_prefill_attention`: plan + kernel for one layer's prompt, with the dense fallbacks (design.md §1.5-1.6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexentropy._checks import check_layer_idx, check_number, check_qk
from flexentropy.config import EntropyConfig, check_config
from flexentropy.prefill.selection import plan_blocks
from flexentropy.sparse.kernel import run_plan
from flexentropy.sparse.plan import SparsePlan


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """Plain causal attention with GQA through SDPA (the dense fallback). ``[B, Hq, N, D]``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def sparse_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: EntropyConfig,
                             layer_idx: int = 1, *, scale: float | None = None, compiled: bool = True,
                             plan: SparsePlan | None = None) -> torch.Tensor:
    """Entropy-guided block-sparse causal attention over a prompt (paper sec. 4.2).

    Dense layers (``layer_idx in config.dense_layers``) and short prompts (``N <= config.dense_prefix``) run
    causal SDPA. Otherwise the layer is planned as by `select_blocks` and compiled ``flex_attention`` runs the plan.

    Args:
        q: ``[B, Hq, N, D]`` post-RoPE queries; k, v: ``[B, Hkv, N, D]``.
        config: `EntropyConfig`.
        layer_idx: index of the layer (selects the dense layers).
        scale: softmax scale, > 0 (default ``1 / sqrt(D)``).
        compiled: False runs eager flex (N x N scores: tests and small N only). The compiled kernel takes
            float16, bfloat16 and float32 (a float64 input raises ``TypeError``; eager flex takes it).
        plan: a precomputed plan for these q/k (e.g. from another policy); skips selection.

    Returns:
        ``[B, Hq, N, D]`` in ``q.dtype``.
    """
    check_qk(q, k, v)
    check_layer_idx(layer_idx)
    check_config(config)
    if scale is not None:
        check_number("sparse_prefill_attention", "scale", scale, 0, open_low=True)
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("sparse_prefill_attention is inference-only on CPU (flex attention has no CPU backward): "
                         "call it under torch.no_grad() or torch.inference_mode()")
    n = q.shape[-2]
    if n == 0:
        return q.new_empty(q.shape[:-1] + (v.shape[-1],))
    if plan is None:
        if config.is_dense_layer(layer_idx, n):
            return dense_causal_attention(q, k, v, scale)
        plan = plan_blocks(q, k, config)
    elif plan.seq_len != n or plan.blocks.shape[:2] != q.shape[:2]:
        raise ValueError(f"plan is for N={plan.seq_len}, batch/heads {tuple(plan.blocks.shape[:2])} but q is "
                         f"{tuple(q.shape)}")
    if plan.dense:
        return dense_causal_attention(q, k, v, scale)
    return run_plan(q, k, v, plan, scale=scale, compiled=compiled, backend=config.backend)
