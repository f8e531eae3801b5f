"""Whether speculation still pays when B rows share one batched forward, from the calibrated cost curves.

A batched tick of B rows that each verify `cap + 1` tokens is one forward of B·(cap + 1) tokens: on a
compute-bound device that costs about what one row's forward of that many tokens costs (the calibrated
verify curve, extrapolated past its widths), while plain batched decoding pays a forward of B tokens for
B tokens. Drafting runs per row. So speculation that wins alone can lose at high width, where the verify
curve has turned linear: then the rows take plain batched steps (lossless either way).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from mlx_dspark.domain.costmodel.curves import CostCurves, expected_tokens


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


def batch_tick_seconds(curves: CostCurves, width: int, cap: int, depth: int = 0) -> float:
    """Seconds of one tick: drafting each row, one forward of width·(cap + 1) tokens, per-row context cost."""
    rows = max(width, 1)
    return (
        rows * curves.draft(cap)
        + curves.verify(rows * (cap + 1))
        + rows * curves.slope_s_per_token * depth
        + curves.overhead_s
    )


def batch_rate(curves: CostCurves, width: int, cap: int, acceptance: Sequence[float], depth: int = 0) -> float:
    """Expected aggregate tokens per second of `width` rows at `cap` (0 = plain batched decoding)."""
    seconds = batch_tick_seconds(curves, width, cap, depth)
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
) -> BatchPlan:
    """The best cap for `width` rows; speculation must beat plain batched steps by `margin` to be chosen.

    Args:
        curves: this machine's calibrated curves for (target, drafter).
        acceptance: per-position conditional acceptance (the batch's observed estimate).
        width: rows in the batched forward.
        max_cap: the drafter's block (or the user's cap).
        depth: typical context depth of the rows.
        margin: the fraction speculation must win by (rates are estimates; a flapping decision costs).
    """
    plain = batch_rate(curves, width, 0, acceptance, depth)
    best, best_rate = 0, 0.0
    for cap in range(1, max_cap + 1):
        rate = batch_rate(curves, width, cap, acceptance, depth)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = cap, rate
    if best and best_rate > plain * (1 + margin):
        return BatchPlan(width=width, cap=best, plain_tok_s=plain, speculative_tok_s=best_rate)
    return BatchPlan(width=width, cap=0, plain_tok_s=plain, speculative_tok_s=best_rate)
