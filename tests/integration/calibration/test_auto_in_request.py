"""`--mode auto` adapts within a request: a source that loses on the user's own prompt is swapped (or plain
decoding takes over) from the next round, output stays the plain greedy output, and a feature-reading
drafter that comes back after a switch still sees every target row exactly once."""

from __future__ import annotations

import random
from collections.abc import Sequence

from mlx_dspark.application.auto_mode import AutoSelector, cap_policy_factory
from mlx_dspark.application.engine import decode
from mlx_dspark.application.generation import GenerationRequest, GenerationService
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.drafting.selection import PLAIN, Selection
from mlx_dspark.domain.events import RoundFinished, SourceSwitched, TokensCommitted, Usage
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.fakes.clock import RecordingTelemetrySink
from tests.integration.calibration.timed_fakes import ManualClock, TimedSource, TimedTarget, flat, loaded

GREEDY = SamplingParams()
PROMPT = [5, 3, 9, 1, 7]


class _Named:
    """A draft source as the selector sees it when the test reports its rounds itself."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.max_block = 7


def plain_output(target: TimedTarget, clock: ManualClock, n: int) -> list[int]:
    out: list[int] = []
    for ev in decode(target, PROMPT, GREEDY, StopRule(max_tokens=n, eos_ids=frozenset()), clock):
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
    return out


def one_request(selector: AutoSelector, target: TimedTarget, clock: ManualClock, n: int = 80):  # type: ignore[no-untyped-def]
    sink = RecordingTelemetrySink()
    service = GenerationService(loaded(target), selector=selector, clock=clock, telemetry=sink)
    target.reset(0)
    result = service.generate(GenerationRequest(prompt=PROMPT, max_tokens=n))
    return result, [e for _, e in sink.events]


def test_a_source_that_loses_on_this_prompt_is_swapped_within_the_request() -> None:
    clock = ManualClock()
    target = TimedTarget(clock, flat(0.05))
    # The race said "slow" is best; on this prompt its drafting costs ten verifies.
    slow = TimedSource(target, lambda cap: 0.5, block=4, name="slow")
    fast = TimedSource(target, lambda cap: 0.001, block=4, name="fast")
    policies = {"slow": cap_policy_factory(4, None, 4), "fast": cap_policy_factory(4, None, 4)}
    rates = {"slow": 100.0, "fast": 50.0, PLAIN: 15.0}
    selector = AutoSelector({"slow": slow, "fast": fast, PLAIN: None}, policies, rates)
    expected = plain_output(target, clock, 80)
    result, events = one_request(selector, target, clock)
    assert list(result.token_ids) == expected
    switches = [(s.old, s.new) for s in events if isinstance(s, SourceSwitched)]
    # Plain decoding's rate is forecast from its cost, not probed: the request goes straight to the
    # untried source, whose prior beats what "slow" measures here, and stays on it.
    assert switches == [("slow", "fast")]
    assert result.source == "fast" and result.mode == "auto"
    assert result.source_switches == len(switches) and sum(result.source_rounds.values()) == result.rounds
    rounds = result.source_rounds
    assert rounds["fast"] > rounds["slow"] and PLAIN not in rounds and rounds["slow"] == 1 + 3  # settle + judged
    # The switch happened inside the request: rounds of both sources precede its one Finished.
    sources = [e.source for e in events if isinstance(e, RoundFinished) and e.drafted]
    assert "slow" in sources and sources[-1] == "fast"
    assert selector.rates()["fast"] > selector.rates()["slow"]  # what they did on this prompt moved them
    # The next request starts on the winner, and the loser's cost, learned in the last request, keeps
    # it from being tried again.
    again, events = one_request(selector, target, clock)
    assert again.source == "fast" and list(again.token_ids) == expected
    assert again.source_rounds.get("slow", 0) == 0


def test_auto_falls_back_to_plain_decoding_within_the_request() -> None:
    clock = ManualClock()
    target = TimedTarget(clock, flat(0.05))
    # Drafts that are never right, each costing a verify: plain decoding beats it on this prompt.
    wrong = TimedSource(target, lambda cap: 0.05, right=lambda r, i: False, block=4, name="wrong")
    policies = {"wrong": cap_policy_factory(4, None, 4)}
    selector = AutoSelector({"wrong": wrong, PLAIN: None}, policies, {"wrong": 90.0, PLAIN: 18.0})
    expected = plain_output(target, clock, 80)
    result, events = one_request(selector, target, clock, n=80)
    assert list(result.token_ids) == expected
    switches = [(s.old, s.new) for s in events if isinstance(s, SourceSwitched)]
    assert switches[0] == ("wrong", PLAIN) and result.source == PLAIN
    rounds = [e for e in events if isinstance(e, RoundFinished)]
    assert all(e.drafted for e in rounds[:4]) and not rounds[4].drafted  # judged after 1 + 3 rounds
    # Re-probes are few and short: most of the request is plain decoding.
    assert result.source_rounds[PLAIN] >= 0.8 * len(rounds)


class JitterTarget(TimedTarget):
    """A timed target whose forwards take a little random extra time: wall time differs run to run."""

    def __init__(self, clock: ManualClock, seed: int) -> None:
        rng = random.Random(seed)
        super().__init__(clock, lambda w, d: 0.05 + 0.0005 * w + 0.02 * rng.random())


def test_seeded_sampling_through_auto_repeats_whatever_the_wall_time() -> None:
    """A seeded request decides on modelled costs, so the same seed gives the same tokens (and the same
    schedule of sources) even when every round's wall time differs; greedy output equals plain."""
    runs = []
    for jitter in (1, 2, 3):
        clock = ManualClock()
        target = JitterTarget(clock, jitter)
        good = TimedSource(target, lambda cap: 0.001, right=lambda r, i: (r + i) % 4 != 3, block=4, name="good")
        bad = TimedSource(target, lambda cap: 0.04, right=lambda r, i: False, block=4, name="bad")
        curves = {
            "good": CostCurves(verify_s={1: 0.05, 5: 0.052}, draft_s={1: 0.001, 4: 0.001}),
            "bad": CostCurves(verify_s={1: 0.05, 5: 0.052}, draft_s={1: 0.04, 4: 0.04}),
            PLAIN: CostCurves(verify_s={1: 0.05, 5: 0.052}),
        }
        policies = {n: cap_policy_factory(None, curves[n], 4) for n in ("good", "bad")}
        selector = AutoSelector(
            {"bad": bad, "good": good, PLAIN: None}, policies, {"bad": 50.0, "good": 40.0, PLAIN: 20.0}, curves=curves
        )
        sink = RecordingTelemetrySink()
        service = GenerationService(loaded(target), selector=selector, clock=clock, telemetry=sink)
        sampled = SamplingParams(temperature=0.9, seed=11)
        out = []
        for _ in range(2):  # the second request too: a seeded request does not depend on the first
            target.reset(0)
            r = service.generate(GenerationRequest(prompt=PROMPT, max_tokens=60, sampling=sampled))
            out.append((r.token_ids, dict(r.source_rounds)))
        runs.append(out)
        assert out[0] == out[1]
        ran = out[0][1]
        assert sum(ran.values()) > 4 * ran.get("bad", 0)  # it did adapt: the bad source runs little
    assert runs[0] == runs[1] == runs[2]
    assert len(runs[0][0][0]) == 60


