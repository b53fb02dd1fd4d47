"""``infokv``: attention fused with an information signal of the model's forward pass (InfoKV, design.md §3;
the second seed's reading of the paper).

Per layer ``l`` and stored token ``i``::

    A_i = mean attention token i receives from the layer's last `window` queries (and the group's query heads)
    H_i = entropy of the predictive distribution at token i, restricted to its top-256 logits       (eq. 2)
    D_i = 1 - cos(h_i^l, h_i^L) + tau        h^l: layer l's output, h^L: the last layer's              (eq. 6)
    E_i = D_i * H_i                                                                                   (eq. 7)
    S_i = alpha * A_i + (1 - alpha) * softmax_i(E)       softmax over the layer's stored tokens      (eq. 8)

Reading of the seed note (documented choices):

* ``H`` is per token (one predictive distribution per position, shared by every layer); ``D`` and so ``E`` are per
  token *and* layer ("the per-layer entropy score"); the per-layer *budget* stays uniform (the paper's adaptive
  allocation, eqs. 9-10, is an optional variant it does not default to).
* ``A`` is taken per layer and KV head from that layer's own window (the seed says the paper takes it "from the last
  layer"; per layer is what lets each layer and head keep its own top-S under GQA, as SnapKV does; the fusion weight
  ``alpha`` is unchanged).
* ``E`` is stored per KV head at each entry (a float per entry: evictions are per head), and the softmax runs over
  the entries a head still holds.
* ``h^l`` is the residual stream after decoder layer ``l`` (``h^L`` the input of the final norm), so the last layer
  has ``D = tau``.

Schedule: after the prompt's forward (once its hidden states are in) the prompt is compressed to ``budget`` per KV
head if longer, then again whenever ``budget + compress_every`` entries are stored (the paper's "every 1024
tokens" of long decoding). The window's own entries are always kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexentropy._checks import check_int, check_number, check_odd
from flexentropy.policies.base import CachePolicy
from flexentropy.policies.cache.common import check_window_budget, window_entries, window_scores
from flexentropy.policies.layer_view import LayerView


def restricted_entropy(logits: torch.Tensor, top_k: int = 256) -> torch.Tensor:
    """Entropy (nats) of the predictive distribution restricted to its ``top_k`` largest logits (InfoKV eq. 2).

    Args:
        logits: ``[..., V]`` next-token logits.
        top_k: logits kept (all of them when ``V <= top_k``); the softmax is renormalised over them.

    Returns:
        float32 ``[...]`` (float64 for float64 logits).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    top = logits.to(dtype).topk(min(top_k, logits.shape[-1]), dim=-1).values
    log_p = top.log_softmax(dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def entropy_signal(hidden: torch.Tensor, last_hidden: torch.Tensor, entropy: torch.Tensor, tau: float
                   ) -> torch.Tensor:
    """``E = (1 - cos(h^l, h^L) + tau) * H``, ``[B, L]`` float32, from unit-normalised hidden states ``[B, L, d]``
    of a layer and of the last layer, and the predictive entropy ``H [B, L]``."""
    cosine = (hidden.float() * last_hidden.float()).sum(dim=-1)
    return (1.0 - cosine + tau) * entropy.float()


def fused_scores(layer: LayerView, alpha: float, pool: int = 1) -> torch.Tensor:
    """``S = alpha * A + (1 - alpha) * softmax(E)`` over the layer's stored entries, ``[B, Hkv, S]``."""
    attention = window_scores(layer, "softmax", pool)
    if alpha >= 1.0:
        return attention
    signal = layer.stats["signal"]
    if torch.isnan(signal).any():
        raise RuntimeError(f"{layer.owner} layer {layer.layer_idx} misses the model signals of some stored "
                           f"tokens: switch the model with fe.enable(model), whose hooks hand them over")
    real = layer.real_entries()
    signal = signal.to(attention.dtype) if real is None else signal.to(attention.dtype).masked_fill(~real, -math.inf)
    return alpha * attention + (1.0 - alpha) * signal.softmax(dim=-1)


class InfoScoring:
    """InfoKV's scoring, shared by the policies that rank entries with it (`InfoKV`, `BoundedCache`): queries of the
    last ``window`` tokens, the fused score of `fused_scores` (``alpha``), the signal `entropy_signal` (``tau``)
    over the top ``top_k`` logits. The knobs are fields of each policy's dataclass."""

    window: int
    alpha: float
    tau: float
    top_k: int
    stats = {"signal": float("nan")}

    def check_scoring(self, owner: str) -> None:
        check_int(owner, "window", self.window, 1)
        check_number(owner, "alpha", self.alpha, 0.0, 1.0)
        check_number(owner, "tau", self.tau, 0.0)
        check_int(owner, "top_k", self.top_k, 1)

    @property
    def query_window(self) -> int:
        return self.window

    @property
    def needs_signals(self) -> bool:
        return self.alpha < 1.0

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        return restricted_entropy(logits, self.top_k)

    def signal(self, hidden: torch.Tensor, last_hidden: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        return entropy_signal(hidden, last_hidden, entropy, self.tau)


@dataclass(frozen=True)
class InfoKV(InfoScoring, CachePolicy):
    """See the module docstring. Knobs (the paper's defaults): ``budget`` 1024, ``window`` 64, ``alpha`` 0.9,
    ``tau`` 1.0, ``top_k`` 256, ``compress_every`` 1024, ``pool`` 1 (no pooling). With ``alpha = 1`` it is
    SnapKV-like and needs no model signals."""

    name = "infokv"
    paper = "InfoKV (arXiv 2606.26875; second seed)"
    keeps = "window's own entries + top alpha*A + (1-alpha)*softmax(D*H), `budget` per KV head"
    decides = "after the prompt's forward, then whenever budget + compress_every are stored"

    budget: int = 1024
    window: int = 64
    alpha: float = 0.9
    tau: float = 1.0
    top_k: int = 256
    compress_every: int = 1024
    pool: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        self.check_scoring(owner)
        check_window_budget(owner, self.budget, self.window)
        check_int(owner, "compress_every", self.compress_every, 1)
        check_odd(owner, "pool", self.pool)

    def capacity(self) -> int:
        return self.budget + self.compress_every

    def when_settled(self, layer: LayerView) -> int | None:
        first = layer.evictions == 0 and layer.generated == 0 and layer.stored > self.budget
        return self.budget if first or layer.stored >= self.budget + self.compress_every else None

    def scores(self, layer: LayerView) -> torch.Tensor:
        return fused_scores(layer, self.alpha, self.pool)

    def forced(self, layer: LayerView, incoming: int) -> int:
        return window_entries(layer)
