"""Dense reference twins of every prefill and cache policy (design.md §3; `flexentropy.policies`).

Written to be read against the papers and the policy docstrings, not to be fast: explicit Python loops over batch
rows, heads, segments, entries and queries, float64, per-head Python lists for the cache, no vectorised top-k. It
shares nothing with ``flexentropy.policies`` / ``flexentropy.caches`` except :class:`flexentropy.config.EntropyConfig`
and the loop-based oracles of :mod:`reference.prefill` and :mod:`reference.cache`.

Notation: queries ``[B, Hq, ., D]``, keys/values ``[B, Hkv, ., D]``, ``G = Hq // Hkv``, query head ``hq`` reads KV
head ``hq // G``; positions are 0-based logical token positions, query ``i`` sees key ``j`` iff ``pos(j) <= pos(i)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from flexentropy.config import Q_BLOCK_SIZE, EntropyConfig
from reference import cache as ref_cache
from reference import peers as ref_peers
from reference import prefill as ref_prefill

F64 = torch.float64


# --------------------------------------------------------------------------------------------------------------
# Prefill policies: block tables [B, Hq, C_Q, C_B]
# --------------------------------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _segment_rows(q: torch.Tensor, config: EntropyConfig, a_obs: torch.Tensor | None, k_per_segment: int,
                  local_blocks: int) -> torch.Tensor:
    """Block table where every non-dense segment keeps its forced blocks (sinks, ``local_blocks`` before it) and the
    top ``k_per_segment`` other candidates by ``a_obs`` (ties to the lower block), the same ``k`` for every head."""
    batch, q_heads, n, _ = q.shape
    seg, blk = config.segment_size, config.block_size
    num_segments, num_blocks, num_qblocks = _ceil_div(n, seg), _ceil_div(n, blk), _ceil_div(n, Q_BLOCK_SIZE)
    blocks = torch.zeros(batch, q_heads, num_qblocks, num_blocks, dtype=torch.bool)
    for b in range(batch):
        for h in range(q_heads):
            chosen = []
            for s in range(num_segments):
                cand = ref_prefill.candidate_blocks(s, seg, blk, num_blocks)
                first = s * seg // blk
                if ref_prefill.dense_row(s, n, config):
                    chosen.append(list(cand))
                    continue
                forced = [j for j in cand if j < config.sink_blocks or first - local_blocks <= j < first]
                rest = [j for j in cand if j not in forced]
                ranked = sorted(rest, key=lambda j: (-float(a_obs[b, h, s, j]) if a_obs is not None else 0.0, j))
                chosen.append(forced + ranked[: min(k_per_segment, len(rest))])
            for qb in range(num_qblocks):
                s = qb * Q_BLOCK_SIZE // seg
                last = (min((qb + 1) * Q_BLOCK_SIZE, n) - 1) // blk
                for j in chosen[s] + list(range(s * seg // blk, last + 1)):
                    blocks[b, h, qb, j] = True
    return blocks


def _causal_table(q: torch.Tensor, block_size: int) -> torch.Tensor:
    batch, q_heads, n, _ = q.shape
    blocks = torch.zeros(batch, q_heads, _ceil_div(n, Q_BLOCK_SIZE), _ceil_div(n, block_size), dtype=torch.bool)
    for qb in range(blocks.shape[2]):
        blocks[:, :, qb, : (min((qb + 1) * Q_BLOCK_SIZE, n) - 1) // block_size + 1] = True
    return blocks


def prefill_blocks(name: str, q: torch.Tensor, k: torch.Tensor, config: EntropyConfig, layer_idx: int | None = None,
                   **knobs: object) -> torch.Tensor:
    """Block table ``[B, Hq, C_Q, C_B]`` of prefill policy ``name`` (``dense``, ``entropy``, ``critiprefill``,
    ``streaming``, ``flexprefill``, ``xattention``, ``vertical_slash``) for one layer; dense layers
    (``config.dense_layers``, ``N <= dense_prefix``) get every causal block.

    * ``entropy``: :func:`reference.prefill.select_blocks` (design.md §1); ``entropy_paper``: the same with
      ``observation="paper"`` and ``budget_rule="fluctuation"``.
    * ``critiprefill``: observation attention ``knobs["observation"]`` (default ``"critiprefill"``), then per
      segment the top ``floor(B_0 / L_B)`` non-forced candidates, the same for every head.
    * ``streaming``: the forced blocks only, with ``ceil(knobs["window"] / L_B)`` local blocks (default
      ``config.base_budget`` tokens).
    * ``flexprefill``, ``xattention``, ``vertical_slash``: :mod:`reference.peers` with ``knobs``.
    """
    n = q.shape[2]
    if name == "dense" or (layer_idx is not None and layer_idx in config.dense_layers) or n <= config.dense_prefix:
        return _causal_table(q, config.block_size)
    if name == "entropy":
        return ref_prefill.select_blocks(q, k, config, layer_idx).blocks
    if name == "entropy_paper":
        paper = config.replace(observation="paper", budget_rule="fluctuation")
        return ref_prefill.select_blocks(q, k, paper, layer_idx).blocks
    if name == "critiprefill":
        observation = knobs.get("observation", "critiprefill")
        a_obs = ref_prefill.observation_attention(q, k, config.segment_size, config.block_size,
                                                  observation=observation, scale=config.observation_scale,
                                                  probes=config.probes)
        return _segment_rows(q, config, a_obs, math.floor(config.base_budget / config.block_size),
                             config.local_blocks)
    if name == "streaming":
        window = knobs.get("window")
        window = int(config.base_budget) if window is None else int(window)
        return _segment_rows(q, config, None, 0, _ceil_div(window, config.block_size))
    peers = {"flexprefill": ref_peers.flexprefill_blocks, "xattention": ref_peers.xattention_blocks,
             "vertical_slash": ref_peers.vertical_slash_blocks}
    if name in peers:
        return peers[name](q, k, config, **knobs)
    raise ValueError(f"unknown prefill policy {name!r}")


# --------------------------------------------------------------------------------------------------------------
# Cache policy pieces
# --------------------------------------------------------------------------------------------------------------


def pyramid_budgets(budget: int, window: int, num_layers: int, beta: float, prompt_length: int) -> list[int]:
    """PyramidKV's per-layer budgets, bottom to top: beyond the window, ``(budget - window) // beta`` at the top,
    ``2 * (budget - window)`` minus that at the bottom (capped at the prompt, the top raised to keep the mean), the
    layers in between on the line through them, floored."""
    min_num = int((budget - window) // beta)
    max_num = (budget - window) * 2 - min_num
    if max_num >= prompt_length - window:
        max_num = max(prompt_length - window, 0)
        min_num = (budget - window) * 2 - max_num
    if num_layers == 1:
        return [budget]
    budgets = []
    for layer in range(num_layers):
        fraction = Fraction(layer, num_layers - 1)
        budgets.append(window + math.floor(max_num + fraction * (min_num - max_num)))
    return budgets


def adakv_keep(scores: torch.Tensor, budget: int, window: int, safeguard: float) -> list[list[list[int]]]:
    """Ada-KV allocation: per ``[b][h]`` the kept entry indices, ascending.

    Per head: the last ``window`` entries, then the best others up to ``max(window, floor(safeguard * budget))``
    (protected). Per batch row: every protected entry, then the best remaining ``(h, j)`` pairs by score (ties: the
    lower ``h * S + j``) until ``Hkv * budget`` are kept.
    """
    batch, heads, length = scores.shape
    guaranteed = min(max(window, math.floor(safeguard * budget)), budget)
    kept = []
    for b in range(batch):
        protected = set()
        for h in range(heads):
            ranked = sorted(range(length), key=lambda j: (j < length - window, -float(scores[b, h, j]), j))
            protected.update((h, j) for j in ranked[:guaranteed])
        pairs = sorted(((h, j) for h in range(heads) for j in range(length)),
                       key=lambda p: (p not in protected, -float(scores[b, p[0], p[1]]), p[0] * length + p[1]))
        chosen = pairs[: heads * budget]
        kept.append([sorted(j for (hh, j) in chosen if hh == h) for h in range(heads)])
    return kept


def restricted_entropy(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Entropy of softmax over the ``top_k`` largest logits of each row, float64, one row at a time."""
    flat = logits.reshape(-1, logits.shape[-1]).to(F64)
    out = torch.empty(flat.shape[0], dtype=F64)
    for r in range(flat.shape[0]):
        top = sorted(flat[r].tolist(), reverse=True)[: min(top_k, flat.shape[1])]
        peak = top[0]
        weights = [math.exp(x - peak) for x in top]
        total = sum(weights)
        out[r] = -sum(w / total * math.log(w / total) for w in weights if w > 0)
    return out.reshape(logits.shape[:-1])


