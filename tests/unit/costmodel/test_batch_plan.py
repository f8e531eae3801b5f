"""The width rule: speculation that pays alone stops paying once B·(cap + 1) tokens per forward reach the
linear part of the verify curve; plain batched steps are chosen there."""

from __future__ import annotations

import pytest

from mlx_dspark.domain.costmodel.batch import (
    BatchDraftCost,
    TickCorrection,
    batch_rate,
    batch_tick_seconds,
    forward_seconds,
    plan_batch,
)
from mlx_dspark.domain.costmodel.curves import CostCurves, expected_rate

BLOCK = 7
# A CPU-like verify curve: flat up to ~8 tokens per forward (weights dominate), then linear (compute).
KNEE = CostCurves(
    verify_s={1: 0.050, 2: 0.051, 4: 0.053, 8: 0.060, 16: 0.110, 32: 0.210},
    draft_s={c: 0.001 * c for c in range(1, BLOCK + 1)},
)
FLAT = CostCurves(verify_s={1: 0.05, 64: 0.052}, draft_s={c: 0.0005 * c for c in range(1, BLOCK + 1)})


def test_a_width_of_one_agrees_with_the_single_row_model() -> None:
    for cap in range(BLOCK + 1):
        assert batch_rate(KNEE, 1, cap, [0.8]) == pytest.approx(expected_rate(KNEE, cap, [0.8]))


def test_speculation_pays_alone_and_stops_paying_at_high_width() -> None:
    plans = {w: plan_batch(KNEE, [0.8] * BLOCK, w, BLOCK) for w in (1, 2, 4, 8)}
    assert plans[1].speculate and plans[1].cap >= 3
    assert not plans[8].speculate and plans[8].cap == 0
    # The chosen cap shrinks as the width grows: each row's drafts cost more of the shared forward.
    caps = [plans[w].cap for w in (1, 2, 4, 8)]
    assert caps == sorted(caps, reverse=True)
    assert plans[8].plain_tok_s > plans[8].speculative_tok_s / 1.05


def test_a_flat_curve_keeps_speculating_at_every_width() -> None:
    for w in (1, 4, 16):
        plan = plan_batch(FLAT, [0.9] * BLOCK, w, BLOCK)
        assert plan.speculate and plan.speculative_tok_s > plan.plain_tok_s


def test_low_acceptance_never_speculates_and_the_margin_is_required() -> None:
    assert not plan_batch(FLAT, [0.0] * BLOCK, 2, BLOCK).speculate
    # Just above break-even: chosen without a margin, refused with a large one.
    curves = CostCurves(verify_s={1: 0.05, 2: 0.095})
    assert plan_batch(curves, [0.95], 1, 1, margin=0.0).speculate
    assert not plan_batch(curves, [0.95], 1, 1, margin=0.2).speculate


def test_tick_seconds_count_each_rows_draft_and_context() -> None:
    deep = CostCurves(verify_s={1: 0.05, 8: 0.06}, draft_s={2: 0.004}, slope_s_per_token=1e-6, overhead_s=0.001)
    assert batch_tick_seconds(deep, 4, 2, depth=1000) == pytest.approx(
        4 * 0.004 + forward_seconds(deep, 12) + 4e-3 + 0.001
    )
    assert plan_batch(deep, [0.9] * 2, 0, 2).width == 0  # an empty batch still gets a well-defined answer


