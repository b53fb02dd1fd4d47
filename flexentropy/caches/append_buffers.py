"""`AppendBuffers`: where a `PolicyLayer` with a ``reserve`` writes its appends, so that the next ones write in place:
buffers of its own with free slots past the entries, or buffers another object lends it (a `StaticLatentKVCache`'s
prompt buffers: a prompt's KV held once, design.md §2)."""

from __future__ import annotations

import torch


class AppendBuffers:
    """A layer's keys and values buffers for its appends (module docstring).

    Args:
        reserve: slots allocated past the entries at each allocation (0: every append copies, ``torch.cat``).
    """

    def __init__(self, reserve: int) -> None:
        self.reserve = reserve
        self.clear()

    def clear(self) -> None:
        """No buffer (lent ones are dropped, not freed: their owner keeps them)."""
        self.spare: dict[str, torch.Tensor] = {}
        self.lent: set[str] = set()  # the names whose buffer another object lent (`lend`)

    def lend(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold the next appends in ``keys [B, Hkv, C, D]`` and ``values [B, Hkv, C, Dv]``, buffers another object
        owns, instead of buffers of the layer's own: with a ``reserve``, an append that fits them writes the entries
        to their front. An append that does not fit, or a layer without a reserve, allocates as before."""
        self.spare = {"keys": keys, "values": values}
        self.lent = {"keys", "values"}

    def append(self, name: str, stored: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``cat([stored, new], dim=-2)`` for buffer ``name`` (``"keys"`` or ``"values"``), ``[B, H, S + L, D]``.
        With a ``reserve``, the result is the front of a larger buffer, and the next append writes into its free slots
        in place when ``stored`` is still that front (no eviction in between). A lent buffer takes the entries
        wherever they are (copied to its front); a buffer of the layer's own is left for a new one when they are
        elsewhere (after an eviction: the prompt-sized buffer is freed)."""
        if not self.reserve:
            return torch.cat([stored, new], dim=-2)
        used, total = stored.shape[-2], stored.shape[-2] + new.shape[-2]
        buffer = self.spare.get(name)
        fits = (buffer is not None and total <= buffer.shape[-2] and stored.shape[:2] == buffer.shape[:2]
                and stored.shape[-1] == buffer.shape[-1] and stored.dtype == buffer.dtype
                and stored.device == buffer.device)
        front = fits and (used == 0 or (stored.data_ptr() == buffer.data_ptr() and stored.stride() == buffer.stride()))
        if not fits or not (front or name in self.lent):
            buffer = stored.new_empty(*stored.shape[:2], total + self.reserve, stored.shape[-1])
            self.spare[name] = buffer
            self.lent.discard(name)
            front = used == 0
        if not front:
            buffer[:, :, :used].copy_(stored)
        buffer[:, :, used:total].copy_(new)
        return buffer[:, :, :total]
