"""Score: importance of each cached key under a window of recent queries (design.md §2; paper sec. 4.3, Alg. 4 step 2).

First stage of the cache's *score -> keep -> gather* pipeline. Pure functions over tensors, vectorised over batch,
heads, window queries and keys, so that every eviction policy of design.md §3 (SnapKV, AdaKV, PyramidKV, InfoKV...)
scores the same way. Memory is ``O(B * Hq * W * T)`` for ``W`` window queries and ``T`` cached keys: never ``T x T``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.fx.experimental import _config as shape_config

from flexentropy._checks import is_int
from flexentropy._compile import compiled, keep_dynamic, no_silent_fallback

SCORE_KINDS = ("softmax", "raw")
GROUP_MODES = ("mean", "max")
"""How a KV head combines its group's query heads (`window_attention_scores`)."""
"""``softmax``: mean attention probability (design.md §2 default); ``raw``: the paper's sum of logits (Alg. 4 line
14)."""


def _check_positions(name: str, positions: torch.Tensor, shapes: tuple[tuple[int, ...], ...]) -> None:
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise TypeError(f"{name} must be an integer tensor of token positions, got {got}")
    if tuple(positions.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(str(list(s)) for s in shapes)}, "
                         f"got {list(positions.shape)}")


def window_attention_scores(
    window_q: torch.Tensor,
    keys: torch.Tensor,
    *,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    kind: Literal["softmax", "raw"] = "softmax",
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    group_mode: Literal["mean", "max"] = "mean",
) -> torch.Tensor:
    """Importance of every cached key per KV head, from a window of post-RoPE queries (paper Alg. 4 step 2).

    Args:
        window_q: ``[B, Hq, W, D]`` the window's queries (post-RoPE), ``Hq = G * Hkv``; query head ``h`` belongs to
            KV head ``h // G`` (the layout of HF ``repeat_kv`` and SDPA ``enable_gqa``).
        keys: ``[B, Hkv, T, D]`` cached keys, stored per KV head.
        query_positions: ``[W]`` logical token positions of the window's queries.
        key_positions: ``[T]`` or ``[B, Hkv, T]`` logical token positions of the cached keys (after an eviction
            every head keeps its own entries). Query ``i`` sees key ``j`` iff ``key_positions[j] <=
            query_positions[i]`` (causal).
        kind: ``"softmax"`` (design.md §2): for each window query and each of the group's ``G`` query heads, the
        softmax of
            ``scale * q.k`` over the keys it sees, averaged over the ``W * G`` (query, head) pairs; a key a query does
            not see contributes probability 0, and a query that sees no cached key (all evicted) contributes nothing.
            ``"raw"`` (paper Alg. 4 lines 13-14, ``w = sum_i Q_W K^T``): the sum of
            the unscaled logits ``q.k`` over the same pairs, a key a query does not see contributing 0.
        scale: softmax temperature, default ``1 / sqrt(D)``; ignored by ``"raw"``.
        key_mask: optional bool ``[B, Hkv, T]``: False hides a key from every query (e.g. a left-padding token), as
            if it were not cached (score 0).
        group_mode: ``"mean"`` combines the group's query heads as above; ``"max"`` scores each query head over the
            window alone (its mean over the ``W`` queries, or sum for ``"raw"``) and takes the best head.

    Returns:
        ``[B, Hkv, T]`` scores, float32 (float64 when the inputs are float64): higher is more important.
    """
    if window_q.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"window_q must be [B, Hq, W, D] and keys [B, Hkv, T, D], got {list(window_q.shape)} "
                         f"and {list(keys.shape)}")
    batch, q_heads, window, dim = window_q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    if keys.shape[0] != batch or keys.shape[3] != dim:
        raise ValueError(f"keys {list(keys.shape)} must match window_q {list(window_q.shape)} in batch and head dim")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a positive multiple of key/value heads ({kv_heads})")
    if kind not in SCORE_KINDS:
        raise ValueError(f"kind must be one of {SCORE_KINDS}, got {kind!r}")
    if group_mode not in GROUP_MODES:
        raise ValueError(f"group_mode must be one of {GROUP_MODES}, got {group_mode!r}")
    _check_positions("query_positions", query_positions, ((window,),))
    _check_positions("key_positions", key_positions, ((length,), (batch, kv_heads, length)))

    dtype = torch.promote_types(window_q.dtype, torch.float32)
    group = q_heads // kv_heads
    q = rearrange(window_q, "b (h g) w d -> (b h) (g w) d", g=group)
    logits = window_logits(q, keys.flatten(0, 1), dtype).view(batch * kv_heads, group, window, length)
    # [1, T] (every head holds the same positions) or [B * Hkv, T], and the keys no query sees, or None.
    positions = key_positions.view(1, length) if key_positions.dim() == 1 else key_positions.flatten(0, 1)
    hidden = None if key_mask is None else key_mask.flatten(0, 1)
    if kind == "raw":
        hide = ~visible_keys(positions, query_positions, hidden)
        per_head = logits.masked_fill_(hide, 0.0).sum(dim=2)                               # [B * Hkv, G, T]
        scores = per_head.sum(dim=1) if group_mode == "mean" else per_head.amax(dim=1)
    else:
        scale = dim**-0.5 if scale is None else scale
        scores = softmax_scores(logits, positions, query_positions, hidden, scale, group_mode)
    return scores.view(batch, kv_heads, length)


