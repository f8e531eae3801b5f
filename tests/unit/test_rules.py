"""Budget, stop strings, lookup index, confidence truncation and settings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.budget import plan_commit, round_cap
from mlx_dspark.domain.drafting.confidence import confident_prefix_length
from mlx_dspark.domain.drafting.lookup import NgramIndex
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.stops import StopStringMatcher
from mlx_dspark.domain.tokens import FinishReason, SamplingParams, StopRule


@given(
    candidates=st.lists(st.integers(0, 9), min_size=1, max_size=9),
    generated=st.integers(0, 20),
    extra=st.integers(1, 20),
    eos=st.sets(st.integers(0, 9), max_size=2),
)
def test_plan_commit_never_exceeds_budget_and_stops_at_first_eos(candidates, generated, extra, eos):
    rule = StopRule(max_tokens=generated + extra, eos_ids=frozenset(eos))
    plan = plan_commit(candidates, generated, rule)
    assert generated + len(plan.tokens) <= rule.max_tokens
    assert not set(plan.tokens) & eos
    assert list(plan.tokens) == candidates[: len(plan.tokens)]
    first_eos = next((i for i, t in enumerate(candidates) if t in eos), None)
    if first_eos is not None and first_eos <= extra:
        assert plan.finish is FinishReason.STOP and len(plan.tokens) == min(first_eos, extra)
    elif generated + len(plan.tokens) == rule.max_tokens:
        assert plan.finish is FinishReason.LENGTH
    else:
        assert plan.finish is None and len(plan.tokens) == len(candidates)
    assert plan.keep_rows == len(plan.tokens)


def test_round_cap_leaves_room_for_the_bonus_token():
    assert round_cap(7, 1) == 0
    assert round_cap(7, 3) == 2
    assert round_cap(4, 100) == 4


@pytest.mark.parametrize("chunks", [["Hello wor", "ld STOP here"], ["Hello world S", "T", "OP"], ["Hello world STOP"]])
def test_stop_strings_are_matched_across_chunks_and_never_leak(chunks):
    m = StopStringMatcher(["STOP", "END"])
    shown, matched = "", None
    for c in chunks:
        r = m.feed(c)
        shown += r.emit
        matched = matched or r.matched
    assert shown == "Hello world "
    assert matched == "STOP"


def test_held_back_text_is_flushed_when_no_stop_completes():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST").emit == "abc "
    assert m.flush() == "ST"


def test_earliest_stop_wins():
    m = StopStringMatcher(["b c", "a"])
    r = m.feed("x a b c")
    assert (r.emit, r.matched) == ("x ", "a")


def test_ngram_index_continues_the_latest_longest_match():
    idx = NgramIndex(min_n=2, max_n=3)
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert idx.continuation(seq, 3) == [5, 7, 1]
    assert idx.continuation([1, 2], 3) == []
    assert NgramIndex().continuation([5, 6, 5, 6], 4) == [5, 6]


def test_confidence_truncation_is_a_running_product():
    assert confident_prefix_length([0.9, 0.9, 0.5, 0.9], 0.5) == 2
    assert confident_prefix_length([0.1, 0.9], 0.5) == 1
    assert confident_prefix_length([0.9, 0.9], 0.0) == 2


def test_settings_layering_env_then_flags():
    s = load_settings({"port": 9001}, {"MLX_DSPARK_PORT": "9000", "MLX_DSPARK_MODE": "lookup"})
    assert s.server.port == 9001
    assert s.model.mode == "lookup"
    with pytest.raises(InvalidRequest, match="mode"):
        load_settings({"mode": "turbo"}, {})
    with pytest.raises(InvalidRequest, match="port"):
        load_settings({}, {"MLX_DSPARK_PORT": "eighty"})


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(temperature=float("nan"))])
def test_sampling_params_reject_bad_values(kw):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kw)


def test_stop_rule_rejects_zero_budget():
    with pytest.raises(InvalidRequest):
        StopRule(max_tokens=0)
