"""`--mode auto` on fakes with controlled costs: the race picks the faster source, the result is cached,
output stays lossless, and the online switcher moves to a source that is really faster."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest

from mlx_dspark.application.auto_mode import AutoSelector, cap_policy_factory, measure_and_choose, race
from mlx_dspark.application.calibration import CalibrationPlan
from mlx_dspark.application.engine import decode
from mlx_dspark.application.generation import GenerationRequest, GenerationService
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.costmodel.draft_cap import FixedCap, MeasuredCap
from mlx_dspark.domain.events import CapChanged, SourceSwitched, TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.fakes.clock import RecordingTelemetrySink
from tests.integration.calibration.timed_fakes import (
    ManualClock,
    MemoryStore,
    TimedSource,
    TimedTarget,
    linear,
    loaded,
    timed_target,
)

PLAN = CalibrationPlan(depth=32, deep_depth=96, repeats=2, overhead_tokens=4)
GREEDY = SamplingParams()


def setup(cost=None):  # type: ignore[no-untyped-def]
    return timed_target(cost)


def test_race_picks_the_faster_source_and_caches_it() -> None:
    clock, target = setup()
    fast = TimedSource(target, lambda cap: 0.001 * cap, block=6, name="fast")
    slow = TimedSource(target, lambda cap: 0.2, block=6, name="slow")  # right, but drafting costs 4 verifies
    store = MemoryStore()
    cands = {"slow": slow, "fast": fast, "none": None}
    choice = measure_and_choose(store, loaded(target), cands, clock, plan=PLAN, race_tokens=16, online=False)
    selection = choice.selector.select([1, 2, 3])
    assert choice.mode == "fast" and selection.source is fast and not choice.from_cache
    # "slow"'s cap policy pauses it (its drafting cannot pay): its rounds are plain steps, rated as such.
    assert choice.rates["fast"] > choice.rates["none"] >= choice.rates["slow"]
    assert isinstance(selection.policy, MeasuredCap)
    again = measure_and_choose(store, loaded(target), cands, clock, plan=PLAN, race_tokens=16, online=False)
    assert again.from_cache and again.mode == "fast"


def test_the_race_rates_rounds_at_the_calibrated_seconds_not_the_first_use_cost() -> None:
    """A device that compiles kernels on first use charges each new shape to whoever meets it first: the
    race learns acceptance from its runs and prices the rounds with the calibrated curves."""
    clock, target = setup()
    calls = itertools.count()
    # Its first dozen drafts pay a 2 s "compile"; warm, a draft costs 1 ms a token.
    jit = TimedSource(target, lambda cap: 2.0 if next(calls) < 12 else 0.001 * cap, block=6, name="jit")
    cands = {"jit": jit, "none": None}
    curves = {
        "jit": CostCurves(verify_s={1: 0.05, 7: 0.056}, draft_s={1: 0.001, 6: 0.006}),
        "none": CostCurves(verify_s={1: 0.05, 7: 0.056}),
    }
    policies = {"jit": cap_policy_factory(6, None, 6)}
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    walled = race(loaded(target), cands, policies, clock, prompts, max_tokens=16)
    assert walled["jit"] < walled["none"]  # the wall clock charged the compiles to the drafter
    calls = itertools.count()  # and the rated race pays them all again
    rated = race(loaded(target), cands, policies, clock, prompts, max_tokens=16, curves=curves)
    assert rated["none"] == pytest.approx(1 / 0.05)
    # A perfect drafter at cap 6 commits 7 tokens a round (the last round of 16 commits what is left).
    tokens_per_round = 15 / math.ceil(15 / 7)
    assert rated["jit"] == pytest.approx(tokens_per_round / (0.006 + 0.056), rel=0.2)
    assert rated["jit"] > 2 * rated["none"]


def test_plain_decoding_wins_when_speculation_cannot() -> None:
    clock, target = setup(linear(0.05))
    src = TimedSource(target, lambda cap: 0.001, block=6, name="lookup")
    choice = measure_and_choose(
        MemoryStore(), loaded(target), {"lookup": src, "none": None}, clock, plan=PLAN, race_tokens=16, online=False
    )
    selection = choice.selector.select([1, 2, 3])
    assert choice.mode == "none" and selection.source is None and selection.policy is None


def test_wrong_drafter_loses_to_plain() -> None:
    clock, target = setup()
    wrong = TimedSource(target, lambda cap: 0.01, right=lambda r, i: False, block=6, name="wrong")
    choice = measure_and_choose(
        MemoryStore(), loaded(target), {"wrong": wrong, "none": None}, clock, plan=PLAN, race_tokens=16, online=False
    )
    assert choice.mode == "none"


def run(target: TimedTarget, prompt: Sequence[int], clock: ManualClock, source=None, policy=None, n=24):  # type: ignore[no-untyped-def]
    out, decisions = [], []
    stop = StopRule(max_tokens=n, eos_ids=frozenset())
    for ev in decode(target, prompt, GREEDY, stop, clock, source=source, cap_policy=policy):
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
        elif isinstance(ev, CapChanged):
            decisions.append(ev)
    return out, decisions


def test_auto_choice_is_lossless() -> None:
    clock, target = setup()
    fast = TimedSource(target, lambda cap: 0.001, right=lambda r, i: (r + i) % 3 != 2, block=5, name="fast")
    choice = measure_and_choose(
        MemoryStore(), loaded(target), {"fast": fast, "none": None}, clock, plan=PLAN, race_tokens=16
    )
    assert isinstance(choice.selector, AutoSelector)
    for prompt in ([1, 2, 3], [9, 8, 7, 6, 5], [4]):
        plain, _ = run(target, prompt, clock)
        selection = choice.selector.select(prompt)
        spec, _ = run(target, prompt, clock, selection.source, selection.policy)
        assert spec == plain


def test_online_switch_follows_observed_throughput() -> None:
    clock, target = setup()
    # The race (seeded rates) says "a" is best, but at run time "a" drafts slowly.
    a = TimedSource(target, lambda cap: 0.5, block=4, name="a")
    b = TimedSource(target, lambda cap: 0.001, block=4, name="b")
    policies = {"a": cap_policy_factory(4, None, 4), "b": cap_policy_factory(4, None, 4)}
    switching = AutoSelector({"a": a, "b": b}, policies, {"a": 100.0, "b": 10.0})
    assert switching.current == "a"
    sink = RecordingTelemetrySink()
    service = GenerationService(loaded(target), selector=switching, clock=clock, telemetry=sink)
    sources = []
    for i in range(6):
        prompt = [i % 7 + 1, 3, 5]
        plain, _ = run(target, prompt, clock)
        target.reset(0)
        result = service.generate(GenerationRequest(prompt=prompt, max_tokens=24))
        assert list(result.token_ids) == plain
        sources.append(result.source)
    # The first request moved to "b" within itself; the next ones start there: "a"'s slow rounds are in the
    # cost book, so its prior (tokens per round at those seconds) stays below "b"'s.
    assert switching.current == "b" and sources[0] == "b" and sources[2:4] == ["b", "b"]
    assert sources.count("b") >= 4
    switches = [e for _, e in sink.events if isinstance(e, SourceSwitched)]
    assert switches[0].old == "a" and switches[0].new == "b"
    assert switching.rates()["b"] > switching.rates()["a"]


def test_fixed_max_draft_gives_fixed_policy() -> None:
    policy = cap_policy_factory(3, None, 7)()
    assert isinstance(policy, FixedCap) and policy.cap(0) == 3
    assert cap_policy_factory(12, None, 7)().cap(0) == 7
