"""Decode attention over a (compressed) KV cache stored per KV head (design.md §2).

The cache's entries are not contiguous in position after an eviction, but every stored entry precedes the tokens
being decoded, so a decode step needs no mask at all: one SDPA call (flash backend) with ``enable_gqa`` over
``[B, Hkv, kept, D]``, nothing expanded to the query heads and nothing of the context's size rebuilt per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
"""SDPA backends for decoding. Not cuDNN: on the H200 (torch 2.11) SDPA picks it for GQA decoding and it builds a
plan for every new KV length, 37-58 ms per token, against 0.08-0.1 ms for flash (measured 2026-11-29). Not
memory-efficient attention: it has no GQA. Flash takes ``q_len = 1``; masked multi-token steps fall back to math."""


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Attention of the ``L`` newest tokens over the cache returned by ``LatentKVCache.update``.

    Args:
        query: ``[B, Hq, L, D]`` post-RoPE queries of the tokens whose keys are the last ``L`` entries of ``keys``.
        keys: ``[B, Hkv, T, D]``, ``T >= L``, ``Hq`` a multiple of ``Hkv`` (query head ``h`` reads KV head
            ``h // (Hq // Hkv)``).
        values: ``[B, Hkv, T, Dv]``.
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns:
        ``[B, Hq, L, Dv]`` in the query's dtype. Query ``i`` attends to the ``T - L`` earlier entries and,
        causally, to the chunk's entries ``T - L .. T - L + i``; ``L = 1`` (plain decoding) uses no mask.
    """
    if query.dim() != 4 or keys.dim() != 4 or values.dim() != 4:
        raise ValueError(f"query [B, Hq, L, D], keys [B, Hkv, T, D] and values [B, Hkv, T, Dv] must be 4-D, got "
                         f"{list(query.shape)}, {list(keys.shape)}, {list(values.shape)}")
    batch, q_heads, q_len, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    if keys.shape[0] != batch or keys.shape[3] != dim or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"keys {list(keys.shape)} and values {list(values.shape)} must be [B={batch}, Hkv, T, "
                         f"D={dim}] and [B, Hkv, T, Dv] for query {list(query.shape)}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a positive multiple of key/value heads ({kv_heads})")
    if q_len > length:
        raise ValueError(f"{q_len} queries but only {length} cache entries: the cache must already hold the "
                         f"queries' own keys (call update() before attending)")
    mask = None
    if q_len > 1:  # bottom-right aligned causal mask over the chunk, [L, T]
        positions = torch.arange(length, device=query.device)
        mask = positions <= positions[length - q_len :].unsqueeze(-1)
    with sdpa_kernel(DECODE_BACKENDS):
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


def kept_columns(mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Columns of a logical mask ``[B, 1, L, T]`` at kept positions ``[B, Hkv, S]``: bool ``[B, Hkv, L, S]``."""
    batch, kv_heads, stored = positions.shape
    q_len = mask.shape[-2]
    index = positions[:, :, None, :].expand(batch, kv_heads, q_len, stored)
    return mask.expand(batch, kv_heads, q_len, mask.shape[-1]).gather(-1, index)


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    """SDPA with one mask per KV head, without expanding keys to the query heads.

    Args:
        query: ``[B, Hq, L, D]``; key: ``[B, Hkv, S, D]``; value: ``[B, Hkv, S, Dv]``.
        allowed: bool ``[B, Hkv, L, S]``, True where the queries of KV head h's group attend.

    Returns:
        ``[B, Hq, L, Dv]``. Query head ``h`` uses KV head ``h // (Hq // Hkv)``.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads, stored = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    folded = query.reshape(batch, kv_heads, group * q_len, dim)
    mask = allowed[:, :, None].expand(batch, kv_heads, group, q_len, stored).reshape(batch, kv_heads, -1, stored)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scale)
    return out.reshape(batch, q_heads, q_len, value.shape[-1])
