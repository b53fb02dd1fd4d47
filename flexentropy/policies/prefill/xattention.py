"""``xattention``: blocks by strided antidiagonal scores, the fewest per query block reaching a mass threshold
(XAttention, Xu et al., ICML 2025: antidiagonal scoring, threshold block selection)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from einops import rearrange

from flexentropy._checks import check_int, check_number
from flexentropy.config import Q_BLOCK_SIZE
from flexentropy.policies.base import PrefillPolicy
from flexentropy.policies.prefill.estimates import compute_dtype
from flexentropy.policies.prefill.fixed import fixed_blocks, query_block_table
from flexentropy.policies.prefill.ranking import mass_cover
from flexentropy.sparse.plan import SparsePlan, causal_blocks

CHUNK_SCORES = 2**28
"""Most stride-level scores alive at once while scoring (1 GiB in float32): query tiles are scored in chunks."""


def antidiagonal_block_mass(q: torch.Tensor, k: torch.Tensor, stride: int, block_size: int) -> torch.Tensor:
    """XAttention's block importance (antidiagonal scoring) per query block of 128 tokens and key block.

    Tokens are grouped in tiles of ``S = stride``. The score of query tile ``t`` and key tile ``u`` is the sum of
    one antidiagonal of their ``S x S`` logits, ``sum_a q[tS + S-1-a] . k[uS + a] / (sqrt(D) S)`` (one dot product
    of the tile's queries in reverse order, flattened, with the tile's keys flattened); every tile row is soft-maxed
    over the key tiles ``u <= t`` and the probabilities are summed over each (query block, key block) pair. A row of
    the result sums to the number of query tiles in the block. Zero padding fills the last tile and block, and a
    chunk's first query block before its first query (that block's segment runs dense, `fixed_blocks`).

    Logits are computed in the input dtype (16-bit on GPU, as the released code), softmax in float32 (float64 for
    float64 inputs). Query tiles are scored in chunks of whole query blocks, only against the key tiles before the
    chunk's end: at most `CHUNK_SCORES` scores live at once (memory ``O(min(B Hq N^2 / S^2, 2^28))``), plus the
    result. Compute ``~M N D / S`` multiply-adds per head (1/S of dense attention's ``QK^T``).

    Args:
        q: ``[B, Hq, M, D]``, the last ``M`` positions of ``k [B, Hkv, N, D]`` (a whole prompt: ``M = N``).
        stride: S, a divisor of ``block_size``. block_size: key block size L_B (64 or 128, a divisor of 128).

    Returns:
        ``[B, Hq, C_Q, C_B]`` over the query blocks holding the queries, in float32 (float64 for float64 inputs);
        non-causal pairs 0. A chunk's rows are the whole prompt's (each row's scores read only its own queries and
        the keys before them).
    """
    batch, q_heads, m, dim = q.shape
    n = k.shape[-2]
    group = q_heads // k.shape[1]
    first = (n - m) // Q_BLOCK_SIZE * Q_BLOCK_SIZE                  # the first row's position (a chunk's)
    padded = -(-n // Q_BLOCK_SIZE) * Q_BLOCK_SIZE
    num_blocks, per_qblock = -(-n // block_size), Q_BLOCK_SIZE // stride
    tiles, first_tile, real_tiles = padded // stride, first // stride, -(-n // stride)
    # query tiles in reverse token order against key tiles in order: a dot product sums one antidiagonal
    q_rows = torch.nn.functional.pad(q, (0, 0, n - m - first, padded - n))                 # positions first ..
    q_tiles = rearrange(q_rows, "b (h g) (t s) d -> b h g t s d", g=group, s=stride)
    q_tiles = rearrange(q_tiles.flip(-2), "b h g t s d -> b h g t (s d)")
    k_tiles = rearrange(torch.nn.functional.pad(k, (0, 0, 0, padded - n)), "b h (t s) d -> b h t (s d)", s=stride)
    rows = per_qblock * max(1, CHUNK_SCORES // (batch * q_heads * tiles * per_qblock))
    dtype, scale = compute_dtype(q.dtype), 1.0 / (math.sqrt(dim) * stride)
    chunks = []
    for start in range(first_tile, tiles, rows):        # chunks bound memory (32 at 128k, batch 1, 32 heads)
        stop = min(start + rows, tiles)
        logits = torch.einsum("bhgte,bhue->bhgtu", q_tiles[..., start - first_tile:stop - first_tile, :],
                              k_tiles[..., :stop, :])
        t = torch.arange(start, stop, device=q.device)
        visible = torch.arange(stop, device=q.device)[None, :] <= t[:, None]
        probs = torch.softmax((logits.to(dtype) * scale).masked_fill(~visible, float("-inf")), dim=-1)
        probs = probs.masked_fill(~visible | (t >= real_tiles)[:, None], 0.0)
        per_block = rearrange(probs, "b h g (c r) (j w) -> b (h g) c r j w", r=per_qblock, w=block_size // stride)
        mass = per_block.sum(dim=(-3, -1))
        chunks.append(torch.nn.functional.pad(mass, (0, padded // block_size - mass.shape[-1])))
    return torch.cat(chunks, dim=-2)[..., :num_blocks]


@dataclass(frozen=True)
class XAttention(PrefillPolicy):
    """Per head and query block (128 tokens), the fewest key blocks by antidiagonal score whose estimated mass,
    together with the blocks every policy keeps (own segment, sinks, local blocks: their mass counts first, as
    XAttention counts its sink and diagonal blocks first), reaches ``threshold`` of the row's mass (threshold block
    selection).

    Knobs: ``threshold`` (0.9, the paper's setting for Llama-3.1-8B; 1.0 keeps every causal block), ``stride``
    (S = 8; must divide ``config.block_size``). Unbudgeted: the threshold, not ``config.base_budget``, sets the
    density. Geometry and dense fallbacks come from ``config``.
    """

    name = "xattention"
    paper = "XAttention (Xu et al., ICML 2025)"
    keeps = ("own segment, sink/local blocks, per query block the fewest blocks by antidiagonal score whose mass "
             "reaches threshold")
    per_head = True

    threshold: float = 0.9
    stride: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("XAttention", "threshold", self.threshold, 0.0, 1.0)
        check_int("XAttention", "stride", self.stride, 1)
        if self.config.block_size % self.stride:
            raise ValueError(f"XAttention.stride ({self.stride}) must divide block_size ({self.config.block_size})")

    def block_mass(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """`antidiagonal_block_mass` at this policy's stride and block size: ``[B, Hq, C_Q, C_B]`` (``q`` the last
        positions of ``k``)."""
        return antidiagonal_block_mass(q, k, self.stride, self.config.block_size)

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor, compiled: bool | None = None) -> SparsePlan:
        """`mass_cover` of every query block's row of `block_mass`, composed by `query_block_table`. A chunk's rows
        are the whole prompt's: each row's mass and selection read only its own queries and the keys before them."""
        n, q_start = k.shape[-2], k.shape[-2] - q.shape[-2]
        fixed = fixed_blocks(n, self.config, q.device, q_start=q_start)
        free = causal_blocks(n, self.config.block_size, q.device, q_start=q_start) & ~fixed
        chosen = mass_cover(self.block_mass(q, k), free, fixed, self.threshold)
        return SparsePlan(query_block_table(chosen, self.config, n, q_start), n, self.config.block_size,
                          q_start=q_start)
