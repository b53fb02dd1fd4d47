"""Block-sparse attention kernel: ``flex_attention`` over a `SparsePlan`, compiled once for every length.

The BlockMask is built *inside* the compiled region from the plan's tensors, and the region is compiled with
``dynamic=True``, so a new sequence length reuses the same graph instead of recompiling (each compile costs
seconds; past ``torch._dynamo.config.recompile_limit`` recompiles, flex would silently fall back to the eager
path that materialises every score: an out-of-memory at long N). Hitting the limit raises instead.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch.nn.attention.flex_attention import flex_attention

from flexentropy._compile import keep_dynamic, no_silent_fallback
from flexentropy.sparse.plan import SparsePlan, block_mask_tensors, make_block_mask

COMPILED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Input dtypes of the compiled kernel (Inductor has no float64 FlexAttention)."""


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


def kernel_options(backend: str, device: torch.device, block_size: int,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, object] | None:
    """flex ``kernel_options`` for ``backend`` (``"auto"``, ``"triton"``, ``"flash"``) on ``device``.

    ``"auto"`` picks FLASH (flash-attn-4, the faster kernel on Hopper GPUs: docs/performance.md) where it can run: CUDA,
    16-bit inputs, ``block_size == 128``, flash-attn-4 importable; otherwise Triton (or the CPU kernel).
    Triton's default tile for head dim 64 is 128 keys wide, which a 64-key block cannot hold: below 128 the tile
    width (``BLOCK_N``) is pinned to the block size.
    """
    if device.type != "cuda":
        if backend == "flash":
            raise ValueError("backend='flash' needs a CUDA device")
        return None
    half = dtype in (torch.float16, torch.bfloat16)
    if backend == "flash" or (backend == "auto" and half and block_size == 128 and flash_available()):
        if block_size != 128:
            raise ValueError(f"backend='flash' needs block_size=128, got {block_size}")
        if not half:
            raise ValueError(f"backend='flash' needs float16 or bfloat16 inputs, got {dtype}")
        if not flash_available():
            raise ValueError("backend='flash' needs flash-attn-4 (`pip install flash-attn-4`); "
                             "use backend='auto' to fall back to Triton")
        return {"BACKEND": "FLASH"}
    return {"BLOCK_N": block_size} if block_size < 128 else None


def _flex_over_table(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                     tensors: tuple[torch.Tensor, ...], block_size: int, scale: float | None,
                     options: dict[str, object] | None, table_mask_mod: bool) -> torch.Tensor:
    block_mask = make_block_mask(blocks, q.shape[-2], block_size, tensors, table_mask_mod)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          kernel_options=options)


_compiled_flex_over_table = torch.compile(_flex_over_table, dynamic=True, fullgraph=True)


def run_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SparsePlan, *, scale: float | None = None,
             compiled: bool = True, backend: str = "auto") -> torch.Tensor:
    """Attention of ``q [B, Hq, N, D]`` over ``k``/``v [B, Hkv, N, D]`` restricted to ``plan``.

    ``compiled=False`` runs eager ``flex_attention``, which evaluates the plan's ``mask_mod`` on all N x N scores
    (small N only; used by the property tests). Output dtype = ``q.dtype``.
    """
    if compiled and q.dtype not in COMPILED_DTYPES:
        raise TypeError(f"the compiled sparse kernel (torch FlexAttention) takes float16, bfloat16 or float32 "
                        f"inputs, got {q.dtype}: cast q/k/v (or load the model) in float32, or pass compiled=False "
                        "(eager flex, N x N memory: small N only)")
    tensors = block_mask_tensors(plan.blocks, plan.seq_len, plan.block_size)
    if not compiled:
        return _flex_over_table(q, k, v, plan.blocks, tensors, plan.block_size, scale, None, True)
    options = kernel_options(backend, q.device, plan.block_size, q.dtype)
    keep_dynamic(*tensors[0::2], dims=(-1,))        # C_Q of the counts [B, H, C_Q]
    keep_dynamic(*tensors[1::2], dims=(-2, -1))     # C_Q, C_B of the indices [B, H, C_Q, C_B]
    with no_silent_fallback():
        out = _compiled_flex_over_table(q, k, v, plan.blocks, tensors, plan.block_size, scale, options, False)
    return out.masked_fill(nan_rows(q, k, v), float("nan"))


def nan_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Rows that dense causal attention makes NaN: bool ``[B, Hq, N, 1]``.

    A query holding NaN or inf gives NaN scores; a NaN key or value reaches every later query of its group. The
    compiled CPU kernel returns zeros or a finite row there, and a plan may skip the NaN key's block, so one pass
    over q, k and v marks these rows (outside the compiled region: the CPU template takes no epilogue).
    """
    bad_kv = (k.isnan().any(dim=-1) | v.isnan().any(dim=-1)).to(torch.int32).cumsum(dim=-1) > 0   # [B, Hkv, N]
    bad_kv = bad_kv.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (bad_kv | ~q.isfinite().all(dim=-1))[..., None]
