"""Reading a request's keys and values out of vLLM's paged KV cache (torch only, no vLLM import).

Each attention backend lays a layer's cache out its own way, in pages of ``page_size`` tokens (vLLM's KV-cache
blocks, whose ids a request's block-table row lists in token order). Two ways to read one:

- a known layout, read through views: ``FLASH_ATTN``'s cache is ``[num_pages, Hkv, page_size, 2 * D]`` (its logical
  shape; the strides may put tokens before heads in memory), keys in the first ``D`` channels, values in the last
  (the split its own ``forward`` makes, vLLM 0.26 to 0.32): `flash_pages`, then `gather_pages`;
- a layout learned from the backend's own writer (`learn_page_layout`): ``CPU_ATTN`` packs a page's keys for its
  vector kernels in an order that depends on the CPU's instruction set (transposed ``[D, page_size]`` per head for
  its x86 "vec" kernel, seen on vLLM 0.32; others for AMX or NEON), so the plugin writes a scratch page with the
  backend's own ``do_kv_cache_update`` and reads off where each key and value channel lands: `PageLayout`, then
  `gather_indexed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``write(key [T, Hkv, D], value [T, Hkv, D], kv_cache, slot_mapping [T])``: a backend's cache writer."""


def flash_pages(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``FLASH_ATTN``'s cache as ``(keys, values)``, each a view ``[num_pages, Hkv, page_size, D]``."""
    keys, values = kv_cache.split(head_size, dim=-1)
    return keys, values


def gather_pages(pages: torch.Tensor, page_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one request, in order, from the view ``pages [num_pages, Hkv, page_size, D]``.

    Args:
        page_table: int ``[max_pages]``, the request's row of vLLM's block table (entries past
            ``ceil(length / page_size)`` are not read).
        length: tokens to read, ``>= 1``.

    Returns:
        ``[1, Hkv, length, D]`` (a view of a copy of the pages read: the last page's padding is cut off).
    """
    num_pages = -(-length // pages.shape[2])
    picked = pages.transpose(0, 1).index_select(1, page_table[:num_pages])     # [Hkv, n, page_size, D]
    return picked.flatten(1, 2)[:, :length].unsqueeze(0)


@dataclass(frozen=True)
class PageLayout:
    """Where a backend keeps each key and value channel inside one page of its cache.

    Attributes:
        keys, values: int64 ``[Hkv, page_size, D]``: the offset of key (value) ``[h, t, d]`` in the page's elements
            read in their logical order (``kv_cache[page].reshape(-1)``).
    """

    keys: torch.Tensor
    values: torch.Tensor


def learn_page_layout(write: Writer, kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> PageLayout:
    """The `PageLayout` of ``kv_cache``'s pages, learned by writing one scratch page with the backend's ``write``.

    Every channel ``(h, t, d)`` of a page's keys gets a code; each pass writes one bit of every code (0 or 1, exact in
    any floating dtype), keys in one set of passes and values in another, and the bits found at each element of the
    scratch page spell which channel it holds. ``1 + ceil(log2(Hkv * page_size * D))`` writes per kind, once per
    layer.
    """
    page_size = kv_cache.shape[2]
    scratch = torch.zeros_like(kv_cache[:1])
    slots = torch.arange(page_size, device=kv_cache.device)
    channels = num_kv_heads * page_size * head_size
    codes = torch.arange(channels, device=kv_cache.device).view(num_kv_heads, page_size, head_size).transpose(0, 1)
    zeros = torch.zeros(page_size, num_kv_heads, head_size, dtype=kv_cache.dtype, device=kv_cache.device)

    def offsets(slot: int) -> torch.Tensor:
        def read(bits: torch.Tensor) -> torch.Tensor:
            scratch.zero_()
            pair = (bits.to(kv_cache.dtype), zeros)
            write(*(pair if slot == 0 else pair[::-1]), scratch, slots)
            return scratch[0].reshape(-1) != 0

        held = read(torch.ones_like(codes))
        code = torch.zeros(held.shape, dtype=torch.int64, device=kv_cache.device)
        for bit in range(max(channels - 1, 1).bit_length()):
            code |= read((codes >> bit) & 1).to(torch.int64) << bit
        where = held.nonzero().flatten()
        found = code[where]
        if where.numel() != channels or not bool((torch.bincount(found, minlength=channels) == 1).all()):
            raise RuntimeError(f"the backend's cache writer did not put a page's {channels} "
                               f"{('key', 'value')[slot]} channels in distinct elements: its layout cannot be read")
        return torch.empty(channels, dtype=torch.int64, device=kv_cache.device).index_put_(
            (found,), where).view(num_kv_heads, page_size, head_size)

    return PageLayout(offsets(0), offsets(1))


def gather_indexed(kv_cache: torch.Tensor, offsets: torch.Tensor, page_table: torch.Tensor,
                   length: int) -> torch.Tensor:
    """The first ``length`` tokens of one request, in order, from pages laid out as ``offsets`` (a `PageLayout`'s
    ``keys`` or ``values``); arguments and result as `gather_pages`."""
    num_kv_heads, page_size, head_size = offsets.shape
    num_pages = -(-length // page_size)
    pages = kv_cache.index_select(0, page_table[:num_pages]).reshape(num_pages, -1)
    picked = pages[:, offsets]                                                  # [n, Hkv, page_size, D]
    return picked.transpose(0, 1).reshape(num_kv_heads, num_pages * page_size, head_size)[:, :length].unsqueeze(0)
