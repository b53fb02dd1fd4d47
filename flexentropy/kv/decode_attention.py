"""Decode attention over a (compressed) KV cache stored per KV head (design.md §2).

The cache's entries are not contiguous in position after an eviction, but every stored entry precedes the tokens
being decoded, so a decode step needs no mask at all: one SDPA call (flash backend) with ``enable_gqa`` over
``[B, Hkv, kept, D]``, nothing expanded to the query heads and nothing of the context's size rebuilt per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flexentropy._checks import check_heads, check_scale
from flexentropy.sparse.kernel import flash_available

DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
"""SDPA backends for decoding. Not cuDNN: SDPA picks it for GQA decoding on CUDA (torch 2.11), and it builds a plan
for every new KV length, which costs far more than the step (docs/performance.md). Not memory-efficient attention:
it has no GQA. Flash takes ``q_len = 1``; masked multi-token steps fall back to math."""


def flash_decode_usable(kernel: str, keys: torch.Tensor, padded: bool) -> bool:
    """Whether a static decode step over ``keys [B, Hkv, C, D]`` runs flash-attn-4's kernel (`flash_decode`).

    ``kernel`` is `EntropyConfig.decode_kernel`. ``"auto"``: where it can run (CUDA, 16-bit entries, a head dim it
    takes, flash-attn-4 importable, no padded row: its lengths mask a prefix of each row, not single entries);
    ``"sdpa"``: never; ``"flash"``: always, raising where it cannot run.
    """
    if kernel == "sdpa":
        return False
    reasons = [why for why, fails in (
        ("a CUDA device", keys.device.type != "cuda"),
        ("float16 or bfloat16 entries", keys.dtype not in (torch.float16, torch.bfloat16)),
        ("a head dim that is a multiple of 8 up to 256", keys.shape[-1] % 8 or keys.shape[-1] > 256),
        ("an unpadded batch (the kernel masks by length)", padded),
        ("flash-attn-4 (`pip install flash-attn-4`)", not flash_available()),
    ) if fails]
    if reasons and kernel == "flash":
        raise ValueError(f"decode_kernel='flash' needs {' and '.join(reasons)}; use decode_kernel='auto' to fall "
                         f"back to SDPA")
    return not reasons


@torch.library.custom_op("flexentropy::flash_decode", mutates_args=())
def _flash_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn.cute import flash_attn_varlen_func

    out, lse = flash_attn_varlen_func(query, keys, values, seqused_k=lengths, softmax_scale=scale, num_splits=1,
                                      pack_gqa=True, return_lse=True)
    return out, lse


@_flash_decode.register_fake
def _(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, q_len, heads = query.shape[:3]
    return query.new_empty(batch, q_len, heads, values.shape[-1]), query.new_empty(batch, heads, q_len,
                                                                                    dtype=torch.float32)


PartialAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                            tuple[torch.Tensor, torch.Tensor]]
"""``(query [B, 1, Hq, D], keys [B, T, Hkv, D], values [B, T, Hkv, Dv], lengths int32 [B], scale) -> (out
[B, 1, Hq, Dv], lse float32 [B, Hq, 1])``: attention of each row over its first ``lengths[b]`` entries, with the
log-sum-exp of its scores (flash-attn-4's layout)."""


def split_count(batch: int, capacity: int, wanted: int) -> int:
    """Splits of `flash_decode` for ``batch`` rows of ``capacity`` entries: the largest divisor of ``capacity`` up to
    ``wanted`` (a split is then a view of the buffer), 1 for a batch of several rows (their splits would be copies)."""
    if batch != 1:
        return 1
    return max(s for s in range(1, max(1, wanted) + 1) if capacity % s == 0)


def flash_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                 scale: float | None = None, splits: int = 1, partial: PartialAttention = _flash_decode
                 ) -> torch.Tensor:
    """One decode step over the first ``lengths[b]`` entries of each row, with flash-attn-4's kernel.

    A custom op, so that a compiled step calls it inside its graph (and a CUDA graph replays it); GQA packed.
    flash-attn-4 splits no row over several blocks on SM 9.0, so a long row runs on ``Hkv`` blocks only: with
    ``splits > 1`` the entries are cut into ``splits`` equal parts, each attended as a row of its own (a view: the
    parts of one row are consecutive), and the parts are merged by their log-sum-exps (split-KV, as
    flash-decoding).

    Args:
        query: ``[B, Hq, 1, D]``; keys: ``[B, Hkv, C, D]``; values: ``[B, Hkv, C, Dv]`` (16-bit, CUDA).
        lengths: int32 ``[B]``: row ``b`` attends to its entries ``0 .. lengths[b] - 1`` (at least one), in every
            head.
        scale: softmax scale, default ``1 / sqrt(D)``.
        splits: parts of the entries (`split_count`: a divisor of ``C``; more than 1 only for a batch of one row).
        partial: the kernel (`PartialAttention`); tests pass a reference.

    Returns:
        ``[B, Hq, 1, Dv]``, equal within rounding to `grouped_attention` under the prefix mask.
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    batch, heads, capacity = query.shape[0], query.shape[1], keys.shape[2]
    if splits == 1:
        out, _ = partial(query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), lengths, scale)
        return out.transpose(1, 2)
    if batch != 1 or capacity % splits:
        raise ValueError(f"flash_decode splits {capacity} entries of one row into equal parts; got {splits} parts "
                         f"of a batch of {batch}")
    part = capacity // splits
    starts = torch.arange(splits, device=lengths.device, dtype=lengths.dtype) * part
    used = (lengths - starts).clamp(0, part)                                          # [S]

    def pieces(tensor: torch.Tensor) -> torch.Tensor:   # [1, H, C, D] -> [S, part, H, D], a view
        return tensor.transpose(1, 2).unflatten(1, (splits, part)).flatten(0, 1)

    queries = query.transpose(1, 2).expand(splits, -1, -1, -1).contiguous()
    out, lse = partial(queries, pieces(keys), pieces(values), used, scale)
    lse = lse[:, :, 0].masked_fill(used[:, None] == 0, float("-inf"))                 # [S, Hq]
    weights = (lse - lse.amax(0)).exp()
    merged = (weights[:, :, None] * out[:, 0].float()).sum(0) / weights.sum(0)[:, None]
    return merged.to(query.dtype).view(1, heads, 1, -1)


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Attention of the ``L`` newest tokens over the cache returned by ``LatentKVCache.update``.

    Args:
        query: ``[B, Hq, L, D]`` post-RoPE queries of the tokens whose keys are the last ``L`` entries of ``keys``.
        keys: ``[B, Hkv, T, D]``, ``T >= L``, ``Hq`` a multiple of ``Hkv`` (query head ``h`` reads KV head
            ``h // (Hq // Hkv)``).
        values: ``[B, Hkv, T, Dv]``. The three: floating tensors (float16, bfloat16, float32 or float64) of one
            dtype and device.
        scale: softmax scale, a finite number > 0 (default ``1 / sqrt(D)``).

    Returns:
        ``[B, Hq, L, Dv]`` in the query's dtype. Query ``i`` attends to the ``T - L`` earlier entries and,
        causally, to the chunk's entries ``T - L .. T - L + i``; ``L = 1`` (plain decoding) uses no mask.
    """
    check_heads([("query", query), ("keys", keys), ("values", values)])
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
    check_scale("decode_attention", scale)
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