class EveryThree:
    """A scripted SourceSwitcher: hands the request to the next of `order` every three rounds."""

    def __init__(self, order: Sequence[Selection]) -> None:
        self.order = list(order)
        self.rounds = 0
        self.at = 0

    def after_round(
        self,
        name: str,
        committed: int,
        seconds: float,
        *,
        drafted: int = 0,
        depth: int = 0,
        history: Sequence[int] = (),
    ) -> Selection | None:
        self.rounds += 1
        if self.rounds % 3:
            return None
        self.at = (self.at + 1) % len(self.order)
        nxt = self.order[self.at]
        switched = SourceSwitched(old=name, new=nxt.name, reason="test")
        return Selection(name=nxt.name, source=nxt.source, switched=switched, switcher=self)


def test_feature_drafters_see_every_row_once_across_switches() -> None:
    clock = ManualClock()
    target = TimedTarget(clock, flat(0.05))
    a = TimedSource(target, lambda cap: 0.001, right=lambda r, i: i < 2, block=3, name="a", features=True)
    b = TimedSource(target, lambda cap: 0.001, right=lambda r, i: i < 1, block=3, name="b", features=True)
    plain_src = TimedSource(target, lambda cap: 0.001, block=3, name="lookup-like", features=False)
    order = [
        Selection(name="a", source=a),
        Selection(name="b", source=b),
        Selection(name="l", source=plain_src),
        Selection(name=PLAIN, source=None),
    ]
    switcher = EveryThree(order)
    expected = plain_output(target, clock, 70)
    target.reset(0)
    out: list[int] = []
    start = Selection(name="a", source=a, switcher=switcher)
    switched = 0
    for ev in decode(target, PROMPT, GREEDY, StopRule(max_tokens=70, eos_ids=frozenset()), clock, selection=start):
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
        elif isinstance(ev, SourceSwitched):
            switched += 1
    assert out == expected and switched >= 8
    for src in (a, b):
        positions = [p for p, _ in src.features_seen]
        # Rows 0.. up to its last draft, in order, none missing, none twice: what take_features promises.
        assert positions == list(range(len(positions))) and len(positions) > len(PROMPT)
        tokens = [t for _, t in src.features_seen]
        assert tokens == (PROMPT + expected)[: len(tokens)]
    assert not plain_src.features_seen


