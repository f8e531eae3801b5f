"""`--mode auto` within a request on real MLX drafters (DSpark, DFlash, lookup) over a tiny random target.

Forwards and drafts charge a manual clock, so the source rule's decisions repeat run to run while every
token comes from MLX: a drafter that never matches gives way to plain decoding, lookup on a repetitive
prompt is kept, switches mid-request keep greedy output equal to plain decoding and seeded sampling
reproducible (each drafter still sees every committed row once), and no budget is ever exceeded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.auto_mode import AutoSelector, cap_policy_factory
from mlx_dspark.application.engine import decode
from mlx_dspark.application.generation import GenerationRequest, GenerationResult, GenerationService
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.drafting.selection import PLAIN, Selection
from mlx_dspark.domain.events import RoundFinished, SourceSwitched, TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.integration.calibration.timed_fakes import ManualClock, loaded
from tests.integration.drafters import helpers

GREEDY = SamplingParams()
REPETITIVE = [5, 9, 14, 3, 77, 21] * 4  # the tiny target's greedy answer soon cycles: lookup matches well
PLAIN_PROMPT = [11, 4, 90, 63, 2]


class Charged:
    """A real MLX target whose forwards charge `cost(width)` seconds on a manual clock."""

    def __init__(self, inner: MlxTargetModel, clock: ManualClock, cost: Callable[[int], float]) -> None:
        self._inner = inner
        self._clock = clock
        self._cost = cost

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def verify(self, anchor: int, block: DraftBlock, sampling: SamplingParams, uniforms: Sequence[float], **kw: Any):  # type: ignore[no-untyped-def]
        self._clock.advance(self._cost(len(block) + 1))
        return self._inner.verify(anchor, block, sampling, uniforms, **kw)


class ChargedSource:
    """A real draft source charging `cost(calls)` seconds per proposal; `corrupt` may rewrite its tokens."""

    def __init__(
        self,
        inner: Any,
        clock: ManualClock,
        cost: Callable[[int], float],
        corrupt: Callable[[DraftContext, tuple[int, ...]], tuple[int, ...]] | None = None,
    ) -> None:
        self.inner = inner
        self._clock = clock
        self._cost = cost
        self._corrupt = corrupt
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin(self, prompt: Sequence[int]) -> None:
        self.calls = 0
        self.inner.begin(prompt)

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        if cap:
            self.calls += 1
            self._clock.advance(self._cost(self.calls))
        block: DraftBlock = self.inner.propose(ctx, cap, sampling, uniforms)
        if self._corrupt is None or not len(block):
            return block
        return DraftBlock(tokens=self._corrupt(ctx, block.tokens), q=block.q, source=block.source)


def verify_cost(width: int) -> float:
    return 0.05 + 0.001 * width  # a memory-bound step: a wider verify costs little more


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory, qwen3_target: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("auto")
    return {
        "dspark": load_drafter("dspark", str(helpers.write_dspark(tmp / "dspark", qwen3_target)), qwen3_target, bits=0),
        "dflash": load_drafter("dflash", str(helpers.write_dflash(tmp / "dflash")), qwen3_target, bits=0),
    }


def plain(model: Any, prompt: list[int], n: int, sampling: SamplingParams = GREEDY) -> list[int]:
    out: list[int] = []
    stop = StopRule(max_tokens=n, eos_ids=frozenset())
    for ev in decode(MlxTargetModel(model), prompt, sampling, stop, FakeClock()):
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
    return out


def target_for(model: Any, clock: ManualClock, drafters: dict[str, Any]) -> Charged:
    inner = MlxTargetModel(model)
    for d in drafters.values():
        inner.add_capture(d.target_layer_ids)
    return Charged(inner, clock, verify_cost)


def auto(
    sources: dict[str, Any], rates: dict[str, float], clock: ManualClock, target: Charged
) -> tuple[AutoSelector, GenerationService, RecordingTelemetrySink]:
    candidates = {**sources, PLAIN: None}
    policies = {n: cap_policy_factory(None, None, s.max_block) for n, s in sources.items()}
    selector = AutoSelector(candidates, policies, rates)
    sink = RecordingTelemetrySink()
    service = GenerationService(loaded(target), selector=selector, clock=clock, telemetry=sink)  # type: ignore[arg-type]
    return selector, service, sink


def run(service: GenerationService, target: Charged, prompt: list[int], n: int, **kw: Any) -> GenerationResult:
    target.reset(0)
    return service.generate(GenerationRequest(prompt=prompt, max_tokens=n, **kw))


def test_a_drafter_that_never_matches_falls_back_to_plain(qwen3_target: Any, drafters: dict[str, Any]) -> None:
    expected = plain(qwen3_target, PLAIN_PROMPT, 48)
    full = PLAIN_PROMPT + expected

    def never(ctx: DraftContext, tokens: tuple[int, ...]) -> tuple[int, ...]:
        # Wherever the drafter guessed the real next token, propose another: no draft is ever accepted.
        at = len(ctx.history)
        return tuple((t + 1) % 128 if at + i < len(full) and t == full[at + i] else t for i, t in enumerate(tokens))

    clock = ManualClock()
    target = target_for(qwen3_target, clock, drafters)
    wrong = ChargedSource(drafters["dspark"], clock, lambda _n: 0.01, corrupt=never)
    _, service, sink = auto({"dspark": wrong}, {"dspark": 90.0, PLAIN: 20.0}, clock, target)
    result = run(service, target, PLAIN_PROMPT, 48)
    assert list(result.token_ids) == expected and result.accepted == 0
    switches = [(e.old, e.new) for _, e in sink.events if isinstance(e, SourceSwitched)]
    assert switches[0] == ("dspark", PLAIN) and result.source == PLAIN
    assert result.source_rounds[PLAIN] >= 0.75 * result.rounds
    assert result.source_switches == len(switches)


def test_lookup_that_matches_well_is_kept(qwen3_target: Any, drafters: dict[str, Any]) -> None:
    # A prompt that already holds the tiny target's answer loop: lookup matches from the first round.
    prompt = REPETITIVE + plain(qwen3_target, REPETITIVE, 30)
    expected = plain(qwen3_target, prompt, 160)
    clock = ManualClock()
    target = target_for(qwen3_target, clock, drafters)
    lookup = ChargedSource(LookupDraftSource(block=5), clock, lambda _n: 0.0005)
    dspark = ChargedSource(drafters["dspark"], clock, lambda _n: 0.01)
    # The race preferred DSpark (a drafter built from the target's bigrams, decent here); lookup is better.
    selector, service, _ = auto(
        {"dspark": dspark, "lookup": lookup}, {"dspark": 30.0, "lookup": 25.0, PLAIN: 20.0}, clock, target
    )
    result = run(service, target, prompt, 160)
    assert list(result.token_ids) == expected
    # It measures plain decoding and DSpark on this prompt, then runs lookup for most of it (the clock is
    # manual, so this schedule is the same every run).
    assert result.source_rounds["lookup"] >= 0.6 * result.rounds
    assert result.accepted > 0
    assert selector.rates()["lookup"] > max(selector.rates()["dspark"], selector.rates()[PLAIN])


def test_a_mid_request_switch_keeps_greedy_output_and_seeded_sampling(
    qwen3_target: Any, drafters: dict[str, Any]
) -> None:
    expected = plain(qwen3_target, REPETITIVE, 64)
    results = []
    for _ in range(2):
        clock = ManualClock()
        target = target_for(qwen3_target, clock, drafters)
        # Lookup pays at first, then each proposal costs ten verifies: auto must leave it mid-request.
        lookup = ChargedSource(LookupDraftSource(block=5), clock, lambda n: 0.0005 if n <= 6 else 0.5)
        dspark = ChargedSource(drafters["dspark"], clock, lambda _n: 0.002)
        dflash = ChargedSource(drafters["dflash"], clock, lambda _n: 0.002)
        sources = {"lookup": lookup, "dspark": dspark, "dflash": dflash}
        _, service, sink = auto(sources, {"lookup": 40.0, "dspark": 22.0, "dflash": 21.0, PLAIN: 20.0}, clock, target)
        greedy = run(service, target, REPETITIVE, 64)
        assert list(greedy.token_ids) == expected
        moves = [e for _, e in sink.events if isinstance(e, SourceSwitched)]
        assert greedy.source_switches >= 2 and any(m.old == "lookup" for m in moves)
        ran = {n for n, k in greedy.source_rounds.items() if k}
        assert "lookup" in ran and ran & {"dspark", "dflash"}  # lookup, then a drafter, ran
        seeded = run(service, target, REPETITIVE, 40, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=5))
        assert len(seeded.token_ids) == 40
        results.append((greedy.source_rounds, seeded.token_ids, seeded.source_rounds))
    assert results[0] == results[1]  # the same schedule and the same sampled tokens


class Rotate:
    """A scripted SourceSwitcher: the next of `order` every `every` rounds (real drafters, forced moves)."""

    def __init__(self, order: Sequence[Selection], every: int) -> None:
        self.order = list(order)
        self.every = every
        self.rounds = 0

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
        if self.rounds % self.every:
            return None
        nxt = self.order[(self.rounds // self.every) % len(self.order)]
        return Selection(
            name=nxt.name,
            source=nxt.source,
            switched=SourceSwitched(old=name, new=nxt.name, reason="test"),
            switcher=self,
        )


def rotate_run(
    model: Any, drafters: dict[str, Any], prompt: list[int], n: int, sampling: SamplingParams, every: int
) -> tuple[list[int], list[RoundFinished], MlxTargetModel]:
    target = MlxTargetModel(model)
    for d in drafters.values():
        target.add_capture(d.target_layer_ids)
    lookup = LookupDraftSource(block=4)
    order = [Selection(name=PLAIN, source=None)] + [
        Selection(name=k, source=s)
        for k, s in (("dspark", drafters["dspark"]), ("lookup", lookup), ("dflash", drafters["dflash"]))
    ]
    start = Selection(name="dspark", source=drafters["dspark"], switcher=Rotate(order, every))
    out: list[int] = []
    rounds: list[RoundFinished] = []
    for ev in decode(
        target, prompt, sampling, StopRule(max_tokens=n, eos_ids=frozenset()), FakeClock(), selection=start
    ):
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
        elif isinstance(ev, RoundFinished):
            rounds.append(ev)
    return out, rounds, target


def test_forced_switches_keep_every_drafter_in_step(qwen3_target: Any, drafters: dict[str, Any]) -> None:
    expected = plain(qwen3_target, REPETITIVE, 60)
    out, rounds, _ = rotate_run(qwen3_target, drafters, REPETITIVE, 60, GREEDY, every=2)
    assert out == expected
    for kind in ("dspark", "dflash"):
        cache = drafters[kind].cache
        last = max(r.depth for r in rounds if r.source == kind and r.drafted)
        # Every committed row reached the drafter, in order and once: no gap reset its context (a gap
        # moves the first cached position off 0; a row twice raises), and it ends at its last anchor.
        assert cache._start == [0] * len(cache._start) and cache.offset == last
    sampled = SamplingParams(temperature=0.9, seed=3)
    a, _, _ = rotate_run(qwen3_target, drafters, REPETITIVE, 50, sampled, every=3)
    b, _, _ = rotate_run(qwen3_target, drafters, REPETITIVE, 50, sampled, every=3)
    assert a == b and len(a) == 50


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
def test_switching_never_exceeds_the_budget(qwen3_target: Any, drafters: dict[str, Any], n: int) -> None:
    for sampling in (GREEDY, SamplingParams(temperature=1.0, seed=n)):
        out, rounds, _ = rotate_run(qwen3_target, drafters, REPETITIVE, n, sampling, every=1)
        assert len(out) == n and sum(r.committed for r in rounds) == n - 1  # the first comes from prefill
    clock = ManualClock()
    target = target_for(qwen3_target, clock, drafters)
    lookup = ChargedSource(LookupDraftSource(block=5), clock, lambda _n: 0.0005)
    _, service, _ = auto(
        {"lookup": lookup, "dspark": ChargedSource(drafters["dspark"], clock, lambda _n: 0.002)}, {}, clock, target
    )
    assert run(service, target, REPETITIVE, n).generated_tokens == n
