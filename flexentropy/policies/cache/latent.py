"""``latent``: latent KV-cache eviction scored by the generated tokens' queries (design.md §2; EntropyInfer
sec. 4.3, Alg. 4). Its storage is `flexentropy.caches.LatentKVCache`, built from an `EntropyConfig`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from flexentropy.config import EntropyConfig
from flexentropy.policies.base import CachePolicy
from flexentropy.policies.cache.common import window_entries, window_scores
from flexentropy.policies.layer import LayerView

CONFIG_FIELDS = {"budget": "decode_budget", "window": "decode_window", "delay": "decode_delay", "pool": "decode_pool",
                 "span": "decode_span", "score": "decode_score", "recompress_every": "recompress_every"}
"""Knob -> the `EntropyConfig` field that is its home (default, validation, documentation)."""

_DEFAULTS = EntropyConfig()


@dataclass(frozen=True)
class LatentPolicy(CachePolicy):
    """Full cache through prefill and ``delay`` generated tokens, then keep the query window's own entries and the
    best others by window attention, ``budget`` per KV head; with ``recompress_every = R`` again whenever
    ``budget + R`` are stored. The knobs are `EntropyConfig`'s ``decode_*`` fields under short names
    (`CONFIG_FIELDS`): same defaults, validated by it."""

    name = "latent"
    paper = "EntropyInfer (From Rigid to Dynamic, 2026), sec. 4.3, Alg. 4"
    keeps = ("query window's own entries + top window-attention entries (pooled, spread to the entries after them), "
             "budget per KV head")
    decides = ("after `delay` generated tokens (window includes them), then whenever `budget + recompress_every` are "
               "stored (None: once, as the paper)")

    budget: int = _DEFAULTS.decode_budget
    window: int = _DEFAULTS.decode_window
    delay: int = _DEFAULTS.decode_delay
    pool: int = _DEFAULTS.decode_pool
    span: int = _DEFAULTS.decode_span
    score: Literal["softmax", "raw"] = _DEFAULTS.decode_score
    recompress_every: int | None = _DEFAULTS.recompress_every

    def __post_init__(self) -> None:
        self.to_config()  # validates every knob

    @classmethod
    def from_config(cls, config: EntropyConfig) -> LatentPolicy:
        return cls(**{knob: getattr(config, field) for knob, field in CONFIG_FIELDS.items()})

    def to_config(self, config: EntropyConfig | None = None) -> EntropyConfig:
        """``config`` (default ``EntropyConfig()``) with this policy's ``decode_*`` knobs."""
        return (config or _DEFAULTS).replace(**{CONFIG_FIELDS[f.name]: getattr(self, f.name) for f in fields(self)})

    @property
    def query_window(self) -> int:
        return self.window

    def before_append(self, layer: LayerView, incoming: int) -> int | None:
        if layer.prompt_length is None or layer.generated < self.delay:
            return None
        delay_reached = layer.previous_generated is not None and layer.previous_generated >= self.delay
        if not delay_reached:  # the first check: the paper's single latent eviction
            return self.budget if layer.stored > self.budget else None
        every = self.recompress_every
        return self.budget if every is not None and layer.stored >= self.budget + every else None

    def scores(self, layer: LayerView) -> torch.Tensor:
        return window_scores(layer, self.score, self.pool, self.span)

    def forced(self, layer: LayerView, incoming: int) -> int:
        return window_entries(layer)
