"""``bounded``: a constant-size cache of sinks + a recent window + an anchor bank refilled chunk by chunk with an
information-aware score (the second seed's proposal: R-SWA's O(1) container, InfoKV-style selection for the anchor
slots, block-causal chunk granularity).

Layout per KV head, ``size = sinks + anchors + recent`` entries at most:

* **sinks**: the first ``sinks`` tokens (StreamingLLM's degenerate reference);
* **recent window**: every token from a chunk-aligned start ``w`` on (``w`` a multiple of ``chunk``); it slides by
  whole chunks, so at least ``recent - chunk + 1`` recent tokens are always held;
* **anchor bank**: ``anchors`` older tokens. When the window slides, the chunks that leave it join the current
  anchors as candidates and the bank keeps the best ``anchors`` of them by InfoKV's fused score
  ``alpha * A + (1 - alpha) * softmax(D * H)`` (`flexentropy.policies.cache.infokv`), per KV head.

The slide happens before new tokens are appended, so no update ever stores more than ``size`` entries per head
(decoding one token at a time); a prompt longer than ``size`` is cut to it right after its forward (its attention
reads it whole). Chunks only set the eviction granularity: attention inside a chunk stays causal (the seed's caveat:
no bidirectional chunk interior for autoregressive models).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexentropy._checks import check_int
from flexentropy.policies.base import CachePolicy
from flexentropy.policies.cache.infokv import InfoScoring, fused_scores
from flexentropy.policies.layer_view import LayerView


@dataclass(frozen=True)
class BoundedCache(InfoScoring, CachePolicy):
    """See the module docstring. Knobs: ``sinks`` 4, ``anchors`` 256, ``recent`` 256, ``chunk`` 64,
    ``window`` 32 (queries scoring the anchors), ``alpha`` 0.9, ``tau`` 1.0, ``top_k`` 256 (InfoKV's).

    Left-padded batches: padding is never scored or a sink, but the recent window is chunk-aligned on the batch's
    positions, so a padded row may keep a different window than alone."""

    name = "bounded"
    paper = "second seed: R-SWA container + InfoKV anchors at chunk granularity (cf. StreamingLLM, LaCache, R-KV)"
    keeps = "`sinks` + chunk-aligned recent window + `anchors` best older tokens by InfoKV's score; constant size"
    decides = "whenever the recent window must slide (before an append), and after a prompt longer than size"

    sinks: int = 4
    anchors: int = 256
    recent: int = 256
    chunk: int = 64
    window: int = 32
    alpha: float = 0.9
    tau: float = 1.0
    top_k: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_int(owner, "sinks", self.sinks, 0)
        check_int(owner, "anchors", self.anchors, 0)
        check_int(owner, "chunk", self.chunk, 1)
        check_int(owner, "recent", self.recent, self.chunk,
                  minimum_is=f"chunk={self.chunk}: the recent window holds at least one whole chunk")
        self.check_scoring(owner)

    @property
    def size(self) -> int:
        """Most entries per KV head ever stored (between forwards and at every decoding step)."""
        return self.sinks + self.anchors + self.recent

    def capacity(self) -> int:
        return self.size

    def window_start(self, total: int) -> int:
        """Chunk-aligned start of the recent window for ``total`` tokens: the smallest multiple of ``chunk`` that is
        not before the sinks and leaves at most ``recent`` tokens after it."""
        return -(-max(total - self.recent, self.sinks, 0) // self.chunk) * self.chunk

    def before_append(self, layer: LayerView, incoming: int) -> int | None:
        if layer.prompt_length is None or layer.stored + incoming <= self.size:
            return None
        return self._target(layer, incoming)

    def when_settled(self, layer: LayerView) -> int | None:
        return self._target(layer, 0) if layer.stored > self.size else None

    def _target(self, layer: LayerView, incoming: int) -> int:
        start = min(self.window_start(layer.seen + incoming), layer.seen)
        fixed = min(self.sinks, layer.seen) + layer.seen - start
        return fixed + min(self.anchors, layer.stored - fixed)

    def forced(self, layer: LayerView, incoming: int) -> torch.Tensor:
        positions, row = layer.positions(), layer.row_positions()  # sinks: a row's first real tokens
        start = min(self.window_start(layer.seen + incoming), layer.seen)
        return ((row >= 0) & (row < self.sinks)) | (positions >= start)

    def scores(self, layer: LayerView) -> torch.Tensor:
        return fused_scores(layer, self.alpha)
