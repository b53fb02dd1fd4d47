"""`EntropyConfig`: every knob of flexentropy's prefill and cache algorithms, validated on construction.

Defaults follow design.md §4 (the seed paper's hyper-parameters and its released code where the two disagree).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import Tensor

from flexentropy._checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_odd,
    is_int,
    is_number,
    label,
    plain_fields,
)

Q_BLOCK_SIZE = 128
"""Query block size of every BlockMask flexentropy builds (the GPU kernels' native tile)."""

OBSERVATIONS = ("paper", "critiprefill", "probe", "pooled")
"""The prefill observations (`EntropyConfig.observation`, `flexentropy.observation_attention`)."""
MASS_OBSERVATIONS = ("probe", "pooled")
"""Observations whose row is the probes' attention mass over the candidate blocks, not a distribution over them."""

BACKENDS = ("auto", "triton", "flash")
DECODE_KERNELS = ("auto", "sdpa", "flash")

MAX_TOKENS = 2**24
"""Upper bound of the token counts that have no bound of their own (``segment_size``, ``dense_prefix``, the
``decode_*`` counts, ``recompress_every``): 16M tokens, past every model's context, where a larger value could only
be a mistake (and one past 2**63 overflows the int64 the code computes in)."""
MAX_BLOCKS = MAX_TOKENS // 64
"""Upper bound of the key-block counts (``sink_blocks``, ``local_blocks``): `MAX_TOKENS` in blocks of 64 tokens."""

COVERAGE_LENGTHS = (32768, 131072)
"""Prompt lengths (tokens) at which a ``(short, long)`` coverage takes its two values (`coverage_at`)."""


def coverage_at(coverage: float | tuple[float, float], seq_len: int | Tensor) -> float | Tensor:
    """The share of observation mass the ``"coverage"`` rule keeps for a ``seq_len``-token prompt.

    A float is used at every length. A pair ``(short, long)`` gives ``short`` up to ``COVERAGE_LENGTHS[0]`` tokens,
    ``long`` from ``COVERAGE_LENGTHS[1]`` on, and between them a value linear in ``log2(seq_len)``. The sparse path
    reads the length rounded up to whole key blocks (``C_B * L_B``), as `reference.coverage_budgets` does; it passes
    it as a 0-d float tensor and gets one back, so that a compiled plan neither guards on the length nor compiles
    again for a new one.
    """
    if not isinstance(coverage, tuple):
        return float(coverage)
    short, long = coverage
    low, high = (math.log2(n) for n in COVERAGE_LENGTHS)
    if isinstance(seq_len, int):
        t = min(max((math.log2(max(seq_len, 1)) - low) / (high - low), 0.0), 1.0)
    else:
        t = ((seq_len.log2() - low) / (high - low)).clamp(0, 1)
    return short * (1 - t) + long * t


@dataclass(frozen=True)
class EntropyConfig:
    """Knobs of entropy-guided sparse prefill (design.md §1) and latent KV cache eviction (design.md §2).

    Sizes are in tokens. ``segment_size`` (L_S) groups queries, ``block_size`` (L_B) groups keys; a segment
    attends to its own tokens causally plus whole selected key blocks before it. Every count of tokens (or cache
    entries) is at most `MAX_TOKENS` (2**24), of key blocks at most `MAX_BLOCKS` (2**18).

    Prefill (paper sec. 4.2, Alg. 1-3):
        segment_size: L_S, a multiple of 128 and of ``block_size``, at most `MAX_TOKENS` (default 256: at the same
            coverage, segments of 256 keep the answers of Qwen2.5-Coder-1.5B at 32k with fewer blocks than 512,
            docs/quality.md).
        block_size: L_B, 64 or 128 (the kernel's KV tile; the FLASH backend needs 128).
        base_budget: B_0, key tokens per segment for rigid heads and the floor for dynamic heads.
        entropy_threshold: e_t; a head whose largest segment entropy is below it is rigid.
        budget_alpha: alpha, how strongly a dynamic head's budget follows entropy fluctuation.
        fluctuation_threshold: delta_t, the fluctuation rate at which the budget stays unchanged.
        max_budget_factor: budgets are clamped to ``[B_0, max_budget_factor * B_0]`` (``"fluctuation"``).
        budget_rule: how a (head, segment) budget is set: ``"coverage"`` (default: the fewest candidate blocks
            holding ``coverage`` of the segment's observation mass, at least one; a spread-out row, i.e. a
            high-entropy one, gets more; design.md §1.4b) or ``"fluctuation"`` (paper Alg. 3: rigid heads B_0,
            dynamic heads follow the entropy's fluctuation; ``base_budget`` and the alpha/delta/factor knobs).
        coverage: share of the observation mass the ``"coverage"`` rule keeps, in ``(0, 1]``: one value for every
            prompt length, or ``(short, long)`` with ``short >= long``: ``short`` up to 32k tokens, ``long`` from
            128k, linear in the log of the length between (`coverage_at`). Default ``(0.8, 0.6)``: 0.8 kept every
            needle task of Qwen2.5-Coder-1.5B at 32k (19.5% of the key blocks), and 0.6 its needles at 128k under
            YaRN at under 10% (docs/quality.md).
        fluctuation: ``"abs"`` (paper, ``|e_s - e_{s-1}| / e_{s-1}``) or ``"signed"`` (released code, clamped).
        observation: ``"probe"`` (default: the true attention of ``probes`` strided queries per segment;
            design.md §1.2b), ``"pooled"`` (the same probes against one mean key per block: ``block_size``
            times cheaper, an estimate; design.md §1.2c), ``"paper"`` (Alg. 2: max of two averaged softmaxes of
            representatives) or ``"critiprefill"`` (one softmax).
        observation_scale: factor on the observation's logits: the representatives' products for ``"paper"`` and
            ``"critiprefill"`` (paper: 1.0, no 1/sqrt(D)); the attention's own ``q.k / sqrt(D)`` for ``"probe"`` and
            ``"pooled"``.
        probes: probe queries per segment of the ``"probe"`` and ``"pooled"`` observations (a divisor of
            ``segment_size``).
        probe_kernel: compute the probes' block masses with compiled flex attention, no score stored
            (`probe_mass_kernel`), or (False) by scoring probe rows in chunks; the same masses. ``None`` (default):
            the kernel on CUDA outside an enclosing ``torch.compile`` (the faster one there, docs/performance.md),
            the scored path elsewhere.
        sink_blocks: leading key blocks every segment attends to.
        local_blocks: key blocks just before each segment that it always attends to.
        dense_prefix: segments starting before this many tokens attend densely; ``N <= dense_prefix`` is dense.
        dense_last_segment: the segments holding the last ``segment_size`` tokens (where the question usually
            sits) attend densely: the last segment, and the one before it when the last one is partial.
        dense_layers: layer indices that always run dense attention.
        backend: sparse kernel backend: ``"auto"`` (FLASH when flash-attn-4 is importable on CUDA and
            ``block_size == 128``, else Triton/CPU), ``"triton"`` or ``"flash"``.

    Decode (paper sec. 4.3, Alg. 4):
        decode_budget: B_d, cache entries kept per KV head after eviction (window included).
        decode_window: N_W, most recent post-RoPE queries kept for scoring.
        decode_delay: N_D, generated tokens before the first eviction (0: at the end of the prompt's forward, each
            layer right after its own attention over the prompt, scored by the prompt's last ``decode_window``
            queries: the prompt's full KV is then held for one layer at a time).
        decode_pool: width of the 1-D average pooling of scores (odd; 1 turns it off).
        decode_span: an entry's (pooled) score also counts for the ``decode_span`` entries after it (each entry scores
            the max over itself and the ``decode_span`` before it): a value the answer is copying keeps the tokens that
            follow the one being read (0: off, as the paper; at most `MAX_TOKENS`).
        decode_score: ``"softmax"`` (mean softmax attention) or ``"raw"`` (paper's sum of raw logits).
        decode_group: how a KV head combines its group's query heads (GQA): ``"mean"`` over the heads (and the
            window's queries), or ``"max"``: each query head scores over the window on its own and the KV head keeps
            the best, so an entry that one head reads is not diluted by the heads that do not.
        recompress_every: R: after the first eviction, evict again whenever ``decode_budget + R`` entries are
            stored, so a KV head never holds more than ``decode_budget + R`` entries (default 32: the budget bounds
            memory). None evicts once, as the paper does: the cache then grows by one entry per generated token.
        decode_kernel: attention kernel of a `StaticLatentKVCache` decode step: ``"auto"`` (flash-attn-4's, faster than
            SDPA's on the GPU, docs/performance.md, where it can run: CUDA, 16-bit, flash-attn-4 importable, no padded
            row; else SDPA with the validity mask), ``"sdpa"`` or ``"flash"`` (raises where it cannot run).
    """

    segment_size: int = 256
    block_size: int = 128
    base_budget: float = 2048
    entropy_threshold: float = 1e-5
    budget_alpha: float = 0.5
    fluctuation_threshold: float = 0.4
    max_budget_factor: float = 3.0
    fluctuation: Literal["abs", "signed"] = "abs"
    budget_rule: Literal["fluctuation", "coverage"] = "coverage"
    coverage: float | tuple[float, float] = (0.8, 0.6)
    observation: Literal["paper", "critiprefill", "probe", "pooled"] = "probe"
    observation_scale: float = 1.0
    probes: int = 16
    probe_kernel: bool | None = None
    sink_blocks: int = 1
    local_blocks: int = 0
    dense_prefix: int = 4096
    dense_last_segment: bool = True
    dense_layers: tuple[int, ...] = (0,)
    backend: Literal["auto", "triton", "flash"] = "auto"
    decode_budget: int = 1024
    decode_window: int = 32
    decode_delay: int = 16
    decode_pool: int = 5
    decode_span: int = 16
    decode_score: Literal["softmax", "raw"] = "softmax"
    decode_group: Literal["mean", "max"] = "mean"
    recompress_every: int | None = 32
    decode_kernel: Literal["auto", "sdpa", "flash"] = "auto"

    def __post_init__(self) -> None:
        plain_fields(self)
        owner = type(self).__name__
        for name in ("segment_size", "block_size", "sink_blocks", "local_blocks", "dense_prefix",
                     "decode_budget", "decode_window", "decode_delay", "decode_pool"):
            check_int(owner, name, getattr(self, name), None)
        if self.block_size not in (64, 128):
            raise ValueError(f"EntropyConfig.block_size must be 64 or 128, got {self.block_size}")
        if (self.segment_size <= 0 or self.segment_size % Q_BLOCK_SIZE or self.segment_size % self.block_size
                or self.segment_size > MAX_TOKENS):
            raise ValueError(
                f"EntropyConfig.segment_size must be a positive multiple of {Q_BLOCK_SIZE} and of "
                f"block_size={self.block_size}, at most {MAX_TOKENS} tokens, got {self.segment_size}"
            )
        for name in ("base_budget", "entropy_threshold", "observation_scale"):
            check_number(owner, name, getattr(self, name), 0, open_low=True)
        for name in ("budget_alpha", "fluctuation_threshold"):
            check_number(owner, name, getattr(self, name), 0)
        for name in ("sink_blocks", "local_blocks"):
            check_int(owner, name, getattr(self, name), 0, MAX_BLOCKS)
        check_int(owner, "dense_prefix", self.dense_prefix, 0, MAX_TOKENS)
        check_number(owner, "max_budget_factor", self.max_budget_factor, 1)
        check_choice(owner, "fluctuation", self.fluctuation, ("abs", "signed"))
        check_choice(owner, "budget_rule", self.budget_rule, ("fluctuation", "coverage"))
        pair = isinstance(self.coverage, tuple)
        if not (pair and len(self.coverage) == 2 or is_number(self.coverage)):
            error = ValueError if pair else TypeError
            raise error(f"EntropyConfig.coverage must be a number in (0, 1] or a (short, long) tuple of two, "
                        f"got {type(self.coverage).__name__} {self.coverage!r}")
        for value in self.coverage if pair else (self.coverage,):
            check_number(owner, "coverage", value, 0, 1, open_low=True)
        if pair and self.coverage[0] < self.coverage[1]:
            raise ValueError(f"EntropyConfig.coverage (short, long) must not rise with the prompt's length: expected "
                             f"short >= long, got {self.coverage!r} (one number keeps the same share at every length)")
        check_choice(owner, "observation", self.observation, OBSERVATIONS)
        check_int(owner, "probes", self.probes, 1)
        if self.segment_size % self.probes:
            raise ValueError(f"EntropyConfig.probes must divide segment_size={self.segment_size}, got {self.probes}")
        check_choice(owner, "decode_score", self.decode_score, ("softmax", "raw"))
        check_choice(owner, "decode_group", self.decode_group, ("mean", "max"))
        check_choice(owner, "backend", self.backend, BACKENDS)
        check_choice(owner, "decode_kernel", self.decode_kernel, DECODE_KERNELS)
        if not isinstance(self.dense_layers, tuple) or not all(is_int(i) and i >= 0 for i in self.dense_layers):
            raise ValueError(f"EntropyConfig.dense_layers must be a tuple of layer indices >= 0, "
                             f"got {self.dense_layers!r}")
        check_bool(owner, "dense_last_segment", self.dense_last_segment)
        check_bool(owner, "probe_kernel", self.probe_kernel, optional=True)
        check_int(owner, "decode_window", self.decode_window, 1, MAX_TOKENS)
        check_int(owner, "decode_budget", self.decode_budget, 1, MAX_TOKENS)
        check_int(owner, "decode_delay", self.decode_delay, 0, MAX_TOKENS)
        if self.decode_budget < self.decode_window:
            raise ValueError(
                f"EntropyConfig.decode_budget ({self.decode_budget}) must be >= decode_window "
                f"({self.decode_window}): the window's own entries are always kept"
            )
        check_odd(owner, "decode_pool", self.decode_pool, MAX_TOKENS)
        check_int(owner, "decode_span", self.decode_span, 0, MAX_TOKENS)
        if self.recompress_every is not None:
            check_int(owner, "recompress_every", self.recompress_every, 1, MAX_TOKENS)

    @classmethod
    def paper(cls, **changes: object) -> EntropyConfig:
        """The seed paper's method (EntropyInfer, sec. 4.2): Alg. 2's observation of max/min representatives and
        Alg. 3's fluctuation budgets from ``B_0 = base_budget``, on segments of 512 (the default before segments of
        256 were measured to keep more answers), every other knob as the defaults (or ``changes``).
        docs/quality.md compares it with the default (probe observation, coverage budgets) on a real 32k model."""
        return cls(**{"observation": "paper", "budget_rule": "fluctuation", "segment_size": 512, **changes})

    def replace(self, **changes: object) -> EntropyConfig:
        """A copy with ``changes`` applied (and validated)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"EntropyConfig has no field(s) {sorted(unknown)}")
        return replace(self, **changes)

    def is_dense_layer(self, layer_idx: int, seq_len: int) -> bool:
        """Deprecated: the prefill policy decides, in one place for every path
        (``flexentropy.make_prefill(name, config).runs_dense(layer_idx, seq_len)``). Whether layer ``layer_idx``
        runs plain causal attention for a prompt of ``seq_len`` tokens under a sparse rule."""
        warnings.warn("EntropyConfig.is_dense_layer is deprecated: the prefill policy decides "
                      "(flexentropy.make_prefill(name, config).runs_dense(layer_idx, seq_len))", DeprecationWarning,
                      stacklevel=2)
        return layer_idx in self.dense_layers or seq_len <= self.dense_prefix


def check_config(config: object, owner: str = "", *, optional: bool = False) -> EntropyConfig:
    """``config`` if it is an `EntropyConfig` (``EntropyConfig()`` for None when ``optional``), else `TypeError`."""
    if config is None and optional:
        return EntropyConfig()
    if not isinstance(config, EntropyConfig):
        expected = "an EntropyConfig or None" if optional else "an EntropyConfig"
        hint = " (build one from the mapping's fields: EntropyConfig(**values))" if isinstance(config, Mapping) else ""
        raise TypeError(f"{label(owner, 'config')} must be {expected}, got {type(config).__name__}{hint}")
    return config
