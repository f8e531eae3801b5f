"""Reference acceptance rules: greedy prefix, and speculative sampling reproducing the target exactly."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.distribution import distribution, sample_index
from mlx_dspark.domain.verification.greedy import longest_accepted_prefix
from mlx_dspark.domain.verification.sampled import speculative_accept
from tests.stats import chi_square_p_value


def test_greedy_prefix_and_bonus():
    v = longest_accepted_prefix([3, 4, 5], [3, 4, 9, 1])
    assert (v.accepted, v.next_token) == (2, 9)
    v = longest_accepted_prefix([3, 4], [3, 4, 7])
    assert (v.accepted, v.next_token) == (2, 7)
    v = longest_accepted_prefix([], [6])
    assert (v.accepted, v.next_token) == (0, 6)
    with pytest.raises(ValueError):
        longest_accepted_prefix([1], [1])


@given(st.lists(st.floats(-5, 5), min_size=2, max_size=12), st.floats(0.1, 3), st.integers(0, 12), st.floats(0.05, 1))
def test_distribution_is_normalized_and_truncated(logits, t, k, p):
    d = distribution(logits, SamplingParams(temperature=t, top_k=k, top_p=p))
    assert abs(sum(d) - 1) < 1e-9
    support = sum(1 for x in d if x > 0)
    if 0 < k < len(logits):
        assert support <= k
    assert support >= 1


def test_greedy_distribution_is_one_hot_argmax():
    d = distribution([0.1, 2.0, 2.0, -1], SamplingParams())
    assert d == [0.0, 1.0, 0.0, 0.0]


P = [0.5, 0.3, 0.15, 0.05]
PAIRS = {
    "q-equals-p": ([0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]),
    "q-far-from-p": ([0.5, 0.3, 0.15, 0.05], [0.02, 0.03, 0.05, 0.9]),
    "q-uniform": ([0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]),
    "q-missing-support": ([0.4, 0.4, 0.2, 0.0], [0.0, 0.1, 0.0, 0.9]),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_one_step_speculative_sampling_reproduces_the_target(name):
    p, q = PAIRS[name]
    rng = random.Random(1234)
    counts = [0] * len(p)
    for _ in range(6000):
        x = sample_index(q, rng.random())
        verdict = speculative_accept([x], [p, p], [q], [rng.random(), rng.random()])
        token = x if verdict.accepted == 1 else verdict.next_token
        counts[token] += 1
    assert chi_square_p_value(counts, p) > 1e-3


def test_one_hot_proposals_reproduce_the_target():
    # A deterministic drafter that always proposes token 3 (low target mass): still exact.
    p = [0.6, 0.25, 0.1, 0.05]
    rng = random.Random(7)
    counts = [0] * 4
    for _ in range(6000):
        verdict = speculative_accept([3], [p, p], None, [rng.random(), rng.random()])
        counts[3 if verdict.accepted == 1 else verdict.next_token] += 1
    assert chi_square_p_value(counts, p) > 1e-3


def test_two_token_block_reproduces_the_joint_distribution():
    # Target: p(x1), then p(x2 | x1) depends on x1; drafter q ignores context.
    p1 = [0.6, 0.3, 0.1]
    p2 = {0: [0.1, 0.8, 0.1], 1: [0.5, 0.25, 0.25], 2: [0.2, 0.2, 0.6]}
    q = [0.2, 0.2, 0.6]
    rng = random.Random(99)
    counts = [0] * 9
    for _ in range(9000):
        d1, d2 = sample_index(q, rng.random()), sample_index(q, rng.random())
        v = speculative_accept([d1, d2], [p1, p2[d1], p2[d1]], [q, q], [rng.random() for _ in range(3)])
        if v.accepted == 0:
            x1 = v.next_token
            x2 = sample_index(p2[x1], rng.random())  # next round, plain step
        elif v.accepted == 1:
            x1, x2 = d1, v.next_token
        else:
            x1, x2 = d1, d2
        counts[3 * x1 + x2] += 1
    joint = [p1[a] * p2[a][b] for a in range(3) for b in range(3)]
    assert chi_square_p_value(counts, joint) > 1e-3


def test_a_wrong_rule_is_caught_by_the_statistical_check():
    # Guard that the chi-square check has power: accepting every draft blindly is biased.
    p, q = PAIRS["q-far-from-p"]
    rng = random.Random(5)
    counts = [0] * 4
    for _ in range(6000):
        counts[sample_index(q, rng.random())] += 1
    assert chi_square_p_value(counts, p) < 1e-6