def entropy_signal(hidden: torch.Tensor, last_hidden: torch.Tensor, entropy: torch.Tensor, tau: float) -> torch.Tensor:
    """``E_i = (1 - cos(h_i, h_i^L) + tau) * H_i`` for ``[B, L, d]`` hidden states, float64 ``[B, L]``."""
    batch, length, _ = hidden.shape
    out = torch.empty(batch, length, dtype=F64)
    for b in range(batch):
        for i in range(length):
            x, y = hidden[b, i].to(F64), last_hidden[b, i].to(F64)
            cosine = float(x @ y) / (float(x.norm()) * float(y.norm()))
            out[b, i] = (1.0 - cosine + tau) * float(entropy[b, i])
    return out


@torch.no_grad()
def forward_influence(model: torch.nn.Module, input_ids: torch.Tensor, positions: list[int],
                      horizon: int) -> torch.Tensor:
    """InfoKV eq. 3 by brute force: for each position, one full forward over the whole sequence with a 4-D mask in
    which the last ``horizon`` rows do not see that position; mean ``KL(p_t || p'_t)`` over those rows, float64."""
    ids = input_ids.reshape(1, -1)
    total = ids.shape[1]
    context = total - horizon
    causal = torch.ones(total, total, dtype=torch.bool).tril()[None, None]

    def log_probs(mask: torch.Tensor) -> torch.Tensor:
        return model(ids, attention_mask=mask).logits[0, context:].to(F64).log_softmax(-1)

    reference = log_probs(causal)
    out = torch.empty(len(positions), dtype=F64)
    for n, position in enumerate(positions):
        mask = causal.clone()
        mask[0, 0, context:, position] = False
        ablated = log_probs(mask)
        kl = [float((reference[t].exp() * (reference[t] - ablated[t])).sum()) for t in range(horizon)]
        out[n] = sum(kl) / horizon
    return out


