"""Calibration through the ports on fakes whose costs the test sets: sane curves, a realistic token
stream (never one repeated id), the context slope, and caching in the store."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mlx_dspark.application.calibration import (
    CalibrationPlan,
    calibrate_sources,
    curves_for,
    measured_widths,
    realistic_stream,
)
from mlx_dspark.domain.costmodel.curves import best_cap
from tests.integration.calibration.timed_fakes import (
    ConstantTokenizer,
    MemoryStore,
    TimedSource,
    flat,
    linear,
    loaded,
    timed_target,
)

PLAN = CalibrationPlan(depth=32, deep_depth=160, repeats=3, overhead_tokens=4)


def test_curves_follow_the_costs_the_fakes_charge() -> None:
    clock, target = timed_target(flat(0.05, per_depth=1e-4))
    source = TimedSource(target, lambda cap: 0.002 * cap, block=7, name="fast")
    progress: list[tuple[str, float]] = []
    curves = calibrate_sources(
        loaded(target), {"fast": source, "none": None}, clock, plan=PLAN, progress=lambda m, f: progress.append((m, f))
    )
    c = curves["fast"]
    assert sorted(c.verify_s) == list(range(1, 9))
    for w, s in c.verify_s.items():
        # Normalized to depth 0: what the fake charges at depth 0.
        assert abs(s - flat(0.05)(w, 0)) < 1e-9
    assert abs(c.slope_s_per_token - 1e-4) < 1e-9
    assert sorted(c.draft_s) == list(range(1, 8))
    assert all(abs(c.draft_s[k] - 0.002 * k) < 1e-9 for k in c.draft_s)
    assert c.overhead_s == 0.0  # the manual clock only moves when a fake charges
    assert curves["none"].draft_s == {}
    assert curves["none"].verify_s == c.verify_s
    # Progress is monotone and ends at 1.
    fractions = [f for _, f in progress]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    # The target is left clean.
    assert target.cached_tokens == 0


def test_measured_curves_drive_the_decision() -> None:
    for cost, expect_zero in ((linear(0.05), True), (flat(0.05), False)):
        clock, target = timed_target(cost)
        source = TimedSource(target, lambda cap: 0.001 * cap, block=7)
        c = calibrate_sources(loaded(target), {"s": source}, clock, plan=PLAN)["s"]
        cap = best_cap(c, [0.9] * 7, 7)
        assert (cap == 0) == expect_zero


def test_never_times_a_constant_token_stream() -> None:
    clock, target = timed_target(flat())
    source = TimedSource(target, lambda cap: 0.001, block=7)
    # Even a tokenizer that turns every text into one repeated id gets a varied stream.
    calibrate_sources(loaded(target, tokenizer=ConstantTokenizer()), {"s": source}, clock, plan=PLAN)
    wide = [b for b in target.blocks if len(b) >= 3]
    assert wide, "no multi-token verify was timed"
    assert all(len(set(b)) > 1 for b in wide)
    assert len({t for b in target.blocks for t in b}) >= 8
    # Drafts were proposed on a varied history too.
    assert all(len(set(ctx.history)) >= 8 for ctx in source.proposed_contexts)


def test_realistic_stream_prefers_the_tokenizer_text() -> None:
    from tests.integration.calibration.timed_fakes import ByteTokenizer

    ids = realistic_stream(ByteTokenizer(64), 64, 100)
    text_ids = ByteTokenizer(64).encode("Hi! What's a good name")
    assert ids[: len(text_ids)] == text_ids
    assert len(set(realistic_stream(None, 50, 400))) >= 8
    assert len(set(realistic_stream(ConstantTokenizer(), 50, 400))) >= 8


def test_feature_sources_get_the_prefill_features_once() -> None:
    clock, target = timed_target(flat())
    source = TimedSource(target, lambda cap: 0.001, block=3, features=True)
    calibrate_sources(loaded(target), {"s": source}, clock, plan=PLAN)
    with_features = [ctx for ctx in source.proposed_contexts if ctx.features]
    assert len(with_features) == 1 and len(with_features[0].features) == PLAN.depth


def test_wide_blocks_measure_a_subset_of_widths() -> None:
    widths = measured_widths(33)
    assert widths[:12] == list(range(1, 13)) and widths[-1] == 33 and len(widths) < 20


def test_curves_are_cached_in_the_store() -> None:
    clock, target = timed_target(flat())
    source = TimedSource(target, lambda cap: 0.001, block=4, name="s")
    store = MemoryStore()
    model = loaded(target)
    first = curves_for(store, model, {"s": source, "none": None}, clock, plan=PLAN)
    timed = len(target.blocks)
    assert store.saves == 2
    again = curves_for(store, model, {"s": source, "none": None}, clock, plan=PLAN)
    assert again == first and len(target.blocks) == timed  # nothing re-measured
    curves_for(store, model, {"s": source}, clock, plan=PLAN, force=True)
    assert len(target.blocks) > timed
    # Another target identity is another entry.
    curves_for(store, loaded(target, identity="fake/target@rev2"), {"s": source}, clock, plan=PLAN)
    assert store.saves == 4


def _spiking(cost: Callable[..., float], start: int, length: int = 3, extra: float = 1.0) -> Callable[..., float]:
    """`cost`, plus `extra` seconds on calls start .. start + length - 1: a passing load on a shared host."""
    calls = [0]

    def charged(*args: int) -> float:
        calls[0] += 1
        return cost(*args) + (extra if start <= calls[0] - 1 < start + length else 0.0)

    return charged


@pytest.mark.parametrize("deep", [32, 160])
def test_a_passing_load_spike_moves_no_point_of_a_curve(deep: int) -> None:
    # The repeats of every width are taken in turns, so a spike of 3 consecutive calls costs each width at
    # most one of its 3 samples and every median drops it, wherever the spike falls; the deep points (the
    # context slope) are timed before and after the shallow ones and the faster kept. (Timed width by width,
    # a spike over one width's repeats moved that width alone: the 1.5B's 1-row verify once read 0.170 s
    # against 0.252 s and the cap policy paused speculation; over the deep points it made the slope 100x steep.)
    plan = CalibrationPlan(depth=32, deep_depth=deep, repeats=3, overhead_tokens=4)
    base_verify, base_draft = flat(0.05, per_depth=1e-4), (lambda cap: 0.002 * cap)
    calls = 100  # more than the calibration makes of either kind
    for start in range(calls):
        clock, target = timed_target(_spiking(base_verify, start))
        source = TimedSource(target, _spiking(base_draft, start), block=7, name="fast")
        c = calibrate_sources(loaded(target), {"fast": source}, clock, plan=plan)["fast"]
        slope = 1e-4 if deep > 32 else 0.0
        # With a slope the curve is normalized to depth 0; without one it is what depth 32 costs.
        want = {w: base_verify(w, 0 if slope else 32) for w in range(1, 9)}
        assert c.slope_s_per_token == pytest.approx(slope, abs=1e-9), start
        assert c.verify_s == pytest.approx(want, abs=1e-9), start
        assert c.draft_s == pytest.approx({k: base_draft(k) for k in range(1, 8)}, abs=1e-9), start
