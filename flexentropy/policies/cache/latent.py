"""``latent``: latent KV-cache eviction scored by the generated tokens' queries (design.md §2; EntropyInfer
sec. 4.3, Alg. 4). Its storage is `flexentropy.caches.LatentKVCache`, built from an `EntropyConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flexentropy.config import EntropyConfig, check_config
from flexentropy.policies.base import CachePolicy
from flexentropy.policies.cache.common import window_entries, window_scores
from flexentropy.policies.layer_view import LayerView

KNOBS = {"budget": "decode_budget", "window": "decode_window", "delay": "decode_delay", "pool": "decode_pool",
         "span": "decode_span", "score": "decode_score", "group": "decode_group",
         "recompress_every": "recompress_every"}
"""Knob -> the `EntropyConfig` field that is its one home (default, validation, documentation)."""


def knob_message(message: str) -> str:
    """An `EntropyConfig` error about the latent policy's fields under the knobs' names: ``EntropyConfig.`` ->
    ``LatentPolicy.``, each field of `KNOBS` -> its knob (``decode_budget`` -> ``budget``)."""
    message = message.replace("EntropyConfig.", "LatentPolicy.")
    for knob, name in KNOBS.items():
        message = message.replace(name, knob)
    return message


@dataclass(frozen=True)
class LatentPolicy(CachePolicy):
    """Full cache through prefill and ``delay`` generated tokens, then keep the query window's own entries and the
    best others by window attention, ``budget`` per KV head; with ``recompress_every = R`` again whenever
    ``budget + R`` are stored. Its knobs are `EntropyConfig`'s ``decode_*`` fields, read from ``config`` under
    short names (`KNOBS`); ``LatentPolicy.from_knobs(budget=512)`` sets them."""

    name = "latent"
    paper = "EntropyInfer (From Rigid to Dynamic, 2026), sec. 4.3, Alg. 4"
    keeps = ("query window's own entries + top window-attention entries (pooled, spread to the entries after them), "
             "budget per KV head")
    decides = ("after `delay` generated tokens (window includes them; `delay` 0: at the end of each layer's prompt "
               "forward), then whenever `budget + recompress_every` are stored (None: once, as the paper)")

    config: EntropyConfig = field(default_factory=EntropyConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_config(self.config, "LatentPolicy")

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        return (*KNOBS, "config")

    @classmethod
    def from_knobs(cls, **knobs: Any) -> LatentPolicy:
        """``config`` (default ``EntropyConfig()``) with the short-named knobs set, e.g. ``budget=512``; a knob the
        config refuses is named as it was passed (``LatentPolicy.budget``, not ``EntropyConfig.decode_budget``)."""
        config = check_config(knobs.pop("config", None), "LatentPolicy", optional=True)
        try:
            return cls(config.replace(**{KNOBS[name]: value for name, value in knobs.items()}))
        except (TypeError, ValueError) as error:
            raise type(error)(knob_message(str(error))) from None

    budget = property(lambda self: self.config.decode_budget, doc="``EntropyConfig.decode_budget``.")
    window = property(lambda self: self.config.decode_window, doc="``EntropyConfig.decode_window``.")
    delay = property(lambda self: self.config.decode_delay, doc="``EntropyConfig.decode_delay``.")
    pool = property(lambda self: self.config.decode_pool, doc="``EntropyConfig.decode_pool``.")
    span = property(lambda self: self.config.decode_span, doc="``EntropyConfig.decode_span``.")
    score = property(lambda self: self.config.decode_score, doc="``EntropyConfig.decode_score``.")
    group = property(lambda self: self.config.decode_group, doc="``EntropyConfig.decode_group``.")
    recompress_every = property(lambda self: self.config.recompress_every, doc="``EntropyConfig.recompress_every``.")

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

    def when_settled(self, layer: LayerView) -> int | None:
        """With no delay, the first eviction ends the prompt's forward, layer by layer (each layer's full KV is held
        only until its own attention over the prompt has run), scored by the prompt's last ``window`` queries."""
        prompt_only = layer.generated == 0 and layer.previous_generated is None and layer.evictions == 0
        return self.budget if self.delay == 0 and prompt_only and layer.stored > self.budget else None

    def scores(self, layer: LayerView) -> torch.Tensor:
        return window_scores(layer, self.score, self.pool, self.span, self.group)

    def forced(self, layer: LayerView, incoming: int) -> int:
        return window_entries(layer)
