"""The decode loop: greedy speculative output equals plain greedy output, budgets, EOS, rollback."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_dspark.application.engine import decode
from mlx_dspark.domain.events import Finished
from mlx_dspark.domain.tokens import FinishReason, SamplingParams, StopRule
from tests.decoding import collect
from tests.fakes.clock import FakeClock
from tests.fakes.drafts import RandomDraftSource, ScriptedDraftSource
from tests.fakes.oracle import OracleTarget

GREEDY = SamplingParams()


def run(target, prompt, stop, source=None, sampling=GREEDY, **kw):
    def cache_is_plain(tokens):
        # After every commit the cache holds exactly what plain decoding would hold.
        assert target.rows == [*prompt, *tokens][:-1]

    return collect(
        decode(target, prompt, sampling, stop, FakeClock(), source=source, **kw), after_commit=cache_is_plain
    )


def plain(prompt, stop, vocab=16, context=2):
    return run(OracleTarget(vocab=vocab, context=context), prompt, stop)


patterns = st.sampled_from(["all", "none", "alternate", "first-only", "random"])


def right_fn(kind: str, seed: int):
    rng = random.Random(seed)
    table: dict[tuple[int, int], bool] = {}

    def right(r: int, i: int) -> bool:
        if kind == "all":
            return True
        if kind == "none":
            return False
        if kind == "alternate":
            return (r + i) % 2 == 0
        if kind == "first-only":
            return i == 0
        return table.setdefault((r, i), rng.random() < 0.6)

    return right


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 15), min_size=1, max_size=8),
    pattern=patterns,
    seed=st.integers(0, 10_000),
    cap=st.integers(1, 8),
    max_tokens=st.integers(1, 40),
    eos=st.one_of(st.none(), st.integers(0, 15)),
)
def test_greedy_speculative_equals_plain(prompt, pattern, seed, cap, max_tokens, eos):
    stop = StopRule(max_tokens=max_tokens, eos_ids=frozenset() if eos is None else frozenset({eos}))
    expected, _, exp_fin = plain(prompt, stop)
    target = OracleTarget()
    source = ScriptedDraftSource(target, right_fn(pattern, seed), block=cap)
    got, rounds, fin = run(target, prompt, stop, source=source)
    assert got == expected
    assert fin.reason == exp_fin.reason
    assert len(got) <= max_tokens
    assert all(r.drafted <= cap for r in rounds)
    if eos is not None:
        assert eos not in got


def test_budget_never_overshoots_with_an_always_right_drafter():
    # The peer returned 9/17/25/41 tokens for 5/13/21/34 asked at cap 7.
    for asked in (5, 13, 21, 34):
        target = OracleTarget()
        source = ScriptedDraftSource(target, block=7)
        got, _rounds, fin = run(target, [1, 2, 3], StopRule(max_tokens=asked), source=source)
        assert len(got) == asked
        assert fin.reason is FinishReason.LENGTH
        assert fin.usage.generated_tokens == asked


def test_eos_inside_an_accepted_block_ends_generation_there():
    target = OracleTarget()
    prompt = [4, 5]
    continuation = target.greedy_continuation(prompt, 30)
    eos = continuation[6]
    cut = continuation.index(eos)
    source = ScriptedDraftSource(target, block=8)
    got, _, fin = run(target, prompt, StopRule(max_tokens=30, eos_ids=frozenset({eos})), source=source)
    assert got == continuation[:cut]
    assert fin.reason is FinishReason.STOP


def test_mean_accepted_counts_the_bonus_and_not_the_prefill_token():
    target = OracleTarget()
    source = ScriptedDraftSource(target, block=3)
    _, rounds, fin = run(target, [1], StopRule(max_tokens=13), source=source)
    # 1 token from prefill, then 3 rounds of 3 drafts + bonus = 12.
    assert [r.committed for r in rounds] == [4, 4, 4]
    assert fin.usage.mean_accepted == 4.0
    assert fin.usage.rounds == 3


def test_rollback_trims_exactly_the_rejected_rows():
    target = OracleTarget()
    source = ScriptedDraftSource(target, lambda r, i: i < 2, block=5)
    run(target, [3, 1, 4], StopRule(max_tokens=20), source=source)
    # Each full round verifies 6 rows, keeps anchor + 2 accepted: 3 trimmed.
    assert target.trims[0] == 3


def test_random_drafts_are_still_lossless():
    stop = StopRule(max_tokens=30)
    expected, _, _ = plain([7, 7, 7], stop)
    target = OracleTarget()
    got, _, _ = run(target, [7, 7, 7], stop, source=RandomDraftSource(16, block=6, seed=3))
    assert got == expected


def test_features_reach_the_drafter_only_for_committed_rows():
    target = OracleTarget()
    source = ScriptedDraftSource(target, lambda r, i: i == 0, block=4)
    prompt = [2, 9, 4]
    got, _, _ = run(target, prompt, StopRule(max_tokens=12), source=source)
    history = [*prompt, *got]
    seen = source.features_seen
    assert [pos for pos, _ in seen] == list(range(len(seen)))
    assert [tok for _, tok in seen] == history[: len(seen)]


def test_lookup_drafts_are_lossless_and_get_accepted_on_repetitive_text():
    from mlx_dspark.domain.drafting.lookup import LookupDraftSource

    stop = StopRule(max_tokens=60)
    # context=1 makes the oracle's greedy output cycle quickly, which lookup should exploit.
    expected, _, _ = run(OracleTarget(context=1), [1, 2, 3], stop)
    target = OracleTarget(context=1)
    got, _rounds, fin = run(target, [1, 2, 3], stop, source=LookupDraftSource(block=6))
    assert got == expected
    assert fin.usage.accepted > 0
    assert fin.usage.rounds < len(expected) - 1


def test_plain_decoding_accepts_exactly_one_token_per_round_even_when_eos_ends_it():
    target = OracleTarget()
    continuation = target.greedy_continuation([4, 5], 30)
    eos = continuation[5]
    _, _, fin = run(OracleTarget(), [4, 5], StopRule(max_tokens=30, eos_ids=frozenset({eos})))
    assert fin.reason is FinishReason.STOP
    assert fin.usage.mean_accepted == 1.0


def test_plain_mode_hands_the_next_steps_uniform_ahead_in_draw_order() -> None:
    """`ahead` is the uniform the next plain round then uses; none is offered past the budget."""
    target = OracleTarget(vocab=16, context=2)
    sampling = SamplingParams(temperature=0.8, seed=3)
    events = list(decode(target, [1, 2, 3], sampling, StopRule(max_tokens=6, eos_ids=frozenset()), FakeClock()))
    assert isinstance(events[-1], Finished)
    calls = target.calls
    assert len(calls) == 5  # the prefill token + 5 plain rounds = 6 tokens
    for (_, _, ahead), (drafts, uniforms, _) in itertools.pairwise(calls):
        assert drafts == 0 and uniforms == (ahead,)
    assert calls[-1][2] is None  # the last round is known to end the request
    assert target.captures == [False]  # plain decoding records no features


def test_speculative_rounds_never_queue_ahead_and_capture_features_for_drafters() -> None:
    target = OracleTarget(vocab=16, context=2)
    source = ScriptedDraftSource(target, lambda r, i: i < 2, block=4)
    list(
        decode(
            target,
            [1, 2, 3],
            SamplingParams(),
            StopRule(max_tokens=12, eos_ids=frozenset()),
            FakeClock(),
            source=source,
        )
    )
    assert all(ahead is None for _, _, ahead in target.calls)
    assert target.captures == [source.uses_features]
