"""The auto source rule on fake per-round costs and acceptances: it converges to the best of {plain, each
source} on the prompt, leaves a loser quickly, re-probes paused ones with exponential backoff, obeys a
cap policy's pause, and (property) never stays long on a source whose measured gain is below plain."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_dspark.domain.costmodel.arbiter import ArbiterConfig, SourceArbiter, Switch

PLAIN = "baseline"
CFG = ArbiterConfig()

# name -> (round index) -> (tokens per round, seconds per round)
World = Mapping[str, Callable[[int], tuple[float, float]]]


def steady(tokens: float, seconds: float) -> Callable[[int], tuple[float, float]]:
    return lambda _i: (tokens, seconds)


def simulate(
    arb: SourceArbiter,
    world: World,
    rounds: int,
    *,
    noise: float = 0.0,
    seed: int = 0,
    paused: Callable[[int, str], bool] = lambda i, name: False,
) -> tuple[list[str], list[Switch]]:
    """Run `rounds` rounds: the running candidate's round yields its (integer) tokens and seconds."""
    rng = random.Random(seed)
    ran: list[str] = []
    switches: list[Switch] = []
    for i in range(rounds):
        name = arb.running
        mean_tokens, seconds = world[name](i)
        # Whole tokens around the mean (a spec round commits 1..k+1), seconds with multiplicative noise.
        whole = math.floor(mean_tokens) + (1 if rng.random() < mean_tokens - math.floor(mean_tokens) else 0)
        arb.record(name, max(1, whole), seconds * (1 + noise * (2 * rng.random() - 1)))
        ran.append(name)
        sw = arb.decide(paused=paused(i, name))
        if sw is not None:
            assert sw.old == name and sw.new == arb.running != name
            switches.append(sw)
    return ran, switches


def test_a_losing_source_falls_back_to_plain_within_a_few_rounds() -> None:
    arb = SourceArbiter(["wrong", PLAIN], start="wrong", plain=PLAIN, priors={"wrong": 90.0, PLAIN: 20.0})
    # Drafts never right: one token per round, each round dearer than a plain step.
    ran, _switches = simulate(arb, {"wrong": steady(1, 0.06), PLAIN: steady(1, 0.05)}, 200)
    assert arb.home == PLAIN
    first = next(i for i, n in enumerate(ran) if n == PLAIN)
    assert first <= 1 + CFG.judge_after  # judged after its settle round and three measured rounds
    # Later re-probes are spaced exponentially: 16, 32, 64, ... rounds of plain between them; a drafter
    # within the noise of plain gets 3 x probe_rounds measured rounds a probe (its rounds vary).
    assert ran.count("wrong") <= first + 6 * (3 * CFG.probe_rounds + 1)
    gaps = _gaps(ran, "wrong")
    assert gaps == sorted(gaps) and len(gaps) >= 2 and gaps[-1] >= 1.8 * gaps[-2]
    assert arb.gain("wrong") is not None and arb.gain("wrong") < 1  # type: ignore[operator]


def _gaps(ran: list[str], name: str) -> list[int]:
    """Rounds between consecutive stints of `name`."""
    stints: list[list[int]] = []
    for i, n in enumerate(ran):
        if n == name:
            if stints and stints[-1][1] == i - 1:
                stints[-1][1] = i
            else:
                stints.append([i, i])
    return [b[0] - a[1] - 1 for a, b in itertools.pairwise(stints)]


def test_a_source_that_matches_well_is_kept() -> None:
    arb = SourceArbiter(["lookup", "dspark", PLAIN], start="lookup", plain=PLAIN)
    world = {"lookup": steady(3.0, 0.055), "dspark": steady(1.2, 0.07), PLAIN: steady(1, 0.05)}
    ran, _ = simulate(arb, world, 300, noise=0.1)
    assert arb.home == "lookup"
    assert ran.count("lookup") >= 0.9 * len(ran)
    assert arb.gain("lookup") == pytest.approx(3.0 * 0.05 / 0.055, rel=0.2)


def test_it_switches_to_a_better_source_it_had_not_tried() -> None:
    # The prior said lookup; on this prompt dspark is far better.
    arb = SourceArbiter(
        ["lookup", "dspark", PLAIN], start="lookup", plain=PLAIN, priors={"lookup": 30, "dspark": 25, PLAIN: 20}
    )
    world = {"lookup": steady(1.1, 0.052), "dspark": steady(3.5, 0.08), PLAIN: steady(1, 0.05)}
    ran, _switches = simulate(arb, world, 120)
    assert arb.home == "dspark"
    assert ran.index("dspark") < 20 and ran[-40:].count("dspark") >= 36


def test_mid_request_change_is_followed_both_ways() -> None:
    # Lookup pays while the answer repeats the prompt (rounds 0-99), then stops matching; later it pays again.
    def lookup(i: int) -> tuple[float, float]:
        return (4.0, 0.055) if i < 100 or i >= 250 else (1.0, 0.055)

    arb = SourceArbiter(["lookup", PLAIN], start="lookup", plain=PLAIN)
    ran, _ = simulate(arb, {"lookup": lookup, PLAIN: steady(1, 0.05)}, 420)
    assert ran[60:100].count("lookup") >= 36
    # After the change, lookup loses within a few rounds; while it loses plain runs.
    assert ran[100:250].count(PLAIN) >= 110
    # It pays again from round 250: a re-probe finds it within the (capped) backoff.
    back = next(i for i in range(250, len(ran)) if ran[i] == "lookup" and arb.rounds["lookup"])
    assert back - 250 <= 2 * 64 and ran[-40:].count("lookup") >= 36


