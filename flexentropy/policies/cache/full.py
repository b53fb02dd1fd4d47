"""``full``: keep every entry (the uncompressed baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from flexentropy.policies.base import CachePolicy


@dataclass(frozen=True)
class FullCache(CachePolicy):
    """No eviction: the cache holds every token (like HF's ``DynamicCache``, with the policy cache's accounting)."""

    name = "full"
    paper = "no compression"
    keeps = "everything"
    decides = "never"
