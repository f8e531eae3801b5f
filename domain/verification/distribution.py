"""Reference construction of a sampling distribution from logits: temperature, top-k, then top-p."""

from __future__ import annotations

import math
from collections.abc import Sequence

from mlx_dspark.domain.tokens import SamplingParams


def argmax(row: Sequence[float]) -> int:
    """Index of the largest value; the lowest index wins ties (matches mx.argmax)."""
    best, best_i = -math.inf, 0
    for i, v in enumerate(row):
        if v > best:
            best, best_i = v, i
    return best_i


def distribution(logits: Sequence[float], sampling: SamplingParams) -> list[float]:
    """The normalized distribution that `sampling` draws from, given raw logits.

    Greedy sampling gives the one-hot argmax distribution, so one rule covers both regimes.
    """
    n = len(logits)
    if sampling.greedy:
        out = [0.0] * n
        out[argmax(logits)] = 1.0
        return out
    t = sampling.temperature
    top = max(logits)
    weights = [math.exp((v - top) / t) for v in logits]
    keep = list(range(n))
    if 0 < sampling.top_k < n:
        # Stable order: equal weights keep the lower index first, as a stable descending sort does.
        keep = sorted(range(n), key=lambda i: -weights[i])[: sampling.top_k]
    if sampling.top_p < 1.0:
        ordered = sorted(keep, key=lambda i: -weights[i])
        total = sum(weights[i] for i in ordered)
        kept: list[int] = []
        mass = 0.0
        for i in ordered:
            kept.append(i)
            mass += weights[i] / total
            if mass >= sampling.top_p:
                break
        keep = kept
    keep_set = set(keep)
    z = sum(weights[i] for i in keep_set)
    return [weights[i] / z if i in keep_set else 0.0 for i in range(n)]


def sample_index(row: Sequence[float], u: float) -> int:
    """Inverse-CDF draw from an unnormalized non-negative row with one uniform u in [0, 1)."""
    total = sum(row)
    target = u * total
    cumulative = 0.0
    last_positive = 0
    for i, w in enumerate(row):
        if w <= 0:
            continue
        cumulative += w
        last_positive = i
        if cumulative > target:
            return i
    return last_positive