# --------------------------------------------------------------------------------------------------------------
# One layer's cache under a policy, step by step
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Entry:
    position: int
    key: torch.Tensor
    value: torch.Tensor
    attention: float = 0.0  # H2O: attention received so far
    signal: float = math.nan  # InfoKV / bounded: D * H of the token


@dataclass
class PolicyOracle:
    """One attention layer's cache under cache policy ``name`` (knobs as in `flexentropy.policies`), one forward at a
    time, queries handed over after the keys (as flexentropy's HF attention does), signals after both.

    ``heads[b][h]`` is the list of stored `Entry` of KV head ``h`` of batch row ``b``, in position order.
    """

    name: str
    knobs: dict
    layer_idx: int = 0
    num_layers: int = 1
    heads: list = field(default_factory=list)
    queries: list = field(default_factory=list)  # (position, [B, Hq, D]) of every handed-over query
    seen: int = 0
    prompt_length: int | None = None
    evictions: int = 0

    def knob(self, key: str, default: object) -> object:
        return self.knobs.get(key, default)

    # -- scoring -------------------------------------------------------------------------------------------------
    def _stored(self, b: int, h: int) -> list[Entry]:
        return self.heads[b][h]

    def _window_scores(self, window: int, pool: int) -> list[list[list[float]]]:
        """Per ``[b][h]``: mean softmax attention of the last ``window`` queries (and the group's heads), pooled."""
        last = self.queries[-window:]
        q = torch.stack([x for _, x in last], dim=2)                     # [B, Hq, W, D]
        q_pos = torch.tensor([p for p, _ in last])
        out = []
        for b in range(len(self.heads)):
            row = []
            for h in range(len(self.heads[b])):
                entries = self._stored(b, h)
                keys = torch.stack([e.key for e in entries])[None, None]    # [1, 1, S, D]
                group = q.shape[1] // len(self.heads[b])
                qh = q[b : b + 1, h * group : (h + 1) * group]              # [1, G, W, D]
                positions = torch.tensor([e.position for e in entries])
                scores = ref_cache.window_attention_scores(qh, keys, q_pos, positions)[0, 0]
                row.append(ref_cache.pool_scores(scores, pool).tolist())
            out.append(row)
        return out

    def _fused(self, window: int, alpha: float) -> list[list[list[float]]]:
        attention = self._window_scores(window, 1)
        if alpha >= 1.0:
            return attention
        out = []
        for b, row in enumerate(attention):
            fused_row = []
            for h, scores in enumerate(row):
                signals = [e.signal for e in self._stored(b, h)]
                peak = max(signals)
                weights = [math.exp(s - peak) for s in signals]
                total = sum(weights)
                fused_row.append([alpha * a + (1 - alpha) * w / total for a, w in zip(scores, weights, strict=True)])
            out.append(fused_row)
        return out

    def _keep(self, scores: list, budget: int, forced: list) -> None:
        """Per head: the forced entries, then the best by score (ties to the lower index), ``budget`` in all."""
        for b in range(len(self.heads)):
            for h in range(len(self.heads[b])):
                entries = self._stored(b, h)
                ranked = sorted(range(len(entries)),
                                key=lambda j: (not forced[b][h][j], -scores[b][h][j], j))  # noqa: B023
                self.heads[b][h] = [entries[j] for j in sorted(ranked[:budget])]
        self.evictions += 1

    def _forced_by(self, rule) -> list:
        return [[[rule(e) for e in self._stored(b, h)] for h in range(len(self.heads[b]))]
                for b in range(len(self.heads))]

    # -- the rules -----------------------------------------------------------------------------------------------
    def _stored_count(self) -> int:
        return len(self.heads[0][0])

    def _before_append(self, incoming: int) -> None:
        name, stored = self.name, self._stored_count()
        if self.prompt_length is None:
            return
        if name == "streamingllm":
            budget, sinks = self.knob("budget", 4096), self.knob("sinks", 4)
            if stored + incoming > budget:
                recent = budget - incoming - sinks
                self._keep(self._forced_by(lambda e: 0.0), budget - incoming,
                           self._forced_by(lambda e: e.position < sinks or e.position >= self.seen - recent))
        elif name == "h2o":
            budget = self.knob("budget", 1024)
            recent = self.knob("recent", None) or budget // 2
            if stored + incoming > budget:
                self._keep(self._forced_by(lambda e: e.attention), budget - incoming,
                           self._forced_by(lambda e: e.position >= self.seen + incoming - recent))
        elif name == "bounded" and stored + incoming > self._size():
            self._slide(incoming)

    def _size(self) -> int:
        return self.knob("sinks", 4) + self.knob("anchors", 256) + self.knob("recent", 256)

    def _slide(self, incoming: int) -> None:
        """Bounded: the recent window starts at the smallest multiple of ``chunk`` leaving at most ``recent`` tokens
        (with the incoming ones) after it; the anchors are the best others by the fused score."""
        sinks, anchors, recent, chunk = (self.knob("sinks", 4), self.knob("anchors", 256), self.knob("recent", 256),
                                         self.knob("chunk", 64))
        total = self.seen + incoming
        start = sinks
        while total - start > recent:
            start += 1
        while start % chunk:
            start += 1
        start = min(max(start, sinks), self.seen)
        scores = self._fused(self.knob("window", 32), self.knob("alpha", 0.9))
        forced = self._forced_by(lambda e: e.position < sinks or e.position >= start)
        fixed = sum(forced[0][0])
        self._keep(scores, fixed + min(anchors, self._stored_count() - fixed), forced)

    def _settled(self) -> None:
        name, stored = self.name, self._stored_count()
        own_window = self._forced_by(lambda e: e.position >= self.queries[-min(len(self.queries), self.knob(
            "window", 64 if name in ("snapkv", "adakv", "pyramidkv", "infokv") else 32))][0])
        if name in ("snapkv", "pyramidkv", "adakv"):
            window, pool = self.knob("window", 64), self.knob("pool", 5)
            budget = self.knob("budget", 1024)
            if name == "pyramidkv":
                budgets = pyramid_budgets(budget, window, self.num_layers, self.knob("beta", 20.0), self.prompt_length)
                budget = max(budgets[self.layer_idx], window)
            if self.evictions or self.seen != self.prompt_length or stored <= budget:
                return
            scores = self._window_scores(window, pool)
            if name != "adakv":
                self._keep(scores, budget, own_window)
                return
            kept = adakv_keep(torch.tensor(scores, dtype=F64), budget, window, self.knob("safeguard", 0.2))
            self.heads = [[[self.heads[b][h][j] for j in kept[b][h]] for h in range(len(self.heads[b]))]
                          for b in range(len(self.heads))]
            self.evictions += 1
        elif name == "streamingllm":
            budget, sinks = self.knob("budget", 4096), self.knob("sinks", 4)
            if stored > budget:
                self._keep(self._forced_by(lambda e: 0.0), budget,
                           self._forced_by(lambda e: e.position < sinks or e.position >= self.seen - (budget - sinks)))
        elif name == "h2o":
            budget = self.knob("budget", 1024)
            recent = self.knob("recent", None) or budget // 2
            if stored > budget:
                self._keep(self._forced_by(lambda e: e.attention), budget,
                           self._forced_by(lambda e: e.position >= self.seen - recent))
        elif name == "infokv":
            budget, every = self.knob("budget", 1024), self.knob("compress_every", 1024)
            first = self.evictions == 0 and self.seen == self.prompt_length and stored > budget
            if first or stored >= budget + every:
                self._keep(self._fused(self.knob("window", 64), self.knob("alpha", 0.9)), budget, own_window)
        elif name == "bounded" and stored > self._size():
            self._slide(0)

    # -- one forward ---------------------------------------------------------------------------------------------
    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, signal: torch.Tensor | None = None) -> None:
        """One forward of ``L`` tokens: ``q [B, Hq, L, D]``, ``k``/``v [B, Hkv, L, D]``, ``signal [B, L]`` (E)."""
        batch, kv_heads, length = k.shape[:3]
        if not self.heads:
            self.heads = [[[] for _ in range(kv_heads)] for _ in range(batch)]
        self._before_append(length)
        if self.prompt_length is None:
            self.prompt_length = length
        for b in range(batch):
            for h in range(kv_heads):
                for i in range(length):
                    self.heads[b][h].append(Entry(self.seen + i, k[b, h, i].to(F64), v[b, h, i].to(F64)))
        for i in range(length):
            self.queries.append((self.seen + i, q[:, :, i].to(F64)))
        if self.name == "h2o":
            self._accumulate(q, self.seen)
        self.seen += length
        if signal is not None:
            for b in range(batch):
                for h in range(kv_heads):
                    for e in self.heads[b][h]:
                        if e.position >= self.seen - length:
                            e.signal = float(signal[b, e.position - (self.seen - length)])
        self._settled()

    def _accumulate(self, q: torch.Tensor, first: int) -> None:
        """H2O: add each query's softmax attention (every query head of the group) to the entries it sees."""
        batch, q_heads, length, dim = q.shape
        group = q_heads // len(self.heads[0])
        for b in range(batch):
            for h in range(len(self.heads[b])):
                entries = self.heads[b][h]
                for g in range(group):
                    for i in range(length):
                        query = q[b, h * group + g, i].to(F64)
                        seen = [e for e in entries if e.position <= first + i]
                        logits = [float(query @ e.key) / math.sqrt(dim) for e in seen]
                        peak = max(logits)
                        weights = [math.exp(x - peak) for x in logits]
                        total = sum(weights)
                        for e, w in zip(seen, weights, strict=True):
                            e.attention += w / total

    # -- views ---------------------------------------------------------------------------------------------------
    def positions(self) -> list[list[list[int]]]:
        return [[[e.position for e in head] for head in row] for row in self.heads]

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """Float64 attention of the last ``L`` tokens' queries ``[B, Hq, L, D]`` over every stored entry (causal)."""
        batch, q_heads, length, dim = q.shape
        group = q_heads // len(self.heads[0])
        out = torch.zeros(batch, q_heads, length, self.heads[0][0][0].value.shape[-1], dtype=F64)
        for b in range(batch):
            for hq in range(q_heads):
                for i in range(length):
                    position = self.seen - length + i
                    seen = [e for e in self.heads[b][hq // group] if e.position <= position]
                    logits = torch.tensor([float(q[b, hq, i].to(F64) @ e.key) / math.sqrt(dim) for e in seen],
                                          dtype=F64)
                    weights = logits.softmax(-1)
                    out[b, hq, i] = sum(w * e.value for w, e in zip(weights, seen, strict=True))
        return out
