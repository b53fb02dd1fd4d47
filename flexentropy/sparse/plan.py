"""`SparsePlan`: which key blocks every query block attends to, and its `BlockMask` (design.md §1.6).

The plan is a block table ``blocks[b, h, qb, j]``: query block ``qb`` (128 tokens) of query head ``h`` attends
key block ``j`` (``block_size`` tokens), with token-level causality applied inside blocks. The table is the single
source of truth: the BlockMask's sorted indices and its ``mask_mod`` are both derived from it, so eager
``flex_attention`` (which evaluates ``mask_mod`` on every score) and the compiled kernel (which only visits the
listed blocks) compute the same function. Nothing of size N x N is built except by `to_dense_mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexentropy.config import Q_BLOCK_SIZE

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_blocks(seq_len: int, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Key blocks holding at least one key visible to some query of each query block.

    Returns:
        bool ``[C_Q, C_B]``: True where ``j * block_size <= last query of qb``.
    """
    qb = torch.arange(-(-seq_len // Q_BLOCK_SIZE), device=device)
    j = torch.arange(-(-seq_len // block_size), device=device)
    last_q = torch.clamp((qb + 1) * Q_BLOCK_SIZE, max=seq_len) - 1
    return j[None, :] * block_size <= last_q[:, None]


def partial_blocks(seq_len: int, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Blocks that need ``mask_mod`` inside: those crossing the diagonal, and the padded tails.

    Returns:
        bool ``[C_Q, C_B]``: True where some key of block j lies after the first query of qb, or either block
        extends past ``seq_len``.
    """
    qb = torch.arange(-(-seq_len // Q_BLOCK_SIZE), device=device)
    j = torch.arange(-(-seq_len // block_size), device=device)
    crosses = (j[None, :] + 1) * block_size - 1 > qb[:, None] * Q_BLOCK_SIZE
    kv_tail = (j + 1) * block_size > seq_len
    q_tail = (qb + 1) * Q_BLOCK_SIZE > seq_len
    return crosses | kv_tail[None, :] | q_tail[:, None]


def block_table_mask_mod(blocks: torch.Tensor, block_size: int) -> MaskMod:
    """``mask_mod`` reading the block table: ``blocks[b, h, q // 128, kv // block_size] & (q >= kv)``."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return blocks[b, h, q_idx // Q_BLOCK_SIZE, kv_idx // block_size] & (q_idx >= kv_idx)

    return mask_mod


def _sorted_indices(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width int32 ``(num_blocks [..., C_Q], indices [..., C_Q, C_B])``: selected blocks first, ascending.

    Compaction by prefix sum and scatter (one pass) instead of a sort; entries past ``num_blocks`` are 0 and
    never read by the kernels.
    """
    num_blocks = selected.shape[-1]
    num = selected.sum(dim=-1, dtype=torch.int32)
    slot = torch.where(selected, torch.cumsum(selected, dim=-1) - 1, num_blocks)     # unselected -> spare column
    j = torch.arange(num_blocks, dtype=torch.int32, device=selected.device).expand(selected.shape)
    idx = torch.zeros(*selected.shape[:-1], num_blocks + 1, dtype=torch.int32, device=selected.device)
    # contiguous: flex's GPU lowering rejects index tensors with a padded row stride (seen on an H200, torch 2.11)
    return num, idx.scatter_(-1, slot, j)[..., :num_blocks].contiguous()


def block_mask_tensors(blocks: torch.Tensor, seq_len: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)`` for ``BlockMask.from_kv_blocks``.

    Blocks strictly below the diagonal are *full* (no ``mask_mod`` call); diagonal and tail blocks are partial.
    """
    partial = partial_blocks(seq_len, block_size, blocks.device)
    num, idx = _sorted_indices(blocks & partial)
    full_num, full_idx = _sorted_indices(blocks & ~partial)
    return num, idx, full_num, full_idx


def causal_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


def make_block_mask(blocks: torch.Tensor, seq_len: int, block_size: int,
                    tensors: tuple[torch.Tensor, ...] | None = None, table_mask_mod: bool = True) -> BlockMask:
    """Build the BlockMask of a block table ``[B, H, C_Q, C_B]`` (works eagerly and inside ``torch.compile``).

    ``table_mask_mod=False`` gives the block-sparse kernel a plain causal ``mask_mod``: the kernel evaluates
    ``mask_mod`` only inside listed partial blocks, where the table is True, so both compute the same function;
    the causal one avoids a table gather per score (and a Triton codegen failure of torch 2.11 for gathers from
    dynamically shaped tables). Eager flex evaluates ``mask_mod`` everywhere, so it needs the table.
    """
    if tensors is None:
        tensors = block_mask_tensors(blocks, seq_len, block_size)
    num, idx, full_num, full_idx = tensors
    return BlockMask.from_kv_blocks(
        num, idx, full_num, full_idx,
        BLOCK_SIZE=(Q_BLOCK_SIZE, block_size),
        mask_mod=block_table_mask_mod(blocks, block_size) if table_mask_mod else causal_mask_mod,
        seq_lengths=(seq_len, seq_len),
        compute_q_blocks=False,
    )


@dataclass(repr=False)
class SparsePlan:
    """Attended key blocks per (batch, query head, query block of 128 tokens) for one layer.

    Attributes:
        blocks: bool ``[B, Hq, C_Q, C_B]`` block table (own-segment causal blocks included).
        seq_len: N.
        block_size: key block size L_B.
        dense: True when the layer runs plain causal attention (the table is then all causal blocks).
        budgets: float32 ``[B, Hq, C_S]`` token budgets (None for dense layers).
        entropy: float32 ``[B, Hq, C_S]`` segment entropies (None for dense layers).
        rigid: bool ``[B, Hq]`` rigid heads (None for dense layers).
    """

    blocks: torch.Tensor
    seq_len: int
    block_size: int
    dense: bool = False
    budgets: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    rigid: torch.Tensor | None = None

    def __repr__(self) -> str:
        b, h, cq, cb = self.blocks.shape
        if self.dense:
            kind = "dense"
        elif self.blocks.is_meta:   # shapes without data: nothing to count
            kind = "density=? (meta tensors)"
        else:
            kind = f"density={self.density:.3f}"
        return (f"SparsePlan(batch={b}, heads={h}, seq_len={self.seq_len}, q_blocks={cq}, kv_blocks={cb}, "
                f"block_size={self.block_size}, {kind})")

    @property
    def mask_mod(self) -> MaskMod:
        return block_table_mask_mod(self.blocks, self.block_size)

    def to_block_mask(self) -> BlockMask:
        """The plan as a BlockMask with one row per query head (Q block 128, KV block ``block_size``)."""
        return make_block_mask(self.blocks, self.seq_len, self.block_size)

    def to_dense_mask(self) -> torch.Tensor:
        """bool ``[B, Hq, N, N]``, True where query i attends key j. Small N only (N x N memory)."""
        n = self.seq_len
        tok = self.blocks.repeat_interleave(Q_BLOCK_SIZE, dim=-2)[..., :n, :]
        tok = tok.repeat_interleave(self.block_size, dim=-1)[..., :n]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.blocks.device).tril()
        return tok & causal

    @property
    def density(self) -> float:
        """Computed blocks over causal blocks (1.0 for dense attention)."""
        return float(self.density_tensor())

    def density_tensor(self) -> torch.Tensor:
        """`density` as a float32 0-d tensor on the plan's device (no wait on the device)."""
        causal = causal_blocks(self.seq_len, self.block_size, self.blocks.device)
        total = causal.sum() * self.blocks.shape[0] * self.blocks.shape[1]
        return torch.where(total > 0, self.blocks.sum() / total.clamp(min=1), 1.0).float()
