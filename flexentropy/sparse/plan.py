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

from flexentropy._checks import is_int
from flexentropy.config import Q_BLOCK_SIZE

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def query_blocks(seq_len: int, q_start: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """The query blocks of 128 tokens, on the grid from position 0, that hold the queries ``q_start .. seq_len - 1``:
    int64 ``[C_Q]``, from ``q_start // 128`` to ``ceil(seq_len / 128) - 1`` (a plan's rows)."""
    return torch.arange(q_start // Q_BLOCK_SIZE, -(-seq_len // Q_BLOCK_SIZE), device=device)


def causal_rows(rows: torch.Tensor, seq_len: int | torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """Key blocks holding at least one key visible to some query of each query block of ``rows``.

    Args:
        rows: int64 ``[C_Q]`` query blocks (`query_blocks`). seq_len: the key length (the last query is
            ``seq_len - 1``), an int or a 0-d tensor (a compiled caller's, so that a new length is no guard).

    Returns:
        bool ``[C_Q, C_B]``: True where ``j * block_size <= min((r + 1) * 128, seq_len) - 1``.
    """
    j = torch.arange(num_blocks, device=rows.device)
    last_q = torch.clamp((rows + 1) * Q_BLOCK_SIZE, max=seq_len) - 1
    return j[None, :] * block_size <= last_q[:, None]


def causal_blocks(seq_len: int, block_size: int, device: torch.device | str | None = None, *,
                  q_start: int = 0) -> torch.Tensor:
    """`causal_rows` of the query blocks holding the queries ``q_start .. seq_len - 1`` over the keys
    ``0 .. seq_len - 1`` (a whole prompt: ``q_start=0``).

    Returns:
        bool ``[C_Q, C_B]``.
    """
    return causal_rows(query_blocks(seq_len, q_start, device), seq_len, -(-seq_len // block_size), block_size)


def partial_blocks(seq_len: int, block_size: int, device: torch.device | str | None = None, *,
                   q_start: int = 0) -> torch.Tensor:
    """Blocks that need ``mask_mod`` inside: those crossing the diagonal, and the padded tails.

    The rows are `query_blocks` ``(seq_len, q_start)``; a row's first query is taken at its grid start
    (``r * 128``: the kernel pads a chunk's queries to it).

    Returns:
        bool ``[C_Q, C_B]``: True where some key of block j lies after the first query of row r, or either block
        extends past ``seq_len``.
    """
    rows = query_blocks(seq_len, q_start, device)
    j = torch.arange(-(-seq_len // block_size), device=device)
    crosses = (j[None, :] + 1) * block_size - 1 > rows[:, None] * Q_BLOCK_SIZE
    kv_tail = (j + 1) * block_size > seq_len
    q_tail = (rows + 1) * Q_BLOCK_SIZE > seq_len
    return crosses | kv_tail[None, :] | q_tail[:, None]


def query_position(q_idx: torch.Tensor, offset: int | torch.Tensor) -> torch.Tensor:
    """The position of the kernel's query row ``q_idx`` whose rows start at ``offset``: ``q_idx + offset`` for an int
    or a 0-d tensor, ``offset[q_idx]`` for a vector of the rows' positions (the forms of
    `flexentropy.sparse.kernel.kernel_offset`)."""
    if isinstance(offset, torch.Tensor) and offset.dim() == 1:
        return offset[q_idx]
    return q_idx + offset


def block_table_mask_mod(blocks: torch.Tensor, block_size: int, offset: int | torch.Tensor = 0) -> MaskMod:
    """``mask_mod`` reading the block table: ``blocks[b, h, q // 128, kv // block_size] & (position(q) >= kv)``, the
    query row ``q`` at `query_position` (a chunk's rows start at ``offset``, a multiple of 128)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return blocks[b, h, q_idx // Q_BLOCK_SIZE, kv_idx // block_size] & (query_position(q_idx, offset) >= kv_idx)

    return mask_mod


def causal_mask_mod(offset: int | torch.Tensor = 0) -> MaskMod:
    """``mask_mod`` of causal attention whose query row ``q`` is at `query_position` (bottom-right aligned for a
    chunk of queries after ``offset`` earlier keys). An int offset of 0 captures nothing (`aligned_causal`)."""
    if isinstance(offset, int) and offset == 0:
        return aligned_causal

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return query_position(q_idx, offset) >= kv_idx

    return mask_mod


def aligned_causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """``mask_mod`` of causal attention with queries and keys from position 0."""
    return q_idx >= kv_idx


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


def block_mask_tensors(blocks: torch.Tensor, seq_len: int, block_size: int, q_start: int = 0
                       ) -> tuple[torch.Tensor, ...]:
    """``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)`` for ``BlockMask.from_kv_blocks``.

    Blocks strictly below the (shifted) diagonal are *full* (no ``mask_mod`` call); diagonal and tail blocks are
    partial (`partial_blocks`).
    """
    partial = partial_blocks(seq_len, block_size, blocks.device, q_start=q_start)
    num, idx = _sorted_indices(blocks & partial)
    full_num, full_idx = _sorted_indices(blocks & ~partial)
    return num, idx, full_num, full_idx


def make_block_mask(blocks: torch.Tensor, lengths: tuple[int, int], block_size: int, tensors: tuple[torch.Tensor, ...],
                    table_mask_mod: bool = True, offset: int | torch.Tensor = 0) -> BlockMask:
    """Build the BlockMask of a block table ``[B, H, C_Q, C_B]`` (works eagerly and inside ``torch.compile``).

    ``lengths`` is ``(rows, keys)``: the kernel's query rows start at position ``offset`` (a multiple of 128; 0 for a
    whole prompt), the keys at 0; ``offset`` may be a tensor (`query_position`; a compiled caller's: no guard on
    it). ``tensors`` are the table's `block_mask_tensors`.

    ``table_mask_mod=False`` gives the block-sparse kernel a plain causal ``mask_mod`` (`causal_mask_mod`): the
    kernel evaluates ``mask_mod`` only inside listed partial blocks, where the table is True, so both compute the
    same function; the causal one avoids a table gather per score (and a Triton codegen failure of torch 2.11 for
    gathers from dynamically shaped tables). Eager flex evaluates ``mask_mod`` everywhere, so it needs the table.
    """
    num, idx, full_num, full_idx = tensors
    return BlockMask.from_kv_blocks(
        num, idx, full_num, full_idx,
        BLOCK_SIZE=(Q_BLOCK_SIZE, block_size),
        mask_mod=block_table_mask_mod(blocks, block_size, offset) if table_mask_mod else causal_mask_mod(offset),
        seq_lengths=lengths,
        compute_q_blocks=False,
    )


@dataclass(repr=False)
class SparsePlan:
    """Attended key blocks per (batch, query head, query block of 128 tokens) for one layer, of a whole prompt or of
    a chunk of it (design.md §1.7).

    The queries are at positions ``q_start .. seq_len - 1`` and the keys at ``0 .. seq_len - 1``; the rows are the
    query blocks of the grid from position 0 that hold the queries (`query_blocks`: a chunk that starts inside a
    block has that block as its first row).

    Attributes:
        blocks: bool ``[B, Hq, C_Q, C_B]`` block table (own-segment causal blocks included).
        seq_len: the key length (N for a whole prompt; ``q_start + M`` for a chunk of M queries).
        block_size: key block size L_B.
        dense: True when the layer runs plain causal attention (the table is then all causal blocks).
        budgets: float32 ``[B, Hq, C_S]`` token budgets of the segments holding the queries (None for dense layers).
        entropy: float32 ``[B, Hq, C_S]`` segment entropies (None for dense layers).
        rigid: bool ``[B, Hq]`` rigid heads, judged on those segments after the first (None for dense layers).
        q_start: position of the first query (0: a whole prompt).
    """

    blocks: torch.Tensor
    seq_len: int
    block_size: int
    dense: bool = False
    budgets: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    rigid: torch.Tensor | None = None
    q_start: int = 0

    def __repr__(self) -> str:
        b, h, cq, cb = self.blocks.shape
        if self.dense:
            kind = "dense"
        elif self.blocks.is_meta:   # shapes without data: nothing to count
            kind = "density=? (meta tensors)"
        else:
            kind = f"density={self.density:.3f}"
        chunk = f"q_start={self.q_start}, " if self.q_start else ""
        return (f"SparsePlan(batch={b}, heads={h}, {chunk}seq_len={self.seq_len}, q_blocks={cq}, kv_blocks={cb}, "
                f"block_size={self.block_size}, {kind})")

    @property
    def q_len(self) -> int:
        """M, the number of queries (``seq_len - q_start``)."""
        return self.seq_len - self.q_start

    @property
    def row_start(self) -> int:
        """Position of the first row's first token: ``q_start`` rounded down to 128 (the kernel pads the queries
        to it)."""
        return self.q_start - self.q_start % Q_BLOCK_SIZE

    @property
    def mask_mod(self) -> MaskMod:
        """The table's ``mask_mod`` over the rows starting at `row_start`."""
        return block_table_mask_mod(self.blocks, self.block_size, self.row_start)

    def to_block_mask(self) -> BlockMask:
        """The plan as a BlockMask with one row per query head (Q block 128, KV block ``block_size``), over
        ``seq_len - row_start`` query rows (a chunk's queries after ``q_start % 128`` rows of padding) and
        ``seq_len`` keys."""
        tensors = block_mask_tensors(self.blocks, self.seq_len, self.block_size, self.q_start)
        return make_block_mask(self.blocks, (self.seq_len - self.row_start, self.seq_len), self.block_size, tensors,
                               offset=self.row_start)

    def to_dense_mask(self) -> torch.Tensor:
        """bool ``[B, Hq, M, seq_len]``, True where query i (position ``q_start + i``) attends key j. Small N only
        (M x N memory)."""
        device = self.blocks.device
        positions = torch.arange(self.q_start, self.seq_len, device=device)
        keys = torch.arange(self.seq_len, device=device)
        tok = self.blocks[..., positions // Q_BLOCK_SIZE - self.q_start // Q_BLOCK_SIZE, :]
        return tok[..., keys // self.block_size] & (positions[:, None] >= keys[None, :])

    @property
    def density(self) -> float:
        """Computed blocks over causal blocks of the queries (1.0 for dense attention)."""
        return float(self.density_tensor())

    def density_tensor(self) -> torch.Tensor:
        """`density` as a float32 0-d tensor on the plan's device (no wait on the device)."""
        causal = causal_blocks(self.seq_len, self.block_size, self.blocks.device, q_start=self.q_start)
        total = causal.sum() * self.blocks.shape[0] * self.blocks.shape[1]
        return torch.where(total > 0, self.blocks.sum() / total.clamp(min=1), 1.0).float()


def check_plan(plan: object, q: torch.Tensor, k: torch.Tensor, q_start: int) -> None:
    """Raise unless ``plan`` is a `SparsePlan` for the queries ``q [B, Hq, M, D]`` at ``q_start`` over ``k [B, Hkv,
    q_start + M, D]`` (checked): a bool block table ``[B, Hq, C_Q, C_B]`` on their device with the rows and key blocks
    of these positions, ``seq_len``, ``q_start`` and ``block_size`` ints that say so (64 or 128 key tokens)."""
    if not isinstance(plan, SparsePlan):
        raise TypeError(f"plan must be a SparsePlan (from select_blocks or a prefill policy's plan) or None, got "
                        f"{type(plan).__name__} {plan!r}"[:300])
    blocks = plan.blocks
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.bool or blocks.dim() != 4:
        got = (f"{blocks.dtype} of shape {tuple(blocks.shape)}" if isinstance(blocks, torch.Tensor)
               else type(blocks).__name__)
        raise TypeError(f"plan.blocks must be a bool tensor [batch, query heads, query blocks, key blocks], got {got}")
    for name in ("seq_len", "q_start", "block_size"):
        value = getattr(plan, name)
        if not is_int(value) or value < 0:
            raise ValueError(f"plan.{name} must be an int >= 0, got {value!r}")
    if plan.block_size not in (64, 128):
        raise ValueError(f"plan.block_size must be 64 or 128 (key tokens per block), got {plan.block_size}")
    if not isinstance(plan.dense, bool):
        raise TypeError(f"plan.dense must be a bool, got {plan.dense!r}")
    seq_len = k.shape[-2]
    if (plan.q_start, plan.seq_len) != (q_start, seq_len):
        raise ValueError(f"plan is for q_start={plan.q_start}, N={plan.seq_len} but q {tuple(q.shape)} is at "
                         f"q_start={q_start} over {seq_len} keys: plan these queries (select_blocks or a policy's "
                         "plan with the same q_start)")
    rows = len(query_blocks(seq_len, q_start))
    expected = (q.shape[0], q.shape[1], rows, -(-seq_len // plan.block_size))
    if tuple(blocks.shape) != expected:
        raise ValueError(f"plan.blocks is {tuple(blocks.shape)} but these queries need [batch, query heads, query "
                         f"blocks of {Q_BLOCK_SIZE}, key blocks of {plan.block_size}] = {list(expected)}")
    if blocks.device != q.device:
        raise ValueError(f"plan.blocks is on {blocks.device} but q is on {q.device}; put them on one device")
