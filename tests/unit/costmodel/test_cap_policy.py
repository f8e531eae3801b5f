"""Cap decisions on synthetic curves: linear verify → cap 0, flat + high acceptance → full block, slow
observed rounds → lower cap, pause then resume; every decision is reported."""

from __future__ import annotations

from mlx_dspark.domain.costmodel.acceptance import EwmaAcceptance
from mlx_dspark.domain.costmodel.curves import CostCurves, best_cap, expected_rate
from mlx_dspark.domain.costmodel.draft_cap import FixedCap, MeasuredCap, RoundTimeCorrection

BLOCK = 7
FLAT = CostCurves(
    verify_s={w: 0.050 + 0.0005 * w for w in range(1, BLOCK + 2)}, draft_s={c: 0.002 * c for c in range(1, 8)}
)
LINEAR = CostCurves(verify_s={w: 0.050 * w for w in range(1, BLOCK + 2)}, draft_s={c: 0.002 * c for c in range(1, 8)})


def test_linear_verify_curve_never_speculates() -> None:
    # Even a perfect drafter cannot beat plain decoding when verifying k tokens costs k steps.
    for p in (0.5, 0.9, 0.99):
        assert best_cap(LINEAR, [p] * BLOCK, BLOCK) == 0
    policy = MeasuredCap(curves=LINEAR, max_cap=BLOCK)
    assert policy.cap(0) == 0


def test_flat_curve_high_acceptance_takes_full_block() -> None:
    assert best_cap(FLAT, [0.95] * BLOCK, BLOCK) == BLOCK
    policy = MeasuredCap(curves=FLAT, max_cap=BLOCK, acceptance=EwmaAcceptance(prior=0.95, positions=BLOCK))
    assert policy.cap(0) == BLOCK


def test_flat_curve_low_acceptance_drafts_little() -> None:
    assert best_cap(FLAT, [0.05] * BLOCK, BLOCK) <= 1


def test_context_slope_counts_in_round_time() -> None:
    steep = CostCurves(verify_s=dict(FLAT.verify_s), draft_s=dict(FLAT.draft_s), slope_s_per_token=1e-4)
    assert expected_rate(steep, 3, [0.8], depth=4000) < expected_rate(steep, 3, [0.8], depth=0)


def test_first_decision_is_reported_when_it_changes_the_default() -> None:
    policy = MeasuredCap(curves=FLAT, max_cap=BLOCK, acceptance=EwmaAcceptance(prior=0.95, positions=BLOCK))
    cap = policy.cap(0)
    # The full block is what a policy-less loop drafts anyway: no "cap 7 -> 7" event.
    assert policy.observe(cap, cap, FLAT.round_seconds(cap), 0) is None
    # Rounds that match the prediction change nothing.
    assert all(policy.observe(BLOCK, BLOCK, FLAT.round_seconds(BLOCK), 0) is None for _ in range(10))
    low = MeasuredCap(curves=FLAT, max_cap=BLOCK, acceptance=EwmaAcceptance(prior=0.05, positions=BLOCK))
    cap = low.cap(0)
    decision = low.observe(cap, 0, FLAT.round_seconds(cap), 0)
    assert decision is not None and decision.old == BLOCK and decision.new < BLOCK and "initial" in decision.reason


def test_observed_slow_rounds_lower_the_cap() -> None:
    policy = MeasuredCap(
        curves=FLAT,
        max_cap=BLOCK,
        acceptance=EwmaAcceptance(prior=0.8, positions=BLOCK),
        explore_every=4,
    )
    assert policy.cap(0) == BLOCK
    decisions = []
    for _ in range(64):
        cap = policy.cap(0)
        # Wide rounds really take 4x what calibration said; plain steps take what it said.
        seconds = FLAT.round_seconds(cap) * (4.0 if cap >= 4 else 1.0)
        accepted = int(cap * 0.8)
        decision = policy.observe(cap, accepted, seconds, 0)
        if decision is not None:
            decisions.append(decision)
    assert policy.cap(0) < BLOCK
    assert any("round times" in d.reason for d in decisions)


def test_uniformly_slower_machine_keeps_the_cap() -> None:
    # One observed width rescales the whole curve: a uniformly busier machine changes no decision.
    policy = MeasuredCap(curves=FLAT, max_cap=BLOCK, acceptance=EwmaAcceptance(prior=0.95, positions=BLOCK))
    for _ in range(40):
        cap = policy.cap(0)
        policy.observe(cap, cap, FLAT.round_seconds(cap) * 3.0, 0)
    assert policy.cap(0) == BLOCK


def test_pause_then_resume() -> None:
    policy = MeasuredCap(curves=FLAT, max_cap=BLOCK, probe_every=4, probe_cap=2)
    events = []
    caps = []
    # Phase 1: the drafter is always wrong → speculation pauses.
    for _ in range(40):
        cap = policy.cap(0)
        caps.append(cap)
        d = policy.observe(cap, 0, FLAT.round_seconds(cap), 0)
        if d is not None:
            events.append(d)
    assert policy.cap(0) == 0 or caps[-8:].count(0) >= 6
    assert any(d.new == 0 and "pause" in d.reason for d in events)
    # While paused it still probes now and then.
    assert any(c > 0 for c in caps[-12:])
    # Phase 2: the drafter becomes right → the probes see it and speculation resumes.
    for _ in range(200):
        cap = policy.cap(0)
        d = policy.observe(cap, cap, FLAT.round_seconds(cap), 0)
        if d is not None:
            events.append(d)
    assert any("resume" in d.reason for d in events)
    assert policy.cap(0) >= 2


def test_round_time_correction_interpolates_between_observed_widths() -> None:
    corr = RoundTimeCorrection(alpha=1.0)
    assert corr.factor(5) == 1.0
    corr.record(1, 1.0, 1.0)
    corr.record(9, 3.0, 1.0)
    assert corr.factor(1) == 1.0 and corr.factor(9) == 3.0
    assert corr.factor(5) == 2.0
    assert corr.factor(20) == 3.0


def test_fixed_cap_never_changes() -> None:
    policy = FixedCap(3)
    assert policy.cap(0) == 3
    assert policy.observe(3, 0, 1.0, 0) is None


def test_the_cap_grows_with_a_per_round_link_cost() -> None:
    """A sharded target's calibrated verify includes its link's round trip once per forward, whatever the width.
    That fixed cost is paid once a round, so the best cap grows with it (issue 31): a verify round amortises it."""
    base = CostCurves(
        verify_s={w: 0.050 + 0.008 * w for w in range(1, BLOCK + 2)}, draft_s={c: 0.006 * c for c in range(1, 8)}
    )
    acceptance = [0.7] * BLOCK
    caps = []
    for link in (0.0, 0.02, 0.1, 0.5):
        linked = CostCurves(verify_s={w: s + link for w, s in base.verify_s.items()}, draft_s=dict(base.draft_s))
        caps.append(best_cap(linked, acceptance, BLOCK))
        policy = MeasuredCap(curves=linked, max_cap=BLOCK, acceptance=EwmaAcceptance(prior=0.7, positions=BLOCK))
        assert policy.cap(0) == caps[-1]  # the policy decides as the model does
    assert caps == sorted(caps) and caps[0] < caps[-1], caps
