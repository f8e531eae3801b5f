"""Auto's forecasting rule on fake rounds: the cost book learns seconds per round, lookup's replay is exactly
what lookup would have done, and the arbiter runs the best forecast: it leaves a loser after a few rounds,
never runs plain decoding or lookup just to learn their rates, gives an unmeasured drafter one first look,
obeys a cap policy's pause and (property) ends on a candidate within the margin of the best."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_dspark.domain.costmodel.forecast import CostBook, ForecastArbiter, ForecastConfig, Switch
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.drafting.lookup import LookupDraftSource, ShadowLookup
from mlx_dspark.domain.tokens import SamplingParams

PLAIN = "baseline"
CFG = ForecastConfig()

# name -> (tokens per round, seconds per round, drafts per round)
World = Mapping[str, tuple[float, float, int]]


def book(seconds: Mapping[str, float]) -> CostBook:
    """A cost book whose seeds are exact (`seconds[name]` per round whatever the drafts), every round timed once
    already in the process (as after the first requests)."""
    costs = CostBook(lambda name, drafted: seconds[name])
    for name, s in seconds.items():
        costs.observe(name, 0, s)
    return costs


def simulate(
    arb: ForecastArbiter,
    world: World,
    rounds: int,
    *,
    shadow: World | None = None,
    seed: int = 0,
    paused: Callable[[int, str], bool] = lambda i, name: False,
) -> tuple[list[str], list[Switch]]:
    """Run `rounds` rounds: the running candidate's round yields whole tokens around its mean; shadowed
    candidates get a replayed round of theirs after every round."""
    rng = random.Random(seed)
    ran: list[str] = []
    switches: list[Switch] = []

    def whole(mean: float) -> int:
        return max(1, math.floor(mean) + (1 if rng.random() < mean - math.floor(mean) else 0))

    for i in range(rounds):
        name = arb.running
        tokens, seconds, drafted = world[name]
        arb.record(name, whole(tokens), seconds, drafted)
        for other, (t, _s, d) in (shadow or {}).items():
            arb.shadow(other, whole(t), d)
        ran.append(name)
        sw = arb.decide(paused=paused(i, name))
        if sw is not None:
            assert sw.old == name and sw.new == arb.running != name
            switches.append(sw)
    return ran, switches


# ---- the cost book


def test_the_cost_book_starts_at_its_seed_and_learns_each_width() -> None:
    costs = CostBook(lambda name, drafted: 0.05 + 0.01 * drafted, known=2)
    assert costs.seconds("d", 3) == pytest.approx(0.08) and not costs.knows("d")
    costs.observe("d", 3, 0.16)
    # One round teaches every width of its source by its ratio to the seed (2x here).
    assert costs.knows("d") and costs.seconds("d", 3) == pytest.approx(0.16)
    assert costs.seconds("d", 7) == pytest.approx(0.12 * 2)
    costs.observe("d", 3, 0.08)
    # Measured `known` times, a width costs the median of its own rounds; the others the median ratio.
    assert costs.seconds("d", 3) == pytest.approx(0.12)
    assert costs.seconds("d", 7) == pytest.approx(0.12 * 1.5)
    assert costs.seconds("other", 3) == pytest.approx(0.08)  # another source keeps its seed


def test_one_stalled_round_does_not_move_the_cost_book() -> None:
    costs = CostBook(lambda name, drafted: 0.01, window=9)
    for seconds in (0.01, 0.011, 2.0, 0.0105, 0.0098):  # a 2 s stall among 10 ms rounds
        costs.observe("d", 7, seconds)
    assert costs.seconds("d", 7) == pytest.approx(0.0105)
    assert costs.seconds("d", 1) == pytest.approx(0.0105)  # nor the widths it teaches
    for _ in range(9):  # a lasting change is learned within half the window
        costs.observe("d", 7, 0.03)
    assert costs.seconds("d", 7) == pytest.approx(0.03)


def test_a_stall_inside_a_drafters_stint_does_not_make_auto_leave_it() -> None:
    costs = book({"d": 0.01, PLAIN: 0.005})
    arb = ForecastArbiter(["d", PLAIN], start="d", plain=PLAIN, priors={"d": 300.0}, costs=costs)
    for seconds in (0.01, 0.01, 0.5, 0.01, 0.01):  # 3 tokens a round: 300 tok/s against plain's 200
        arb.record("d", 3, seconds, 7)
        assert arb.decide() is None
    assert arb.forecast("d") == pytest.approx(300.0)


def test_a_frozen_cost_book_never_learns() -> None:
    frozen = CostBook(lambda name, drafted: 0.05 * (drafted + 1), frozen=True)
    frozen.observe("d", 1, 5.0)
    frozen.observe("d", 2, 5.0)
    assert frozen.seconds("d", 1) == pytest.approx(0.1) and frozen.seconds("d", 2) == pytest.approx(0.15)
    assert frozen.knows("d") is False


# ---- lookup's replay


def lookup_rounds(sequence: Sequence[int], prompt_len: int, block: int) -> list[tuple[int, int]]:
    """What LookupDraftSource's greedy rounds commit on `sequence` when the target's greedy output is the
    rest of it (the first token after the prompt comes from the prefill): (committed, drafted) per round."""
    source = LookupDraftSource(block=block)
    source.begin(sequence[:prompt_len])
    history = list(sequence[: prompt_len + 1])
    out = []
    while len(history) < len(sequence):
        ctx = DraftContext(anchor=history[-1], position=len(history), history=history, features=None)
        draft = source.propose(ctx, block, SamplingParams(), []).tokens
        truth = sequence[len(history) :]
        accepted = 0
        while accepted < len(draft) and accepted < len(truth) and draft[accepted] == truth[accepted]:
            accepted += 1
        if accepted == len(truth):  # the sequence ends inside the block: no bonus token to compare
            break
        out.append((accepted + 1, len(draft)))
        history.extend(truth[: accepted + 1])
    return out


@settings(max_examples=60, deadline=None)
@given(
    seq=st.lists(st.integers(0, 4), min_size=6, max_size=120),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=40),
    block=st.integers(1, 8),
)
def test_the_replay_is_what_lookup_would_have_committed(seq: list[int], chunks: list[int], block: int) -> None:
    prompt_len = len(seq) // 3
    expected = lookup_rounds(seq, prompt_len, block)
    # The replay hears the history in whatever rounds the running source happened to commit.
    shadow = ShadowLookup(block)
    got: list[tuple[int, int]] = []
    seen = prompt_len + 1
    i = 0
    while seen < len(seq):
        step = min(chunks[i % len(chunks)], len(seq) - seen)
        seen += step
        got.extend(shadow.advance(seq[:seen], start=prompt_len + 1))
        i += 1
    # Rounds the history decided are exact; at most the last, still undecided one is missing.
    assert got == expected[: len(got)] and len(expected) - len(got) <= 1


def test_lookup_sources_offer_their_replay() -> None:
    shadow = LookupDraftSource(block=4).shadow()
    history = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 9]
    # At 5 the suffix (9, 1) was never seen before: no draft. At 6, (1, 2) continues as [3, 9, 1, 2]: all
    # four match and 3 follows. At 11 the draft [9, 1, 2, 3] has only its first token decided: not yet.
    assert shadow.advance(history, start=5) == [(1, 0), (5, 4)]


# ---- the arbiter


def test_a_losing_drafter_falls_back_to_plain_within_a_few_rounds() -> None:
    arb = ForecastArbiter(
        ["wrong", PLAIN], start="wrong", plain=PLAIN, priors={"wrong": 90.0}, costs=book({"wrong": 0.08, PLAIN: 0.05})
    )
    ran, switches = simulate(arb, {"wrong": (1, 0.08, 4), PLAIN: (1, 0.05, 0)}, 200)
    # The first round pays the switch, `settle` more are judged, then plain decoding runs.
    assert ran[: 1 + CFG.settle] == ["wrong"] * (1 + CFG.settle) and ran[1 + CFG.settle] == PLAIN
    assert ran.count(PLAIN) >= 0.9 * len(ran)
    assert "wrong" in switches[0].reason and switches[0].new == PLAIN


def test_plain_decoding_is_forecast_never_run_to_learn() -> None:
    arb = ForecastArbiter(["d", PLAIN], start="d", plain=PLAIN, priors={"d": 30.0}, costs=book({"d": 0.1, PLAIN: 0.05}))
    ran, switches = simulate(arb, {"d": (3.0, 0.1, 6), PLAIN: (1, 0.05, 0)}, 300)
    assert ran == ["d"] * 300 and switches == []
    assert arb.plain_rate() == pytest.approx(20.0) and PLAIN not in arb.measured()


def test_replayed_lookup_is_taken_without_a_probe_and_a_poor_one_never_runs() -> None:
    names = ["d", "lookup", PLAIN]
    costs = {"d": 0.1, "lookup": 0.06, PLAIN: 0.05}
    world = {"d": (2.0, 0.1, 6), "lookup": (4.0, 0.06, 7), PLAIN: (1, 0.05, 0)}
    good = ForecastArbiter(names, start="d", plain=PLAIN, shadowed={"lookup"}, priors={"d": 20.0}, costs=book(costs))
    ran, switches = simulate(good, world, 100, shadow={"lookup": world["lookup"]})
    # Lookup's replayed rounds (66 tok/s against 20) move the request after d's first judged rounds.
    assert switches[0].new == "lookup" and "replayed" in switches[0].reason
    assert ran.index("lookup") == 1 + CFG.settle and ran.count("lookup") >= 90
    poor = ForecastArbiter(names, start="d", plain=PLAIN, shadowed={"lookup"}, priors={"d": 20.0}, costs=book(costs))
    ran, _ = simulate(poor, world, 200, shadow={"lookup": (1.1, 0.06, 1)})
    assert "lookup" not in ran and "lookup" in poor.measured()


def test_plain_decoding_gets_one_look_until_its_step_was_timed_in_the_process() -> None:
    # The calibration priced a plain step at 80 ms; pipelined, it takes 50 (a GPU's host work hidden).
    costs = CostBook(lambda name, drafted: {"d": 0.1, PLAIN: 0.08}[name])
    world = {"d": (1.6, 0.1, 6), PLAIN: (1, 0.05, 0)}  # d 16 tok/s, plain 20
    arb = ForecastArbiter(["d", PLAIN], start="d", plain=PLAIN, priors={"d": 16.0}, costs=costs)
    ran, switches = simulate(arb, world, 100)
    assert "first look" in switches[0].reason and switches[0].new == PLAIN
    assert costs.knows(PLAIN) and ran.count(PLAIN) >= 90  # timed once, it is known to win
    again = ForecastArbiter(["d", PLAIN], start="d", plain=PLAIN, priors={"d": 16.0}, costs=costs)
    ran, switches = simulate(again, world, 40)
    assert "first look" not in switches[0].reason  # the next request knows plain's step


def test_an_unmeasured_drafter_gets_one_first_look_when_its_prior_is_close() -> None:
    costs = book({"a": 0.1, "b": 0.1, PLAIN: 0.05})
    world = {"a": (3.0, 0.1, 6), "b": (2.6, 0.1, 6), PLAIN: (1, 0.05, 0)}  # a 30, b 26 tok/s
    arb = ForecastArbiter(["a", "b", PLAIN], start="a", plain=PLAIN, priors={"a": 30.0, "b": 28.0}, costs=costs)
    ran, switches = simulate(arb, world, 300)
    assert switches[0].new == "b" and "first look" in switches[0].reason
    # b measures worse than a but within the margin: the request stays on it, a near tie costs little.
    assert ran.count("b") >= 1 + CFG.settle
    far = ForecastArbiter(["a", "b", PLAIN], start="a", plain=PLAIN, priors={"a": 30.0, "b": 10.0}, costs=costs)
    ran, _ = simulate(far, world, 300)
    assert "b" not in ran  # a prior far below what runs gets no look


def test_a_drafter_that_lost_is_looked_at_again_ever_more_rarely() -> None:
    costs = book({"d": 0.1, PLAIN: 0.05})
    # The race thought d great; on this prompt it commits one token a round.
    arb = ForecastArbiter(["d", PLAIN], start="d", plain=PLAIN, priors={"d": 60.0}, costs=costs)
    ran, _ = simulate(arb, {"d": (1.0, 0.1, 6), PLAIN: (1, 0.05, 0)}, 2000)
    stints = [i for i in range(1, len(ran)) if ran[i] == "d" and ran[i - 1] != "d"]
    gaps = [b - a for a, b in itertools.pairwise(stints)]
    assert 1 <= len(stints) <= 6 and all(b > a for a, b in itertools.pairwise(gaps))
    assert ran.count(PLAIN) >= 0.95 * len(ran)


def test_a_cap_policy_pause_moves_the_request_at_once() -> None:
    costs = book({"d": 0.1, "e": 0.1, PLAIN: 0.05})
    arb = ForecastArbiter(["d", "e", PLAIN], start="d", plain=PLAIN, priors={"d": 40.0, "e": 30.0}, costs=costs)
    arb.record("d", 3, 0.1, 6)
    sw = arb.decide(paused=True)
    assert sw is not None and sw.new == "e" and "cap policy" in sw.reason


def test_the_running_drafter_scales_the_other_drafters_forecast() -> None:
    forecasts = {}
    for shrink in (2.0, 0.0):
        costs = book({"a": 0.1, "b": 0.1, PLAIN: 0.05})
        arb = ForecastArbiter(
            ["a", "b", PLAIN],
            start="a",
            plain=PLAIN,
            priors={"a": 30.0, "b": 30.0},
            acceptance={"a": 3.0, "b": 3.0},
            costs=costs,
            config=ForecastConfig(prior_rounds=shrink),
        )
        for _ in range(4):
            arb.record("a", 6, 0.1, 6)  # twice its usual tokens: an easy prompt for drafters
        forecasts[shrink] = (arb.forecast("a"), arb.forecast("b"))
    # 4 rounds at 6 tokens shrunk towards its earlier 3 by 2 pseudo-rounds: 5 tokens, 5/3 of b's prior; unshrunk 6.
    assert forecasts[2.0] == pytest.approx((50.0, 50.0))
    assert forecasts[0.0] == pytest.approx((60.0, 60.0))
    assert ForecastArbiter(["a"], start="a", costs=costs).forecast("a") == pytest.approx(0.0)


def test_bad_config_and_start_are_refused() -> None:
    with pytest.raises(ValueError):
        ForecastConfig(settle=0)
    with pytest.raises(ValueError):
        ForecastConfig(alpha=0.0)
    with pytest.raises(ValueError):
        ForecastConfig(look=1.5)
    with pytest.raises(ValueError):
        ForecastArbiter(["a"], start="b", costs=book({"a": 1.0}))


@settings(max_examples=80, deadline=None)
@given(
    rates=st.lists(st.tuples(st.floats(1.0, 6.0), st.floats(0.05, 0.3)), min_size=1, max_size=3),
    # Priors from other prompts: up to twice the truth, or below it by less than the first look allows.
    prior_scale=st.lists(st.floats(0.75, 2.0), min_size=3, max_size=3),
    start=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_it_ends_within_the_margin_of_the_best_candidate(
    rates: list[tuple[float, float]], prior_scale: list[float], start: int, seed: int
) -> None:
    world: dict[str, tuple[float, float, int]] = {PLAIN: (1, 0.05, 0)}
    for i, (tokens, seconds) in enumerate(rates):
        world[f"d{i}"] = (tokens, seconds, 6)
    names = list(world)
    truth = {n: t / s for n, (t, s, _d) in world.items()}
    priors = {n: truth[n] * prior_scale[i % 3] for i, n in enumerate(names) if n != PLAIN}
    arb = ForecastArbiter(
        names,
        start=names[start % len(names)],
        plain=PLAIN,
        priors=priors,
        costs=book({n: s for n, (_t, s, _d) in world.items()}),
        config=ForecastConfig(relax=10_000),  # no re-looks: what it settles on is its verdict
    )
    ran, _ = simulate(arb, world, 600, seed=seed)
    best = max(truth.values())
    # Whole-token rounds scatter the measurements, so allow the margin and the EWMA's noise.
    assert truth[ran[-1]] >= best / (1 + CFG.margin) * 0.8
    tail = ran[300:]
    assert sum(truth[n] for n in tail) / len(tail) >= best / (1 + CFG.margin) * 0.8


def test_a_stints_first_round_counts_its_tokens_but_not_its_seconds() -> None:
    # The first round after a switch pays the switch (a catch-up, a first-use compile on a GPU): its seconds
    # would make the source look slow, but the tokens it committed are this prompt's evidence like any other.
    costs = book({"a": 0.1, PLAIN: 0.05})
    arb = ForecastArbiter(["a", PLAIN], start="a", plain=PLAIN, priors={"a": 30.0}, costs=costs)
    arb.record("a", 8, 5.0, 6)  # a stalled first round
    assert arb.forecast("a") == pytest.approx(80.0)  # 8 tokens at the book's 0.1 s
    assert costs.seconds("a", 6) == pytest.approx(0.1)  # the stall taught the book nothing
    assert arb.decide() is None  # and it was no measured round of the stint: no verdict yet
    # A source the book never timed: its seconds would be a seed, so its first round teaches nothing yet.
    fresh = CostBook(lambda name, drafted: 1.0)
    new = ForecastArbiter(["a", PLAIN], start="a", plain=PLAIN, priors={"a": 30.0}, costs=fresh)
    new.record("a", 8, 5.0, 6)
    assert new.forecast("a") == pytest.approx(30.0) and new.measured() == {}
