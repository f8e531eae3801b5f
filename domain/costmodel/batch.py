"""Whether speculation still pays when B rows share one batched forward, from the calibrated cost curves.

A batched tick of B rows that each verify `cap + 1` tokens is one forward of B·(cap + 1) tokens: on a
compute-bound device that costs about what one row's forward of that many tokens costs (the calibrated
verify curve, extrapolated past its widths), while plain batched decoding pays a forward of B tokens for
B tokens. Drafting runs per row. So speculation that wins alone can lose at high width, where the verify
curve has turned linear: then the rows take plain batched steps (lossless either way). What whole batched
ticks really take, by token count, corrects the model as the batch runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from mlx_dspark.domain.costmodel.curves import CostCurves, expected_tokens
from mlx_dspark.domain.costmodel.draft_cap import RoundTimeCorrection


@attrs.frozen(kw_only=True)
class BatchPlan:
    """The decision for one batch width.

    Attributes:
        width: rows in the batched forward.
        cap: drafts per row (0 = plain batched steps).
        plain_tok_s: expected aggregate tok/s of plain batched steps at this width.
        speculative_tok_s: expected aggregate tok/s at the best cap > 0 (0.0 when no cap was possible).
    """

    width: int
    cap: int
    plain_tok_s: float
    speculative_tok_s: float

    @property
    def speculate(self) -> bool:
        return self.cap > 0


def forward_seconds(curves: CostCurves, tokens: int) -> float:
    """One forward of `tokens` tokens: the verify curve where it was measured; past its widest point, the
    least-squares line through all its points (slope clamped at 0), never below the widest measured cost.

    Calibration measures a few widths on a busy machine, so the last two points alone (plain linear
    extrapolation) can slope down and promise free wide forwards; the fit over every point does not.
    """
    points = curves.verify_s
    if not points or tokens <= max(points):
        return curves.verify(tokens)
    xs = sorted(points)
    widest = points[xs[-1]]
    if len(xs) == 1:
        return widest * tokens / max(xs[0], 1)
    mean_x = sum(xs) / len(xs)
    mean_y = sum(points[x] for x in xs) / len(xs)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, sum((x - mean_x) * (points[x] - mean_y) for x in xs) / spread)
    return max(widest, mean_y + slope * (tokens - mean_x))


def batch_tick_seconds(
    curves: CostCurves, width: int, cap: int, depth: int = 0, correction: RoundTimeCorrection | None = None
) -> float:
    """Seconds of one tick: drafting each row, one forward of width·(cap + 1) tokens, per-row context cost.

    `correction` rescales the whole tick by what ticks of each token count really took (observed ÷ this
    prediction without it): calibration times one row's forward and draft, while a batched tick also pays
    every row's host work around them, and a busy machine or a wide batch can differ a lot.
    """
    rows = max(width, 1)
    tokens = rows * (cap + 1)
    seconds = rows * curves.draft(cap) + forward_seconds(curves, tokens) + rows * curves.slope_s_per_token * depth
    seconds += curves.overhead_s
    return seconds * (correction.factor(tokens) if correction is not None else 1.0)


def batch_rate(
    curves: CostCurves,
    width: int,
    cap: int,
    acceptance: Sequence[float],
    depth: int = 0,
    correction: RoundTimeCorrection | None = None,
) -> float:
    """Expected aggregate tokens per second of `width` rows at `cap` (0 = plain batched decoding)."""
    seconds = batch_tick_seconds(curves, width, cap, depth, correction)
    if seconds <= 0:
        return float("inf")
    return max(width, 1) * expected_tokens(cap, acceptance) / seconds


def plan_batch(
    curves: CostCurves,
    acceptance: Sequence[float],
    width: int,
    max_cap: int,
    *,
    depth: int = 0,
    margin: float = 0.05,
    correction: RoundTimeCorrection | None = None,
) -> BatchPlan:
    """The best cap for `width` rows; speculation must beat plain batched steps by `margin` to be chosen.

    Args:
        curves: this machine's calibrated curves for (target, drafter).
        acceptance: per-position conditional acceptance (the batch's observed estimate).
        width: rows in the batched forward.
        max_cap: the drafter's block (or the user's cap).
        depth: typical context depth of the rows.
        margin: the fraction speculation must win by (rates are estimates; a flapping decision costs).
        correction: observed ÷ predicted seconds of whole batched ticks by token count (None: as calibrated).
    """
    plain = batch_rate(curves, width, 0, acceptance, depth, correction)
    best, best_rate = 0, 0.0
    for cap in range(1, max_cap + 1):
        rate = batch_rate(curves, width, cap, acceptance, depth, correction)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = cap, rate
    if best and best_rate > plain * (1 + margin):
        return BatchPlan(width=width, cap=best, plain_tok_s=plain, speculative_tok_s=best_rate)
    return BatchPlan(width=width, cap=0, plain_tok_s=plain, speculative_tok_s=best_rate)
