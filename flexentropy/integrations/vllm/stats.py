"""The plugin's counters (one set per process: vLLM's worker) and its log lines.

The log goes to the logger ``vllm.flexentropy``, under vLLM's own logging configuration (so it shows beside vLLM's
lines and follows ``VLLM_LOGGING_LEVEL``). Each distinct notice is logged once per process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("vllm.flexentropy")

LOG_EVERY_S = 60.0
"""Least time between two log lines of the counters (a line reads the mean density, which waits on the device)."""

_noticed: set[str] = set()


def notice_once(message: str, *args: object) -> None:
    """Log ``message % args`` at INFO level the first time this process sees it."""
    text = message % args if args else message
    if text not in _noticed:
        _noticed.add(text)
        logger.info("flexentropy: %s", text)


@dataclass(frozen=True)
class PrefillStats:
    """What the sparse prefill did in this process since the start (or `reset_prefill_stats`).

    Attributes:
        sparse_chunks: long prompt chunks (more query tokens than a decode step, key length past ``dense_prefix``)
            handed to flexentropy's sparse prefill.
        dense_chunks: prompt chunks left to vLLM's kernel (within ``dense_prefix``, or in a step that cannot run
            sparse: the log says why, once).
        sparse_layers: (chunk, layer) pairs whose attention ran the block-sparse kernel.
        dense_layers: (chunk, layer) pairs of sparse chunks that ran dense attention (a layer of
            ``dense_layers``, or a chunk whose segments are all dense).
        mean_density: mean over ``sparse_layers`` of the computed share of the causal key blocks (None before any).
    """

    sparse_chunks: int
    dense_chunks: int
    sparse_layers: int
    dense_layers: int
    mean_density: float | None


class Counters:
    """The counters behind `PrefillStats`: host integers, and the density summed on the device (no wait per step)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sparse_chunks = self.dense_chunks = self.sparse_layers = self.dense_layers = 0
        self.density_sum: torch.Tensor | None = None
        self.logged_at: float | None = None
        self.logged_chunks = 0

    def count_step(self, sparse_chunks: int, dense_chunks: int) -> None:
        """One step's prompt chunks, by path; logs the counters at the first sparse chunk, then at most every
        `LOG_EVERY_S` seconds when they moved (the line covers the steps before this one)."""
        self.sparse_chunks += sparse_chunks
        self.dense_chunks += dense_chunks
        now = time.monotonic()
        if self.sparse_chunks > self.logged_chunks and (self.logged_at is None or now - self.logged_at >= LOG_EVERY_S):
            self.logged_at, self.logged_chunks = now, self.sparse_chunks
            self.log()

    def count_layer(self, density: torch.Tensor | None) -> None:
        """One chunk's attention in one layer: its plan's density (0-d tensor), or None where it ran dense."""
        if density is None:
            self.dense_layers += 1
            return
        self.sparse_layers += 1
        density = density.detach().to(torch.float64)
        self.density_sum = density if self.density_sum is None else self.density_sum + density

    def snapshot(self) -> PrefillStats:
        mean = None if self.density_sum is None else float(self.density_sum) / self.sparse_layers
        return PrefillStats(self.sparse_chunks, self.dense_chunks, self.sparse_layers, self.dense_layers, mean)

    def log(self) -> None:
        stats = self.snapshot()
        density = "-" if stats.mean_density is None else f"{stats.mean_density:.3f}"
        logger.info("flexentropy: %d prompt chunks sparse, %d dense; %d chunk-layers ran the sparse kernel "
                    "(mean density %s), %d ran dense", stats.sparse_chunks, stats.dense_chunks, stats.sparse_layers,
                    density, stats.dense_layers)


COUNTERS = Counters()
"""This process's counters (the worker's, where vLLM runs the model)."""


def prefill_stats() -> PrefillStats:
    """This process's `PrefillStats` (reading the mean density waits for the device). Under vLLM's multiprocessing
    the model runs in a worker process: ``llm.collective_rpc`` with a function calling this reads the worker's."""
    return COUNTERS.snapshot()


def reset_prefill_stats() -> None:
    """Zero this process's counters."""
    COUNTERS.reset()