def test_a_cap_policy_pause_moves_home_at_once_and_a_probe_is_judged_by_measurement() -> None:
    arb = SourceArbiter(["dspark", PLAIN], start="dspark", plain=PLAIN)
    # Its calibrated cost model pauses it on its first round; on this prompt it really is faster.
    ran, switches = simulate(
        arb, {"dspark": steady(1.5, 0.05), PLAIN: steady(1, 0.05)}, 120, paused=lambda i, n: n == "dspark" and i == 0
    )
    assert ran[:2] == ["dspark", PLAIN] and "paused by its cap policy" in switches[0].reason
    assert arb.home == "dspark" and ran[-60:].count("dspark") >= 50
    # A policy that keeps saying pause: home leaves every time; probes still run their measured rounds.
    arb = SourceArbiter(["dspark", PLAIN], start="dspark", plain=PLAIN)
    ran, switches = simulate(arb, {"dspark": steady(1.5, 0.05), PLAIN: steady(1, 0.05)}, 300, paused=lambda i, n: True)
    stints = _stints(ran, "dspark")
    assert stints[0] == 1 and all(s <= 1 + CFG.max_probe_rounds + 1 for s in stints)
    assert ran.count(PLAIN) > ran.count("dspark")


def test_plain_is_measured_early_so_gains_are_known() -> None:
    arb = SourceArbiter(["dspark", PLAIN], start="dspark", plain=PLAIN)
    simulate(arb, {"dspark": steady(2.0, 0.06), PLAIN: steady(1, 0.05)}, 20)
    assert arb.gain(PLAIN) == 1.0 and arb.gain("dspark") == pytest.approx(2.0 * 0.05 / 0.06)
    assert arb.home == "dspark" and arb.switches == 2  # one probe of plain and back


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        ArbiterConfig(judge_after=0)
    with pytest.raises(ValueError):
        ArbiterConfig(backoff=8, max_backoff=4)
    with pytest.raises(ValueError):
        SourceArbiter(["a"], start="b")


# (tokens per round, seconds per round) of each source; plain is 1 token in 0.05 s, and a round verifies
# at least one token, so it costs at least a plain step (up to 2.5 of them: a wide verify plus drafting).
SOURCES = st.lists(st.tuples(st.floats(1.0, 4.0), st.floats(0.05, 0.125)), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(
    sources=SOURCES,
    start=st.integers(0, 3),
    # Each prior is unknown or the candidate's true rate off by up to 30% (the race ran other prompts).
    priors=st.lists(st.one_of(st.none(), st.floats(0.7, 1.3)), min_size=4, max_size=4),
    noise=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 1000),
)
def test_property_never_long_on_a_source_below_plain(
    sources: list[tuple[float, float]], start: int, priors: list[float | None], noise: float, seed: int
) -> None:
    world: dict[str, Callable[[int], tuple[float, float]]] = {PLAIN: steady(1, 0.05)}
    for i, (tokens, seconds) in enumerate(sources):
        world[f"s{i}"] = steady(tokens, seconds)
    names = list(world)
    arb = SourceArbiter(
        names,
        start=names[start % len(names)],
        plain=PLAIN,
        priors={n: world[n](0)[0] / world[n](0)[1] * e for n, e in zip(names, priors, strict=False) if e is not None},
    )
    rounds = 600
    ran, _ = simulate(arb, world, rounds, noise=noise, seed=seed)
    true_rate = {n: world[n](0)[0] / world[n](0)[1] for n in names}
    plain_rate = true_rate[PLAIN]
    # A source clearly below plain (a gain under 0.8): its stints are spaced exponentially (a handful in
    # 600 rounds), each a bounded probe (or home's first judgment); one far below is dropped after the
    # shortest probe. Near ties are left to the throughput bound below: probing them costs little.
    for n in names:
        if true_rate[n] >= 0.8 * plain_rate:
            continue
        stints = _stints(ran, n)
        assert len(stints) <= 2 + math.ceil(math.log2(rounds / CFG.backoff)), (n, stints)
        # A drafting source within its own (wide) noise runs up to 3 x probe_rounds before "behind so far".
        longest = 1 + (CFG.max_probe_rounds if true_rate[n] > 0.6 * plain_rate else 3 * CFG.probe_rounds + 1)
        assert max(stints) <= max(longest, 1 + CFG.judge_after), (n, stints)
    # And it converges: exploration included, the run's throughput is close to the best candidate's.
    tokens = sum(world[n](0)[0] for n in ran)
    seconds = sum(world[n](0)[1] for n in ran)
    assert tokens / seconds >= 0.85 * max(true_rate.values()), (tokens / seconds, true_rate)


def _stints(ran: list[str], name: str) -> list[int]:
    """Lengths of the runs of consecutive rounds of `name`."""
    out: list[int] = []
    for i, n in enumerate(ran):
        if n == name:
            if i and ran[i - 1] == name:
                out[-1] += 1
            else:
                out.append(1)
    return out
