"""Where things sit in a diagnosed prompt (`bench.eval.diagnose`): the needles' and the question's tokens, the
prompt's layout against the geometry, and whether a plan's selection keeps the needle's key blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bench.eval.tasks import Sample
from flexentropy.config import Q_BLOCK_SIZE, EntropyConfig
from flexentropy.policies.prefill.fixed import dense_segments


def find_tokens(ids: torch.Tensor, pattern: list[int], last: bool = False) -> int:
    """Position of the first (``last``: the last) occurrence of ``pattern`` in ``ids`` (int64 ``[N]``).

    Raises:
        ValueError: not found.
    """
    m = len(pattern)
    if m == 0 or m > ids.numel():
        raise ValueError(f"cannot look for a pattern of {m} tokens in {ids.numel()}")
    hits = (ids.unfold(0, m, 1) == torch.tensor(pattern, dtype=ids.dtype)).all(dim=-1).nonzero().flatten()
    if hits.numel() == 0:
        raise ValueError("pattern not found in the prompt's tokens")
    return int(hits[-1] if last else hits[0])


def locate(tokenizer: Any, ids: torch.Tensor, text: str, last: bool = False) -> tuple[int, int]:
    """Token span ``(start, stop)`` of ``text`` inside running text in the prompt ``ids`` (``last``: its last
    occurrence). The encoding of ``" " + text`` is searched without its first and last token, which may merge with
    their neighbours in the prompt; the span is then widened by one token on each side, so it holds all of ``text``
    (and at most one neighbouring token on each side)."""
    pattern = list(tokenizer(" " + text, add_special_tokens=False)["input_ids"])
    if len(pattern) <= 3:
        start = find_tokens(ids, pattern, last)
        return start, start + len(pattern)
    start = find_tokens(ids, pattern[1:-1], last)
    return max(start - 1, 0), min(start + len(pattern) - 1, ids.numel())


@dataclass(frozen=True)
class Layout:
    """Token positions in one prompt of ``seq_len`` tokens.

    Attributes:
        needles: ``(start, stop)`` token spans of the asked facts (the needles), in prompt order.
        question: first token of the question (the question, the chat template's end and the answer prefix follow).
    """

    seq_len: int
    needles: tuple[tuple[int, int], ...]
    question: int

    @classmethod
    def of_sample(cls, tokenizer: Any, sample: Sample, ids: list[int]) -> Layout:
        """Locate the asked facts and the question of ``sample`` in its prompt ``ids`` (placement "outside")."""
        tokens = torch.tensor(ids)
        asked = set(sample.meta.get("asked", ()))
        facts = [f for f in sample.meta.get("facts", ()) if not asked or any(f" {key} is:" in f for key in asked)]
        if not facts:
            raise ValueError(f"{sample.task} sample {sample.index} plants no facts to locate (niah and vt tasks do)")
        spans = tuple(sorted(locate(tokenizer, tokens, fact) for fact in facts))
        return cls(len(ids), spans, locate(tokenizer, tokens, sample.question, last=True)[0])

    def needle_blocks(self, block_size: int) -> list[int]:
        """Key blocks holding a needle token, ascending."""
        return sorted({j for start, stop in self.needles for j in range(start // block_size,
                                                                         (stop - 1) // block_size + 1)})

    def region(self, name: str) -> torch.Tensor:
        """bool ``[C_Q]``: the query blocks of region ``name`` (`REGIONS`)."""
        qb = torch.arange(-(-self.seq_len // Q_BLOCK_SIZE))
        first_needle, question = self.needles[0][0] // Q_BLOCK_SIZE, self.question // Q_BLOCK_SIZE
        return {"none": torch.zeros_like(qb, dtype=torch.bool), "all": torch.ones_like(qb, dtype=torch.bool),
                "question": qb >= question, "after_needle": (qb >= first_needle) & (qb < question),
                "before_needle": qb < first_needle}[name]

    def tail_start(self, config: EntropyConfig) -> int:
        """First query of the tail: the last segment's or the question's, whichever comes first."""
        last_segment = (self.seq_len - 1) // config.segment_size * config.segment_size
        return min(last_segment, self.question)

    def describe(self, config: EntropyConfig) -> dict[str, Any]:
        """What the geometry does to this prompt: segments, the dense ones, the question's and needles' places."""
        segments = -(-self.seq_len // config.segment_size)
        dense = dense_segments(self.seq_len, config)
        dense_tokens = dense.repeat_interleave(config.segment_size)[:self.seq_len]
        segment_of = [self.question // config.segment_size, (self.seq_len - 1) // config.segment_size]
        return {
            "tokens": self.seq_len,
            "segments": segments,
            "dense_segments": int(dense.sum()),
            "last_segment_tokens": self.seq_len - (segments - 1) * config.segment_size,
            "question_start": self.question,
            "question_tokens": self.seq_len - self.question,
            "question_segments": list(range(segment_of[0], segment_of[1] + 1)),
            "question_query_blocks": (self.seq_len - 1) // Q_BLOCK_SIZE - self.question // Q_BLOCK_SIZE + 1,
            "question_dense_share": float(dense_tokens[self.question:].float().mean()),
            "needles": [list(span) for span in self.needles],
            "needle_depths": [round(start / self.seq_len, 4) for start, _ in self.needles],
            "needles_in_dense_prefix": [start < config.dense_prefix for start, _ in self.needles],
        }


def needle_selection(blocks: torch.Tensor, a_obs: torch.Tensor, budgets: torch.Tensor | None, layout: Layout,
                     config: EntropyConfig) -> dict[str, Any]:
    """How one layer's selection treats the needle's key blocks, for one batch row.

    Args:
        blocks: bool ``[Hq, C_Q, C_B]`` the row's block table. a_obs: float32 ``[Hq, C_S, C_B]`` observation scores.
        budgets: float32 ``[Hq, C_S]`` token budgets, or None (policies without budgets).

    Returns:
        ``kept``: share of (head, sparse segment that starts after a needle block, needle block) triples whose
        selection holds the block (None when no sparse segment follows a needle); ``kept_by_head`` ``[Hq]`` and
        ``kept_by_segment`` ``[C_S]`` (None where a segment has no such pair); ``kept_question``: share of (head,
        question query block, needle block) that attend the needle block; ``rank_median``/``rank_p90``: the needle
        block's rank among the segment's candidates by score (0 = best); ``k_median``: blocks the budget allows.
    """
    heads, segments = a_obs.shape[:2]
    needle = torch.tensor(layout.needle_blocks(config.block_size), device=blocks.device)
    first_qb = torch.arange(segments, device=blocks.device) * (config.segment_size // Q_BLOCK_SIZE)
    starts = torch.arange(segments, device=blocks.device) * config.segment_size
    sparse = ~dense_segments(layout.seq_len, config, blocks.device)
    pairs = sparse[:, None] & (starts[:, None] >= (needle[None, :] + 1) * config.block_size)   # [C_S, m]
    held = blocks[:, first_qb][..., needle] & pairs                                           # [Hq, C_S, m]
    question = layout.region("question").to(blocks.device)
    out: dict[str, Any] = {"kept_question": float(blocks[:, question][..., needle].float().mean())}
    count = int(pairs.sum())
    if count == 0:
        return {**out, "kept": None, "kept_by_head": None, "kept_by_segment": None, "rank_median": None,
                "rank_p90": None, "k_median": None}
    per_segment = pairs.sum(dim=-1)
    by_segment = held.sum(dim=(0, 2)).float() / (heads * per_segment.clamp_min(1))
    scores = a_obs[..., needle]                                                               # [Hq, C_S, m]
    rank = (a_obs[..., None, :] > scores[..., None]).sum(dim=-1)                              # [Hq, C_S, m]
    ranks = rank[pairs.expand_as(rank)].float()
    out |= {
        "kept": float(held.sum()) / (heads * count),
        "kept_by_head": [round(float(x), 4) for x in held.sum(dim=(1, 2)).float() / count],
        "kept_by_segment": [round(float(x), 4) if n else None for x, n in zip(by_segment, per_segment, strict=True)],
        "rank_median": float(ranks.median()),
        "rank_p90": round(float(ranks.quantile(0.9)), 1),
        "k_median": None,
    }
    if budgets is not None:
        k = torch.floor(budgets / config.block_size)[:, pairs.any(dim=-1)]
        out["k_median"] = float(k.median())
    return out
