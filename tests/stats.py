"""Small statistics helpers for exactness tests (no scipy dependency)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series / continued fraction, Numerical Recipes style)."""
    if x <= 0:
        return 1.0
    gln = math.lgamma(a)
    if x < a + 1:
        ap, total, delta = a, 1.0 / a, 1.0 / a
        for _ in range(1000):
            ap += 1
            delta *= x / ap
            total += delta
            if abs(delta) < abs(total) * 1e-14:
                break
        return 1.0 - total * math.exp(-x + a * math.log(x) - gln)
    b = x + 1 - a
    c = 1.0 / 1e-300
    d = 1.0 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-14:
            break
    return math.exp(-x + a * math.log(x) - gln) * h


def chi_square_p_value(observed: Sequence[int], expected_probs: Sequence[float]) -> float:
    """p-value of Pearson's chi-square goodness of fit; bins with zero expected mass must be empty."""
    n = sum(observed)
    stat, dof = 0.0, -1
    for o, p in zip(observed, expected_probs, strict=True):
        if p <= 0:
            assert o == 0, "a sample landed where the target has no mass"
            continue
        e = n * p
        stat += (o - e) ** 2 / e
        dof += 1
    return _gamma_q(dof / 2, stat / 2) if dof > 0 else 1.0
