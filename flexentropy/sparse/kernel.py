"""Block-sparse attention kernel: ``flex_attention`` over a `SparsePlan`, compiled once for every length and chunk.

The BlockMask is built *inside* the compiled region from the plan's tensors, and the region is compiled with
``dynamic=True``, so a new sequence length reuses the same graph instead of recompiling (each compile costs
seconds; past ``torch._dynamo.config.recompile_limit`` recompiles, flex would silently fall back to the eager
path that materialises every score: an out-of-memory at long N). Hitting the limit raises instead. A chunk's
offset (the position of its first row) is no guard either (`kernel_offset`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator

import torch
from torch.fx.experimental import _config as shape_config
from torch.nn.attention.flex_attention import flex_attention

from flexentropy._compile import compiled, keep_dynamic, no_silent_fallback
from flexentropy.config import Q_BLOCK_SIZE
from flexentropy.sparse.plan import SparsePlan, block_mask_tensors, make_block_mask

FLASH_OPTIONS = {"BACKEND": "FLASH"}
"""flex ``kernel_options`` of the FLASH backend (flash-attn-4's CuTe kernels)."""

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
        return FLASH_OPTIONS
    return {"BLOCK_N": block_size} if block_size < 128 else None


@contextlib.contextmanager
def compiled_region() -> Iterator[None]:
    """The settings of a call into one of the prefill's compiled graphs: `no_silent_fallback`, and no duck sizing.

    Dynamo gives equal sizes one symbol: a whole prompt's queries and keys (equal lengths) would compile a graph
    that guards on their equality, and the next chunk (fewer queries than keys) would compile again. Inside an
    outer ``torch.compile`` the outer graph's settings apply.
    """
    with no_silent_fallback():
        if torch.compiler.is_compiling():
            yield
            return
        with shape_config.patch(use_duck_shape=False):
            yield


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [B, H, M, D]`` after ``rows`` rows of zeros: ``[B, H, rows + M, D]`` (``x`` itself when ``rows == 0``).

    The copy keeps ``x``'s order of strides (a transposed view stays one), so a compiled graph that took ``x``
    serves the padded copy too instead of compiling for a new layout.
    """
    if rows == 0:
        return x
    order = sorted(range(x.dim()), key=lambda d: x.stride(d), reverse=True)          # outermost dim first
    shape = [*x.shape[:-2], rows + x.shape[-2], x.shape[-1]]
    padded = x.new_zeros([shape[d] for d in order]).permute([order.index(d) for d in range(x.dim())])
    padded[..., rows:, :] = x
    return padded


def _flex_over_table(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                     tensors: tuple[torch.Tensor, ...], block_size: int, scale: float | None,
                     options: dict[str, object] | None, table_mask_mod: bool,
                     offset: int | torch.Tensor) -> torch.Tensor:
    block_mask = make_block_mask(blocks, (q.shape[-2], k.shape[-2]), block_size, tensors, table_mask_mod, offset)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          kernel_options=options)


_compiled_flex_over_table = compiled(_flex_over_table, dynamic=True, fullgraph=True)


def kernel_rows(plan: SparsePlan) -> tuple[int, torch.Tensor]:
    """``(start, blocks)``: the position of the kernel's first query row and the block table of its rows.

    The rows start on the 128-token grid (the plan's first row, ``plan.row_start``); a plan of one row gets an empty
    row before it, so that the compiled kernel never sees a query-block count of 1, which dynamo would specialise.
    """
    if plan.blocks.shape[-2] != 1 or plan.row_start < Q_BLOCK_SIZE:
        return plan.row_start, plan.blocks
    empty = plan.blocks.new_zeros(*plan.blocks.shape[:-2], 1, plan.blocks.shape[-1])
    return plan.row_start - Q_BLOCK_SIZE, torch.cat([empty, plan.blocks], dim=-2)


def kernel_template(options: dict[str, object] | None, device: torch.device) -> str:
    """The compiled flex template that runs the kernel: ``"flash"``, ``"triton"`` or ``"cpu"``."""
    if options == FLASH_OPTIONS:
        return "flash"
    return "triton" if device.type == "cuda" else "cpu"


def kernel_offset(start: int, rows: int, device: torch.device, template: str) -> int | torch.Tensor:
    """The position ``start`` of the kernel's first query row (of ``rows``), in the form its ``mask_mod`` reads
    (`flexentropy.sparse.plan.query_position`) that ``template`` (`kernel_template`) takes, so that a new offset is
    no guard on the compiled kernel:

    - ``"triton"`` and ``"cpu"``: a 0-d int32 tensor, whole prompts (0) included, so that one graph serves whole
      prompts and chunks;
    - ``"flash"`` (flash-attn-4): the int 0 for a whole prompt (the mask captures nothing), and for a chunk the rows'
      positions, an int32 vector ``[ceil(rows / 128) * 128 + 128]`` read at the row (``positions[q_idx]``). That
      template turns every index of a captured load into a register value and fails on a constant one, as a 0-d
      tensor's (index 0: "Expected TensorSSA, but got int", issue 64), and has no arithmetic on symbolic sizes
      (``k.shape[-2] - q.shape[-2]``: "Missing operation: index_expr"; Triton's template refuses that too). The
      vector covers the rows of the last 128-row tile, which the kernel masks but still reads.

    The tensors are filled on the device (no host copy, no sync). Inside an outer ``torch.compile`` the outer graph
    decides: the int 0 for a whole prompt; for a chunk the tensor made in that graph, which Inductor then computes
    inside the template's mask: Triton takes the 0-d tensor so made, FLASH does not ("Missing operation:
    index_expr", H100, torch 2.11), so `run_plan` runs such a chunk on Triton; the CPU template takes no tensor made
    inside the graph: there the int itself. tests/test_sparse_kernel_contract.py holds each form to what its
    template takes.
    """
    compiling = torch.compiler.is_compiling()
    if (template == "cpu" and compiling) or (start == 0 and (template == "flash" or compiling)):
        return start
    if template == "flash":
        span = -(-rows // Q_BLOCK_SIZE) * Q_BLOCK_SIZE + Q_BLOCK_SIZE
        return torch.arange(start, start + span, dtype=torch.int32, device=device)
    return torch.full((), start, dtype=torch.int32, device=device)


def run_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SparsePlan, *, scale: float | None = None,
             compiled: bool = True, backend: str = "auto") -> torch.Tensor:
    """Attention of the queries ``q [B, Hq, M, D]`` (positions ``plan.q_start ..``) over ``k``/``v [B, Hkv,
    plan.seq_len, D]`` (positions ``0 ..``) restricted to ``plan``, causal bottom-right: query ``i`` sees the keys
    up to ``plan.q_start + i``.

    The kernel's query rows start on the 128-token grid (`kernel_rows`): a chunk that starts inside a query block runs
    with rows of zeros in front, dropped from the output. ``compiled=False`` runs eager ``flex_attention``, which
    evaluates the plan's ``mask_mod`` on all M x N scores (small N only; used by the property tests). Output
    ``[B, Hq, M, D]`` in ``q.dtype``.
    """
    if compiled and q.dtype not in COMPILED_DTYPES:
        raise TypeError(f"the compiled sparse kernel (torch FlexAttention) takes float16, bfloat16 or float32 "
                        f"inputs, got {q.dtype}: cast q/k/v (or load the model) in float32, or pass compiled=False "
                        "(eager flex, N x N memory: small N only)")
    start, blocks = kernel_rows(plan)
    pad = plan.q_start - start
    rows = pad_rows(q, pad)                                                      # [B, Hq, pad + M, D]
    tensors = block_mask_tensors(blocks, plan.seq_len, plan.block_size, start)
    if not compiled:
        offset = kernel_offset(start, rows.shape[-2], q.device, kernel_template(None, q.device))
        return _flex_over_table(rows, k, v, blocks, tensors, plan.block_size, scale, None, True, offset)[..., pad:, :]
    options = kernel_options(backend, q.device, plan.block_size, q.dtype)
    if options == FLASH_OPTIONS and start and torch.compiler.is_compiling():
        options = kernel_options("triton", q.device, plan.block_size, q.dtype)   # `kernel_offset`: no FLASH form
    offset = kernel_offset(start, rows.shape[-2], q.device, kernel_template(options, q.device))
    keep_dynamic(*tensors[0::2], dims=(-1,))        # C_Q of the counts [B, H, C_Q]
    keep_dynamic(*tensors[1::2], dims=(-2, -1))     # C_Q, C_B of the indices [B, H, C_Q, C_B]
    if isinstance(offset, torch.Tensor) and offset.dim():
        keep_dynamic(offset, dims=(0,))
    with compiled_region():
        out = _compiled_flex_over_table(rows, k, v, blocks, tensors, plan.block_size, scale, options, False, offset)
    return out[..., pad:, :].masked_fill(nan_rows(q, k, v, plan.q_start), float("nan"))


def nan_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int = 0) -> torch.Tensor:
    """Rows that dense causal attention makes NaN: bool ``[B, Hq, M, 1]`` for the queries at ``q_start ..``.

    A query holding NaN or inf gives NaN scores; a NaN key or value reaches every later query of its group. The
    compiled CPU kernel returns zeros or a finite row there, and a plan may skip the NaN key's block, so one pass
    over q, k and v marks these rows (outside the compiled region: the CPU template takes no epilogue).
    """
    bad_kv = (k.isnan().any(dim=-1) | v.isnan().any(dim=-1)).to(torch.int32).cumsum(dim=-1) > 0   # [B, Hkv, N]
    bad_kv = bad_kv[..., q_start:].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (bad_kv | ~q.isfinite().all(dim=-1))[..., None]
