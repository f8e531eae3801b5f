"""Measured cost curves of one (device, target, drafter) and the expected throughput of each cap."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs


def _interpolate(points: Mapping[int, float], x: int) -> float:
    """Piecewise-linear through measured points, linear extrapolation past the ends."""
    if not points:
        return 0.0
    if x in points:
        return points[x]
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]] * max(x, 1) / max(xs[0], 1)
    if x < xs[0]:
        lo, hi = xs[0], xs[1]
    elif x > xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi = next(v for v in xs if v > x)
        lo = max(v for v in xs if v < x)
    slope = (points[hi] - points[lo]) / (hi - lo)
    return max(0.0, points[lo] + slope * (x - lo))


@attrs.frozen(kw_only=True)
class CostCurves:
    """Seconds per round as measured on this machine.

    Attributes:
        verify_s: target forward time by width (1 = plain decoding step).
        draft_s: draft-source time by cap (0 means no drafting and costs nothing).
        slope_s_per_token: extra verify seconds per token of context depth.
        overhead_s: fixed per-round host overhead (acceptance, bookkeeping).
    """

    verify_s: Mapping[int, float]
    draft_s: Mapping[int, float] = attrs.field(factory=dict)
    slope_s_per_token: float = 0.0
    overhead_s: float = 0.0

    def verify(self, width: int) -> float:
        return _interpolate(self.verify_s, width)

    def draft(self, cap: int) -> float:
        if cap <= 0:
            return 0.0
        return _interpolate(self.draft_s, cap)

    def round_seconds(self, cap: int, depth: int = 0) -> float:
        return self.draft(cap) + self.verify(cap + 1) + self.slope_s_per_token * depth + self.overhead_s


def expected_tokens(cap: int, acceptance: Sequence[float]) -> float:
    """E[tokens committed per round] = 1 + sum_i prod_{j<=i} a_j, a_j the conditional acceptance.

    Positions past the end of `acceptance` reuse its last value.
    """
    total, survive = 1.0, 1.0
    for i in range(cap):
        if acceptance:
            a = acceptance[min(i, len(acceptance) - 1)]
        else:
            a = 0.0
        survive *= a
        total += survive
    return total


def expected_rate(curves: CostCurves, cap: int, acceptance: Sequence[float], depth: int = 0) -> float:
    """Expected tokens per second of running at `cap` (cap 0 = plain decoding)."""
    seconds = curves.round_seconds(cap, depth)
    if seconds <= 0:
        return float("inf")
    return expected_tokens(cap, acceptance) / seconds


def best_cap(curves: CostCurves, acceptance: Sequence[float], max_cap: int, depth: int = 0) -> int:
    """The cap in 0..max_cap with the highest expected rate; ties go to the smaller cap."""
    best, best_rate = 0, expected_rate(curves, 0, acceptance, depth)
    for cap in range(1, max_cap + 1):
        rate = expected_rate(curves, cap, acceptance, depth)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = cap, rate
    return best