def test_wide_forwards_past_the_calibrated_widths_follow_the_fit_not_a_noisy_last_pair() -> None:
    # Measured on a busy machine: the last point dips, so the last pair slopes down (plain extrapolation
    # would make a 72-token forward cost nothing).
    noisy = CostCurves(verify_s={1: 0.105, 2: 0.116, 4: 0.123, 6: 0.150, 7: 0.142, 8: 0.119})
    assert noisy.verify(72) == 0.0
    assert forward_seconds(noisy, 72) > 0.119 and forward_seconds(noisy, 144) > forward_seconds(noisy, 72)
    assert forward_seconds(noisy, 8) == noisy.verify(8)  # inside the measured range: the curve itself
    wide, alone = plan_batch(noisy, [0.6] * BLOCK, 8, BLOCK), plan_batch(noisy, [0.6] * BLOCK, 1, BLOCK)
    assert alone.speculate and wide.cap < alone.cap  # wide forwards cost more: fewer drafts per row
    flat = CostCurves(verify_s={1: 0.1, 8: 0.1})
    assert forward_seconds(flat, 64) == pytest.approx(0.1)  # a flat device (a GPU) stays flat


def test_observed_ticks_turn_speculation_off_and_cheap_ones_keep_it() -> None:
    curves = CostCurves(verify_s={1: 0.10, 8: 0.12}, draft_s={c: 0.001 * c for c in range(1, BLOCK + 1)})
    assert plan_batch(curves, [0.7] * BLOCK, 4, BLOCK).speculate
    slow = TickCorrection(alpha=1.0)
    plain_tick, drafting_tick = batch_tick_seconds(curves, 4, 0), batch_tick_seconds(curves, 4, 3)
    slow.record(4, 0, plain_tick, plain_tick)  # plain ticks of 4 rows: as predicted
    slow.record(4, 3, 4 * drafting_tick, drafting_tick)  # 4 rows x (1 + 3 drafts): 4x the prediction
    assert batch_tick_seconds(curves, 4, 3, correction=slow) == pytest.approx(4 * drafting_tick)
    plan = plan_batch(curves, [0.7] * BLOCK, 4, BLOCK, correction=slow)
    assert not plan.speculate
    fast = TickCorrection(alpha=1.0)
    fast.record(4, 3, drafting_tick, drafting_tick)
    assert plan_batch(curves, [0.7] * BLOCK, 4, BLOCK, correction=fast).speculate


def test_tick_corrections_are_kept_per_width_and_cap_not_per_token_count() -> None:
    c = TickCorrection(alpha=1.0)
    c.record(8, 0, 2.0, 1.0)  # 8 rows of one token: twice the prediction
    c.record(4, 1, 1.0, 1.0)  # 4 rows of two tokens (the same 8 tokens): as predicted
    assert c.factor(8, 0) == 2.0 and c.factor(4, 1) == 1.0
    assert c.factor(4, 3) == 1.0  # the nearest cap observed at its own width
    assert c.factor(7, 0) == 2.0  # else the nearest width
    c.record(4, 3, 3.0, 1.0)
    assert c.factor(4, 2) == pytest.approx(2.0)  # between observed caps: linear
    assert TickCorrection().factor(4, 2) == 1.0


def test_rows_that_draft_together_make_speculation_pay_where_drafting_alone_does_not() -> None:
    # Drafting costs 40% of a plain step per row: four rows drafting alone cost more than they win.
    curves = CostCurves(verify_s={1: 0.10, 4: 0.11, 8: 0.13, 16: 0.16}, draft_s={c: 0.04 for c in range(1, BLOCK + 1)})
    alone = plan_batch(curves, [0.6] * BLOCK, 4, BLOCK)
    together = plan_batch(curves, [0.6] * BLOCK, 4, BLOCK, draft_rows=1.6)
    assert not alone.speculate and together.speculate
    assert batch_tick_seconds(curves, 4, 2, draft_rows=1.6) == pytest.approx(1.6 * 0.04 + forward_seconds(curves, 12))


def test_batched_draft_cost_is_measured_per_width_and_scaled_to_unmeasured_ones() -> None:
    cost = BatchDraftCost(alpha=1.0)
    assert cost.rows(4) == 4.0 and cost.rows(1) == 1.0  # nothing measured: one draft per row
    cost.record(4, 0.018, 0.010)  # four rows together in 1.8 one-row drafts
    assert cost.rows(4) == pytest.approx(1.8)
    assert cost.rows(8) == pytest.approx(3.6)  # in proportion to the rows, from the nearest width
    assert cost.rows(2) == pytest.approx(1.0)  # never below one row's draft
    cost.record(2, 0.0, 0.010)  # nothing to learn from a zero time
    assert 2 not in cost.ratios