def test_a_cap_policy_that_pauses_its_source_moves_the_request_at_once() -> None:
    clock = ManualClock()
    target = TimedTarget(clock, flat(0.05))
    src = TimedSource(target, lambda cap: 0.001, right=lambda r, i: i < 1, block=4, name="dspark")
    # Calibrated on a machine where a k-token verify costs k steps: the MeasuredCap's first decision is 0.
    linear = CostCurves(verify_s={w: 0.05 * w for w in range(1, 6)}, draft_s={c: 0.001 for c in range(1, 5)})
    selector = AutoSelector(
        {"dspark": src, PLAIN: None}, {"dspark": cap_policy_factory(None, linear, 4)}, {"dspark": 40.0, PLAIN: 20.0}
    )
    expected = plain_output(target, clock, 40)
    result, events = one_request(selector, target, clock, n=40)
    assert list(result.token_ids) == expected
    switches = [e for e in events if isinstance(e, SourceSwitched)]
    assert (switches[0].old, switches[0].new) == ("dspark", PLAIN) and "cap policy" in switches[0].reason
    rounds = [e for e in events if isinstance(e, RoundFinished)]
    # One round of it (drafting at the probe floor, not a plain round under its name), then plain decoding.
    assert rounds[0].drafted == 2 and not rounds[1].drafted


def test_a_hard_request_does_not_shrink_the_next_requests_drafts() -> None:
    """Each request's cap policy starts fresh, as a fixed mode's does: one carried over from a prompt where
    only first drafts held drafted one token a round on the next, easy prompt: a cap never drafted past
    never measures the positions after it again."""
    clock = ManualClock()
    # Costs shaped like the default model on the CPU: a draft costs a fifth of a step, a wide verify more.
    target = TimedTarget(clock, lambda w, d: 0.10 + 0.004 * w)
    hard = [True]
    src = TimedSource(
        target, lambda cap: 0.02 + 0.002 * cap, right=lambda r, i: i == 0 or not hard[0], block=6, name="spec"
    )
    curves = {
        "spec": CostCurves(verify_s={1: 0.104, 7: 0.128}, draft_s={1: 0.022, 6: 0.032}),
        PLAIN: CostCurves(verify_s={1: 0.104, 7: 0.128}),
    }
    policies = {"spec": cap_policy_factory(None, curves["spec"], 6)}
    selector = AutoSelector({"spec": src, PLAIN: None}, policies, {"spec": 40.0, PLAIN: 19.0}, curves=curves)
    one_request(selector, target, clock, n=200)  # only first drafts right: its cap policy learns cap 1
    hard[0] = False
    _, events = one_request(selector, target, clock)
    drafted = [e.drafted for e in events if isinstance(e, RoundFinished) and e.source == "spec"]
    assert drafted[0] == 6 and sum(d == 6 for d in drafted) >= len(drafted) // 2


