"""``latent``: latent KV-cache eviction scored by the generated tokens' queries (SPEC 2; EntropyInfer sec. 4.3,
Alg. 4). The cache class is `flexentropy.cache.LatentKVCache`, built from an `EntropyConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from flexentropy.config import EntropyConfig
from flexentropy.policies.base import CachePolicy
from flexentropy.policies.cache.common import window_entries, window_scores

if TYPE_CHECKING:
    from flexentropy.cache.base import PolicyLayer
    from flexentropy.cache.latent import LatentKVCache


@dataclass(frozen=True)
class LatentPolicy(CachePolicy):
    """Full cache through prefill and ``delay`` generated tokens, then keep the query window's own entries and the
    best others by window attention, ``budget`` per KV head; with ``recompress_every = R`` again whenever
    ``budget + R`` are stored. Knobs mirror `EntropyConfig`'s ``decode_*`` fields (validated by it)."""

    name = "latent"
    paper = "EntropyInfer (From Rigid to Dynamic, 2026), sec. 4.3, Alg. 4"
    keeps = "query window's own entries + top window-attention entries (pooled), budget per KV head"
    decides = ("after `delay` generated tokens (window includes them), then whenever `budget + recompress_every` are "
               "stored (None: once, as the paper)")

    budget: int = 1024
    window: int = 32
    delay: int = 16
    pool: int = 5
    score: Literal["softmax", "raw"] = "softmax"
    recompress_every: int | None = 32

    def __post_init__(self) -> None:
        self.to_config()  # validates every knob

    @classmethod
    def from_config(cls, config: EntropyConfig) -> LatentPolicy:
        return cls(budget=config.decode_budget, window=config.decode_window, delay=config.decode_delay,
                   pool=config.decode_pool, score=config.decode_score, recompress_every=config.recompress_every)

    def to_config(self, config: EntropyConfig | None = None) -> EntropyConfig:
        """``config`` (default ``EntropyConfig()``) with this policy's ``decode_*`` knobs."""
        return (config or EntropyConfig()).replace(
            decode_budget=self.budget, decode_window=self.window, decode_delay=self.delay, decode_pool=self.pool,
            decode_score=self.score, recompress_every=self.recompress_every)

    @property
    def query_window(self) -> int:
        return self.window

    def before_append(self, layer: PolicyLayer, incoming: int) -> int | None:
        if layer.prompt_length is None or layer.generated < self.delay:
            return None
        delay_reached = layer.previous_generated is not None and layer.previous_generated >= self.delay
        if not delay_reached:  # the first check: the paper's single latent eviction
            return self.budget if layer.stored > self.budget else None
        every = self.recompress_every
        return self.budget if every is not None and layer.stored >= self.budget + every else None

    def scores(self, layer: PolicyLayer) -> torch.Tensor:
        return window_scores(layer, self.score, self.pool)

    def forced(self, layer: PolicyLayer, incoming: int) -> int:
        return window_entries(layer)

    def build(self, model: Any = None, *, num_layers: int | None = None) -> LatentKVCache:
        from flexentropy.cache.latent import LatentKVCache

        return LatentKVCache(self.to_config(), model=model, num_layers=num_layers)
