"""The ``"flexentropy"`` entry of transformers' ``AttentionMaskInterface``: HF's SDPA mask over *logical* key
positions, so that it stays right after a cache evicts entries; and `real_tokens`, a prompt's padding read off its
mask."""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import sdpa_mask


def logical_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 **kwargs: Any) -> torch.Tensor | None:
    """HF's SDPA mask (``AttentionMaskInterface`` signature) over logical key positions ``0 .. kv_offset + kv_length``.

    A cache reports ``(kv_length, kv_offset)`` through ``get_mask_sizes``; HF numbers the mask's columns
    ``kv_offset ..``. After a `LatentKVCache` eviction the stored entries are not those positions, so this mask
    keeps every logical position and :func:`attention_forward` picks the columns of the keys it is given.

    Returns:
        bool ``[B, 1, q_length, kv_offset + kv_length]`` (True: attend), or None where SDPA's ``is_causal`` (or no
        mask) is exact, as for ``"sdpa"``.
    """
    length = kv_offset + kv_length
    if kwargs.get("attention_mask") is None and kwargs.get("local_size") is None and q_length in (1, length):
        return None  # plain causal attention; also under torch.compile, where HF's sdpa_mask never skips
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=length, q_offset=q_offset, kv_offset=0,
                     **kwargs)


def real_tokens(mask: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` bool of a prompt's causal + padding mask ``[B, 1, N, N]``: token i attends to itself iff it is not
    padding."""
    return mask[:, 0].diagonal(dim1=-2, dim2=-1)