def test_a_drafter_not_run_on_a_prompt_keeps_pace_with_the_one_that_ran() -> None:
    """Two equally good drafters both measured on a hard prompt, then only one run on easy prompts: the other's
    prior moves with it (by how far the one that ran beat its own prior), so it is not left forever with the
    hard prompt's figure and never looked at where it would win (the H100 run of 2026-12-05: DSpark's prior
    kept chat's 84-101 tok/s while DFlash ran code at 250; fixed DSpark ran code at 300)."""
    seconds = 0.01
    curves = {n: CostCurves(verify_s={1: seconds, 8: seconds}, draft_s={1: 1e-4, 7: 1e-4}) for n in ("a", "b")}
    curves[PLAIN] = CostCurves(verify_s={1: seconds})
    policies = {n: cap_policy_factory(7, None, 7) for n in ("a", "b")}
    selector = AutoSelector(
        {"a": _Named("a"), "b": _Named("b"), PLAIN: None}, policies, {"a": 150.0, "b": 150.0}, curves=curves
    )

    def request(rounds: Sequence[tuple[str, int]]) -> None:
        selection = selector.select(PROMPT)
        switcher = selection.switcher
        assert switcher is not None
        history = [*PROMPT, 0]
        for name, tokens in rounds:  # the sources named here run, whatever the rule proposes
            history.extend([1] * tokens)
            switcher.after_round(name, tokens, seconds, drafted=7, history=history)
        selector.finished(selection, Usage(prompt_tokens=len(PROMPT), generated_tokens=len(history), source="b"))

    request([("a", 1)] * 20 + [("b", 1)] * 20)  # a hard prompt: both commit one token a round
    for _ in range(4):
        request([("b", 4)] * 30)  # easy prompts: b alone, four tokens a round
    priors = selector.priors()
    assert priors["b"] > 3 * priors[PLAIN]
    assert priors["a"] > 0.8 * priors["b"]  # without the co-move: a stays at the hard prompt's 1 token a round


def test_a_few_rounds_on_a_hard_opening_do_not_overturn_the_race() -> None:
    """The race rated "a" above "b"; the first request opens hard, "a" commits one token in each of its first
    rounds, then "b" runs the rest at its usual rate. A prior of tokens per round weighs the rounds behind it,
    so "a" keeps most of what the race said and the next request starts on it again (the H200's first request
    of 2026-12-05: DSpark's three rounds at 1.2 tokens set its prior for good, and auto ran DFlash on math
    where fixed DSpark was 1.4x faster)."""
    seconds = 0.01
    curves = {n: CostCurves(verify_s={1: seconds, 8: seconds}, draft_s={1: 1e-4, 7: 1e-4}) for n in ("a", "b")}
    curves[PLAIN] = CostCurves(verify_s={1: seconds})
    policies = {n: cap_policy_factory(7, None, 7) for n in ("a", "b")}
    race = {"a": 300.0, "b": 250.0, PLAIN: 100.0}
    selector = AutoSelector({"a": _Named("a"), "b": _Named("b"), PLAIN: None}, policies, race, curves=curves)
    selection = selector.select(PROMPT)
    assert selection.name == "a"
    switcher = selection.switcher
    assert switcher is not None
    history = [*PROMPT, 0]
    for name, tokens in [("a", 1)] * 4 + [("b", 2), ("b", 3)] * 15:
        history.extend([1] * tokens)
        switcher.after_round(name, tokens, seconds, drafted=7, history=history)
    selector.finished(selection, Usage(prompt_tokens=len(PROMPT), generated_tokens=len(history), source="b"))
    priors = selector.priors()
    assert priors["a"] > priors["b"] > 2 * priors[PLAIN]
    assert priors["a"] > 0.8 * race["a"]  # before: its 3 measured rounds alone, 1 token a round (~100 tok/s)
    assert selector.select(PROMPT).name == "a"
    # A whole answer does move it: "a" at one token a round for 60 rounds is then known slow.
    selection = selector.select(PROMPT)
    switcher = selection.switcher
    assert switcher is not None
    for _ in range(60):
        history.append(1)
        switcher.after_round("a", 1, seconds, drafted=7, history=history)
    selector.finished(selection, Usage(prompt_tokens=len(PROMPT), generated_tokens=len(history), source="a"))
    assert selector.priors()["a"] < 0.55 * race["a"]  # 59 measured rounds against 19 behind the prior
