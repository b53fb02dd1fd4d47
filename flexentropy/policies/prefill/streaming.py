"""``streaming``: sink blocks plus a local window only, no content-based selection (the "A-shape" of StreamingLLM,
Xiao et al., ICLR 2024, as a prefill pattern; MInference's Lambda pattern)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexentropy._checks import check_int
from flexentropy.policies.base import PrefillPolicy
from flexentropy.policies.prefill.fixed import block_table
from flexentropy.sparse.plan import SparsePlan


@dataclass(frozen=True)
class StreamingPrefill(PrefillPolicy):
    """Each segment attends to its own tokens (causal), the first ``config.sink_blocks`` key blocks and the
    ``ceil(window / block_size)`` blocks just before it; the same for every head.

    Knobs: ``window`` (local tokens before each segment, rounded up to whole key blocks; default None: the same
    token budget as the other sparse prefills, ``config.base_budget``). Geometry and dense fallbacks
    (``dense_prefix``, ``dense_last_segment``, ``dense_layers``) come from ``config``, as for every prefill policy.
    """

    name = "streaming"
    paper = "StreamingLLM (Xiao et al., ICLR 2024): attention sinks + local window"
    keeps = "own segment, sink blocks, ceil(window/L_B) local blocks"

    window: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window is not None:
            check_int(type(self).__name__, "window", self.window, 0)

    @property
    def local_tokens(self) -> int:
        """Local window in tokens (``window``, or ``config.base_budget`` when None)."""
        return int(self.config.base_budget) if self.window is None else self.window

    def sparse_plan(self, q: torch.Tensor, k: torch.Tensor, compiled: bool | None = None) -> SparsePlan:
        """The shared `block_table` with no top-k (zero budgets) and the window as forced local blocks, over the
        segments holding the queries (a chunk's rows are the whole prompt's: nothing here reads the queries)."""
        n, q_start = k.shape[-2], k.shape[-2] - q.shape[-2]
        config = self.config.replace(local_blocks=-(-self.local_tokens // self.config.block_size))
        segments, blocks = -(-n // config.segment_size) - q_start // config.segment_size, -(-n // config.block_size)
        scores = torch.zeros(1, 1, segments, blocks, device=q.device)
        table = block_table(scores, scores.new_zeros(1, 1, segments), config, n, q_start=q_start)
        return SparsePlan(table.expand(q.shape[0], q.shape[1], -1, -1).contiguous(), n, config.block_size,
                          q_start=q_start)
