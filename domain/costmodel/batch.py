"""Whether speculation still pays when B rows share one batched forward, from the calibrated cost curves.

A batched tick of B rows that each verify `cap + 1` tokens is one forward of B·(cap + 1) tokens: on a
compute-bound device that costs about what one row's forward of that many tokens costs (the calibrated
verify curve, extrapolated past its widths), while plain batched decoding pays a forward of B tokens for
B tokens. Drafting costs one row's calibrated draft per row, unless the rows draft together (greedy rows of
a drafter that batches): then it costs what batched drafting was measured to cost at that width
(`BatchDraftCost`). So speculation that wins alone can lose at high width, where the verify curve has turned
linear: then the rows take plain batched steps (lossless either way). What whole batched ticks really take,
by token count, corrects the model as the batch runs.
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


@attrs.define
class TickCorrection:
    """Observed ÷ predicted seconds of whole batched ticks, per (width, cap), as EWMAs.

    Keyed by what the plan compares: at one width, plain ticks against each cap. (A key by token count alone
    mixes 8 rows of one token with 4 rows of two, which cost differently.) A cap never observed at its width
    takes the ratios of the observed caps around it (linear in between, the nearest one outside them); a width
    never observed takes the nearest observed width's. So one observation rescales its whole width uniformly
    and changes no decision by itself.
    """

    alpha: float = 0.2
    ratios: dict[tuple[int, int], float] = attrs.Factory(dict)

    def record(self, width: int, cap: int, observed_s: float, predicted_s: float) -> None:
        if predicted_s <= 0 or observed_s <= 0:
            return
        ratio = observed_s / predicted_s
        old = self.ratios.get((width, cap))
        self.ratios[(width, cap)] = ratio if old is None else old + self.alpha * (ratio - old)

    def factor(self, width: int, cap: int) -> float:
        if not self.ratios:
            return 1.0
        near = min({w for w, _ in self.ratios}, key=lambda w: (abs(w - width), w))
        caps = sorted(c for w, c in self.ratios if w == near)
        if cap <= caps[0] or cap >= caps[-1]:
            return self.ratios[(near, caps[0] if cap <= caps[0] else caps[-1])]
        hi = next(c for c in caps if c > cap)
        lo = max(c for c in caps if c <= cap)
        t = (cap - lo) / (hi - lo)
        return self.ratios[(near, lo)] + t * (self.ratios[(near, hi)] - self.ratios[(near, lo)])


@attrs.define
class BatchDraftCost:
    """Seconds of drafting several rows together, in units of one row's calibrated draft: per width, an EWMA of
    observed ÷ calibrated seconds.

    A width never measured scales the nearest measured one in proportion to its rows, kept between one row's
    cost and one draft per row; with nothing measured, rows cost one draft each (as if drafting alone).
    """

    alpha: float = 0.3
    ratios: dict[int, float] = attrs.Factory(dict)

    def record(self, width: int, observed_s: float, one_row_s: float) -> None:
        if width < 1 or observed_s <= 0 or one_row_s <= 0:
            return
        ratio = observed_s / one_row_s
        old = self.ratios.get(width)
        self.ratios[width] = ratio if old is None else old + self.alpha * (ratio - old)

    def rows(self, width: int) -> float:
        """Drafting `width` rows together, in one-row drafts."""
        if width <= 1 or not self.ratios:
            return float(max(width, 0))
        if width in self.ratios:
            return self.ratios[width]
        near = min(self.ratios, key=lambda w: (abs(w - width), w))
        return min(float(width), max(1.0, self.ratios[near] * width / near))


def batch_tick_seconds(
    curves: CostCurves,
    width: int,
    cap: int,
    depth: int = 0,
    correction: TickCorrection | None = None,
    draft_rows: float | None = None,
) -> float:
    """Seconds of one tick: the rows' drafting, one forward of width·(cap + 1) tokens, per-row context cost.

    `draft_rows` is the tick's drafting in one-row drafts (None: one per row, each drafting alone).
    `correction` rescales the whole tick by what ticks of this width and cap really took (observed ÷ this
    prediction without it): calibration times one row's forward and draft, while a batched tick also pays
    every row's attention and host work around them, and a busy machine or a wide batch can differ a lot.
    """
    rows = max(width, 1)
    tokens = rows * (cap + 1)
    drafts = rows if draft_rows is None else draft_rows
    seconds = drafts * curves.draft(cap) + forward_seconds(curves, tokens) + rows * curves.slope_s_per_token * depth
    seconds += curves.overhead_s
    return seconds * (correction.factor(width, cap) if correction is not None else 1.0)


def batch_rate(
    curves: CostCurves,
    width: int,
    cap: int,
    acceptance: Sequence[float],
    depth: int = 0,
    correction: TickCorrection | None = None,
    draft_rows: float | None = None,
) -> float:
    """Expected aggregate tokens per second of `width` rows at `cap` (0 = plain batched decoding)."""
    seconds = batch_tick_seconds(curves, width, cap, depth, correction, draft_rows)
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
    correction: TickCorrection | None = None,
    draft_rows: float | None = None,
    cap_acceptance: Sequence[float] | None = None,
) -> BatchPlan:
    """The best cap for `width` rows; speculation must beat plain batched steps by `margin` to be chosen.

    Args:
        curves: this machine's calibrated curves for (target, drafter).
        acceptance: per-position conditional acceptance (the batch's observed estimate).
        width: rows in the batched forward.
        max_cap: the drafter's block (or the user's cap).
        depth: typical context depth of the rows.
        margin: the fraction speculation must win by (rates are estimates; a flapping decision costs).
        correction: observed ÷ predicted seconds of whole batched ticks by width and cap (None: as calibrated).
        draft_rows: the rows' drafting in one-row drafts (None: each row drafts alone).
        cap_acceptance: a less cautious estimate (the pooled one itself) that picks the cap once `acceptance`
            says speculation pays, among caps up to one past the best cap under `acceptance`. Positions past
            the cap in use are never verified, so a cautious estimate alone never learns that they pay: the
            cap would stay where the first noisy ticks left it.
    """

    def rate(cap: int, estimate: Sequence[float]) -> float:
        return batch_rate(curves, width, cap, estimate, depth, correction, draft_rows)

    def best_cap(caps: range, estimate: Sequence[float]) -> tuple[int, float]:
        best, best_rate = 0, 0.0
        for cap in caps:
            r = rate(cap, estimate)
            if r > best_rate * (1 + 1e-9):
                best, best_rate = cap, r
        return best, best_rate

    plain = rate(0, acceptance)
    best, best_rate = best_cap(range(1, max_cap + 1), acceptance)
    if not best or best_rate <= plain * (1 + margin):
        return BatchPlan(width=width, cap=0, plain_tok_s=plain, speculative_tok_s=best_rate)
    if cap_acceptance is not None:
        best, best_rate = best_cap(range(1, min(max_cap, best + 1) + 1), cap_acceptance)
    return BatchPlan(width=width, cap=best, plain_tok_s=plain, speculative_tok_s=best_rate)
