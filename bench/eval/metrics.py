"""Scores of a reply against its reference strings (RULER's string match) and their uncertainty."""

from __future__ import annotations

import math
from collections.abc import Sequence


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """Share of ``answers`` found in ``prediction``, case-insensitive (RULER's ``string_match_all``).

    1.0 when every reference string occurs; 0.5 when half do. Empty ``answers`` (nothing to score) gives NaN.
    """
    if not answers:
        return math.nan
    return sum(value_hits(prediction, answers)) / len(answers)


def value_hits(prediction: str, answers: Sequence[str]) -> list[bool]:
    """Whether each of ``answers`` occurs in ``prediction``, case-insensitive (each value scored on its own)."""
    text = prediction.lower()
    return [answer.lower() in text for answer in answers]


def key_value_hits(prediction: str, pairs: Sequence[tuple[str, str]]) -> list[bool]:
    """Whether each ``(key, value)`` of ``pairs`` is written bound to its key: on a line of ``prediction`` that holds
    the value, the nearest of the pairs' keys before it is its own (case-insensitive). ``key: value`` lines, or
    ``key: value`` items on one line, score; a value under a wrong key, or with no key before it, does not."""
    keys = [key.lower() for key, _ in pairs]
    hits = [False] * len(pairs)
    for line in prediction.lower().splitlines():
        for i, (_, value) in enumerate(pairs):
            at = line.find(value.lower())
            if at >= 0:
                place, nearest = max((line.rfind(key, 0, at), key) for key in keys)
                hits[i] |= place >= 0 and nearest == keys[i]
    return hits


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any of ``answers`` occurs in ``prediction`` (case-insensitive), else 0.0; NaN without answers."""
    if not answers:
        return math.nan
    text = prediction.lower()
    return float(any(answer.lower() in text for answer in answers))


def wilson_interval(successes: float, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% for ``z = 1.96``); ``(0, 1)`` without trials.

    ``successes`` may be fractional (a sum of partial scores): the interval is then an approximation.
    """
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    denom = 1 + z**2 / trials
    centre = (p + z**2 / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z**2 / (4 * trials**2)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def common_prefix_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens two generations share (how long a greedy run tracks the dense one)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation of two equally long sequences (ordinal ranks; NaN for fewer than 2 values)."""
    if len(x) != len(y):
        raise ValueError(f"spearman needs sequences of the same length, got {len(x)} and {len(y)}")
    if len(x) < 2:
        return math.nan

    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(x), ranks(y)
    mean = (len(x) - 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry, strict=True))
    var = sum((a - mean) ** 2 for a in rx)
    return cov / var
