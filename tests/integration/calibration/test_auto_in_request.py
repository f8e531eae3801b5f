"""`--mode auto` adapts within a request: a source that loses on the user's own prompt is swapped (or plain
decoding takes over) from the next round, output stays the plain greedy output, and a feature-reading
drafter that comes back after a switch still sees every target row exactly once."""

from __future__ import annotations

from collections.abc import Sequence

from mlx_dspark.application.auto_mode import AutoSelector, cap_policy_factory
from mlx_dspark.application.decode_loop import decode
from mlx_dspark.application.generation import GenerationRequest, GenerationService
from mlx_dspark.domain.drafting.selection import PLAIN, Selection
from mlx_dspark.domain.events import RoundFinished, SourceSwitched, TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.fakes.clock import RecordingTelemetrySink
from tests.integration.calibration.timed_fakes import ManualClock, TimedSource, TimedTarget, flat, loaded

GREEDY = SamplingParams()
PROMPT = [5, 3, 9, 1, 7]


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
    switches = [e for e in events if isinstance(e, SourceSwitched)]
    assert [(s.old, s.new) for s in switches] == [("slow", "fast")]
    assert result.source == "fast" and result.mode == "auto"
    # The switch happened inside the request: rounds of both sources precede its one Finished.
    sources = [e.source for e in events if isinstance(e, RoundFinished) and e.drafted]
    assert "slow" in sources and sources[-1] == "fast"
    assert selector.rates()["slow"] < 15.0  # what it really did on this prompt, not the race's number
    # The next request starts on the winner.
    again, events = one_request(selector, target, clock)
    assert again.source == "fast" and list(again.token_ids) == expected
    assert not any(isinstance(e, SourceSwitched) for e in events)


def test_auto_falls_back_to_plain_decoding_within_the_request() -> None:
    clock = ManualClock()
    target = TimedTarget(clock, flat(0.05))
    # Drafts that are never right, each costing a verify: plain decoding beats it on this prompt.
    wrong = TimedSource(target, lambda cap: 0.05, right=lambda r, i: False, block=4, name="wrong")
    policies = {"wrong": cap_policy_factory(4, None, 4)}
    selector = AutoSelector({"wrong": wrong, PLAIN: None}, policies, {"wrong": 90.0, PLAIN: 18.0})
    expected = plain_output(target, clock, 60)
    result, events = one_request(selector, target, clock, n=60)
    assert list(result.token_ids) == expected
    assert [(s.old, s.new) for s in events if isinstance(s, SourceSwitched)] == [("wrong", PLAIN)]
    assert result.source == PLAIN
    rounds = [e for e in events if isinstance(e, RoundFinished)]
    last_wrong = max(i for i, e in enumerate(rounds) if e.drafted)
    assert last_wrong < len(rounds) - 10 and all(e.drafted == 0 for e in rounds[last_wrong + 1 :])


class EveryThree:
    """A scripted SourceSwitcher: hands the request to the next of `order` every three rounds."""

    def __init__(self, order: Sequence[Selection]) -> None:
        self.order = list(order)
        self.rounds = 0
        self.at = 0

    def after_round(self, name: str, committed: int, seconds: float) -> Selection | None:
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