def window_logits(q: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[N, R, T]`` logits ``q [N, R, D] . keys [N, T, D]`` in ``dtype``: on CUDA, half-precision inputs go through
    the GEMM with a float32 output (products exact, float32 accumulation) instead of a float32 copy of the keys."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and keys.dtype == q.dtype and dtype == torch.float32:
        return torch.bmm(q, keys.transpose(1, 2), out_dtype=torch.float32)
    return q.to(dtype) @ keys.to(dtype).transpose(1, 2)


def visible_keys(positions: torch.Tensor, query_positions: torch.Tensor, hidden: torch.Tensor | None
                 ) -> torch.Tensor:
    """bool ``[1 or N, 1, W, T]``: window query ``w`` sees the key at ``positions [1 or N, T]`` up to
    ``query_positions[w]``, unless ``hidden [N, T]`` is False there (a singleton axis for the group's query heads)."""
    visible = (positions[:, None, :] <= query_positions[:, None])[:, None]
    return visible if hidden is None else visible & hidden[:, None, None, :]


def _softmax_scores(logits: torch.Tensor, positions: torch.Tensor, query_positions: torch.Tensor,
                    hidden: torch.Tensor | None, scale: float, group_mode: str) -> torch.Tensor:
    """``[N, T]`` mean softmax probability of each key under ``logits [N, G, W, T]`` (unscaled), query ``w`` seeing
    the keys of ``positions [1 or N, T]`` up to ``query_positions[w]`` and not ``hidden [N, T]`` (False)."""
    visible = visible_keys(positions, query_positions, hidden)
    scaled = torch.where(visible, logits * scale, float("-inf"))
    # A query that sees no key has lse -inf: its row is all hidden, so it adds 0 without a NaN reaching the sum.
    probs = torch.where(visible, torch.exp(scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)), 0.0)
    if group_mode == "mean":
        return probs.mean(dim=(1, 2))
    return probs.mean(dim=2).amax(dim=1)


_compiled_softmax_scores = compiled(_softmax_scores, dynamic=True, fullgraph=True)


def softmax_scores(logits: torch.Tensor, positions: torch.Tensor, query_positions: torch.Tensor,
                   hidden: torch.Tensor | None, scale: float, group_mode: str, *, compiled: bool | None = None
                   ) -> torch.Tensor:
    """`_softmax_scores`, on CUDA (or with ``compiled=True``) as one compiled pass for the row statistics and one
    for the sums over the window: the ``[N, G, W, T]`` logits are read twice and nothing of their size is written.
    Eager elsewhere (``compiled=False``; inside an outer compile the outer graph traces it)."""
    if compiled is None:
        compiled = logits.is_cuda
    if not compiled or torch.compiler.is_compiling():
        return _softmax_scores(logits, positions, query_positions, hidden, scale, group_mode)
    # rows (layers x batch x KV heads), window queries (a policy may score a prompt in chunks of queries) and keys:
    # one graph for all; the group is the model's
    keep_dynamic(logits, dims=(0, 2, 3))
    keep_dynamic(query_positions, dims=(0,))
    keep_dynamic(positions, dims=(-1,))
    torch._dynamo.mark_static(logits, 1)
    # Without duck sizing, rows that happen to equal the group or the window stay a size of their own.
    with no_silent_fallback(), shape_config.patch(use_duck_shape=False):
        return _compiled_softmax_scores(logits, positions, query_positions, hidden, scale, group_mode)


def pool_scores(scores: torch.Tensor, width: int) -> torch.Tensor:
    """1-D average pooling of ``scores [..., T]`` along ``T``, same length (design.md §2 ``decode_pool``, as SnapKV).

    Entry ``t`` becomes the sum of ``scores[t - width//2 : t + width//2 + 1]`` divided by ``width``: positions
    beyond either end count as 0 (zero padding included in the average). ``width`` is odd; 1 returns ``scores``.
    """
    if not is_int(width) or width < 1 or width % 2 == 0:
        raise ValueError(f"width must be an odd int >= 1 (1 = no pooling), got {width!r}")
    if width == 1:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    return F.avg_pool1d(flat, width, stride=1, padding=width // 2).reshape(scores.shape)


def spread_forward(scores: torch.Tensor, span: int) -> torch.Tensor:
    """``[..., T]``: entry ``t`` becomes the max of ``scores[t - span : t + 1]`` (those before the start not counted),
    so the ``span`` entries after an attended one keep its score (design.md §2 ``decode_span``). 0 returns
    ``scores``.

    Why: a window query reading a value attends the token it copies next; the rest of the value lies after it, with
    no attention yet. Average pooling keeps ``pool // 2`` of those tokens; an answer that outlives the eviction
    needs the rest.

    A ``span`` of ``T - 1`` or more reaches back to the first entry from every ``t`` (a running max): it is cut to
    ``T - 1``, which gives the same result, so the cost stays that of the scores' length.
    """
    if not is_int(span) or span < 0:
        raise ValueError(f"span must be an int >= 0 (0 = off), got {span!r}")
    span = min(span, scores.shape[-1] - 1)
    if span <= 0:
        return scores
    flat = F.pad(scores.reshape(-1, 1, scores.shape[-1]), (span, 0), value=float("-inf"))
    return F.max_pool1d(flat, span + 1, stride=1).reshape(scores.shape)