def test_the_cap_climbs_one_past_the_cautious_cap_when_the_estimate_favours_it() -> None:
    # Past 4 tokens a forward costs 5 ms per token: a draft must be taken often enough to pay for its row.
    verify = {1: 0.10, 4: 0.10, 8: 0.12, 12: 0.14, 16: 0.16, 32: 0.24}
    curves = CostCurves(verify_s=verify, draft_s={c: 0.001 for c in range(1, 8)})
    # The cautious estimate knows only the first position well (the batch never drafted past it).
    cautious, estimate = [0.6, 0.1, 0.1, 0.1], [0.65, 0.7, 0.7, 0.7]
    stuck = plan_batch(curves, cautious, 4, 4)
    climbs = plan_batch(curves, cautious, 4, 4, cap_acceptance=estimate)
    assert stuck.cap == 1 and climbs.cap == 2
    assert climbs.speculative_tok_s > climbs.plain_tok_s
    # Whether to speculate at all is still the cautious estimate's call.
    assert not plan_batch(curves, [0.0] * 4, 4, 4, cap_acceptance=estimate).speculate


def test_decayed_acceptance_tightens_with_outcomes_and_follows_a_drifting_drafter() -> None:
    from mlx_dspark.domain.costmodel.acceptance import DecayedAcceptance, EwmaAcceptance

    est, ewma = DecayedAcceptance(window=64, positions=1), EwmaAcceptance(alpha=0.2, positions=1)
    assert est.estimate() == [0.7]  # the prior alone
    for hit in [1, 0] * 40:  # a drafter whose first draft is taken half the time
        est.record(1, hit)
        ewma.record(1, hit)
    assert est.estimate()[0] == pytest.approx(0.5, abs=0.03)
    # Eighty outcomes bound it within ~0.07; an EWMA of α 0.2 weighs only about ten of them.
    assert est.estimate()[0] - est.lower()[0] < 0.08 < ewma.estimate()[0] - ewma.lower()[0]
    for _ in range(200):  # the drafter gets worse: the estimate follows within a few windows
        est.record(1, 0)
    assert est.estimate()[0] < 0.05


def test_the_lower_acceptance_bound_tightens_as_outcomes_come_in_and_stays_below_the_estimate() -> None:
    from mlx_dspark.domain.costmodel.acceptance import EwmaAcceptance

    est = EwmaAcceptance(alpha=0.2, positions=2)
    first = est.lower()
    assert all(lo < v for lo, v in zip(first, est.estimate()))
    gaps = []
    for _ in range(12):
        est.record(2, 1)  # the first draft taken, the second rejected
        gaps.append(est.estimate()[0] - est.lower()[0])
    assert gaps[-1] < gaps[0] and min(est.lower()) >= 0.0
    assert est.lower(z=0.0) == est.estimate()
    # On a knee-shaped curve a width-4 batch's plan at the measured ~0.4 first-draft acceptance wins by a few
    # percent at best; one standard error below it, the batch decodes plainly.
    noisy = EwmaAcceptance(alpha=0.2, positions=4)
    for hit in [1, 0, 1, 0, 0, 1, 0, 0, 1, 0]:
        noisy.record(1, hit)
    knee = CostCurves(verify_s={1: 0.105, 4: 0.123, 8: 0.119}, draft_s={c: 0.0092 for c in range(1, 5)})
    assert plan_batch(knee, [0.45, 0.55, 0.73, 0.5], 4, 4).speculate
    assert not plan_batch(knee, noisy.lower(), 4, 4).speculate
