"""Block-sparse attention kernel: ``flex_attention`` over a `SparsePlan`, compiled once for every length.

The BlockMask is built *inside* the compiled region from the plan's tensors, and the region is compiled with
``dynamic=True``, so a new sequence length reuses the same graph instead of recompiling (each CPU compile costs
~15 s; past ``torch._dynamo.config.recompile_limit`` recompiles, flex would silently fall back to the eager
path that materialises every score: an out-of-memory at long N). Hitting the limit raises instead.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch.nn.attention.flex_attention import flex_attention

from flexentropy.config import Q_BLOCK_SIZE
from flexentropy.prefill.plan import SparsePlan, block_mask_tensors, make_block_mask


class RecompileLimitError(RuntimeError):
    """Raised instead of silently falling back to eager flex attention (which would materialise N x N scores)."""


@functools.cache
def flash_available() -> bool:
    """Whether flex attention's FLASH backend (the flash-attn-4 CuTe kernels) can run here."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("flash_attn.cute")
    except Exception:  # absent, or flash-attn 2 without the CuTe kernels, or a broken install
        return False
    return True


def kernel_options(backend: str, device: torch.device, block_size: int) -> dict[str, object] | None:
    """flex ``kernel_options`` for ``backend`` (``"auto"``, ``"triton"``, ``"flash"``) on ``device``."""
    if device.type != "cuda":
        if backend == "flash":
            raise ValueError("backend='flash' needs a CUDA device")
        return None
    if backend == "flash" or (backend == "auto" and flash_available() and block_size == 128):
        if block_size != 128:
            raise ValueError(f"backend='flash' needs block_size=128, got {block_size}")
        if not flash_available():
            raise ValueError("backend='flash' needs flash-attn-4 (`pip install flash-attn-4`); "
                             "use backend='auto' to fall back to Triton")
        return {"BACKEND": "FLASH"}
    return None


def _flex_over_table(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                     tensors: tuple[torch.Tensor, ...], block_size: int, q_block_size: int, scale: float | None,
                     options: dict[str, object] | None) -> torch.Tensor:
    block_mask = make_block_mask(blocks, q.shape[-2], block_size, tensors, q_block_size)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          kernel_options=options)


_compiled_flex_over_table = torch.compile(_flex_over_table, dynamic=True, fullgraph=True)


def run_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SparsePlan, *, scale: float | None = None,
             compiled: bool = True, backend: str = "auto") -> torch.Tensor:
    """Attention of ``q [B, Hq, N, D]`` over ``k``/``v [B, Hkv, N, D]`` restricted to ``plan``.

    ``compiled=False`` runs eager ``flex_attention``, which evaluates the plan's ``mask_mod`` on all N x N scores
    (small N only; used by the property tests). Output dtype = ``q.dtype``.
    """
    blocks, q_block = plan.blocks, Q_BLOCK_SIZE
    if q.device.type == "cpu" and plan.block_size != Q_BLOCK_SIZE:
        # Inductor's CPU flex template miscompiles Q block 128 x KV block 64 with dynamic shapes; the same
        # table at query blocks of 64 (each row repeated) is the same function and compiles fine.
        q_block = plan.block_size
        blocks = blocks.repeat_interleave(Q_BLOCK_SIZE // q_block, dim=-2)[..., : -(-plan.seq_len // q_block), :]
    tensors = block_mask_tensors(blocks, plan.seq_len, plan.block_size, q_block)
    if not compiled:
        return _flex_over_table(q, k, v, blocks, tensors, plan.block_size, q_block, scale, None)
    options = kernel_options(backend, q.device, plan.block_size)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return _compiled_flex_over_table(q, k, v, blocks, tensors, plan.block_size, q_block, scale, options)
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise RecompileLimitError(
            "flexentropy's sparse kernel hit torch._dynamo.config.recompile_limit "
            f"({torch._dynamo.config.recompile_limit}); refusing the eager fallback, which materialises "
            "N x N attention scores. Raise the limit or keep dtypes/devices/head counts fixed across calls."
        ) from err
