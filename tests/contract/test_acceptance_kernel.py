"""The MLX acceptance fast path gives exactly the domain reference's verdicts, and the target's distribution."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from mlx_dspark.adapters.mlx import acceptance
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.distribution import argmax, distribution, sample_index
from mlx_dspark.domain.verification.greedy import longest_accepted_prefix
from mlx_dspark.domain.verification.sampled import speculative_accept
from tests.stats import chi_square_p_value

SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-topk5": SamplingParams(temperature=0.7, top_k=5),
    "t1.3-topp0.8": SamplingParams(temperature=1.3, top_p=0.8),
    "t0.9-topk7-topp0.6": SamplingParams(temperature=0.9, top_k=7, top_p=0.6),
    "t2-topk1": SamplingParams(temperature=2.0, top_k=1),
}


def f32(values):
    """Python floats rounded to float32, so host and device see the same numbers."""
    return mx.array(values, dtype=mx.float32).tolist()


def random_logits(rng: random.Random, rows: int, vocab: int, ties: bool) -> list[list[float]]:
    out = []
    for _ in range(rows):
        if ties:  # coarse values: many exact ties, which top-k/top-p must break by index
            out.append(f32([float(rng.randrange(-4, 5)) / 2 for _ in range(vocab)]))
        else:
            out.append(f32([rng.gauss(0, 2.5) for _ in range(vocab)]))
    return out


def random_q(rng: random.Random, rows: int, vocab: int, far_from: list[list[float]]) -> list[list[float]]:
    """Proposals concentrated on the target's least likely tokens (q far from p), some with holes."""
    out = []
    for r in range(rows):
        low = sorted(range(vocab), key=lambda i: far_from[r][i])[: max(2, vocab // 4)]
        w = [rng.random() * 0.01 if rng.random() < 0.7 else 0.0 for _ in range(vocab)]
        for i in low:
            w[i] += rng.random() * 5
        z = sum(w)
        out.append(f32([x / z for x in w]))
    return out


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_truncated_probs_match_the_reference(name, ties):
    sampling = SETTINGS[name]
    rng = random.Random(sorted(SETTINGS).index(name) * 2 + ties)
    logits = random_logits(rng, 40, 24, ties)
    got = acceptance.truncated_probs(mx.array(logits), sampling).tolist()
    for row, fast in zip(logits, got, strict=True):
        ref = distribution(row, sampling)
        assert [x > 0 for x in fast] == [x > 0 for x in ref]
        assert fast == pytest.approx(ref, abs=1e-6)


@pytest.mark.parametrize("q_kind", ["one-hot", "far"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_sampled_verdicts_equal_the_reference(name, q_kind):
    sampling = SETTINGS[name]
    rng = random.Random(100 + sorted(SETTINGS).index(name) * 2 + (q_kind == "far"))
    vocab = 16
    for case in range(150):
        k = rng.randrange(0, 6)
        logits = random_logits(rng, k + 1, vocab, ties=case % 3 == 0)
        p_rows = [distribution(row, sampling) for row in logits]
        q_rows = None if q_kind == "one-hot" else random_q(rng, k, vocab, logits)
        # Drafts mostly from q (or from p for one-hot), sometimes arbitrary, to exercise both branches.
        drafts = []
        for i in range(k):
            source = p_rows[i] if q_rows is None else q_rows[i]
            drafts.append(sample_index(source, rng.random()) if rng.random() < 0.8 else rng.randrange(vocab))
        uniforms = f32([rng.random() for _ in range(k + 1)])
        expected = speculative_accept(drafts, p_rows, q_rows, uniforms)
        got = acceptance.accept_block(
            mx.array(logits),
            mx.array(drafts, dtype=mx.int32),
            acceptance.as_q_rows(q_rows, k),
            mx.array(uniforms, dtype=mx.float32),
            sampling,
        ).tolist()
        assert tuple(got) == (expected.accepted, expected.next_token), (case, k)


def test_greedy_rows_and_first_token_equal_the_reference():
    rng = random.Random(5)
    greedy = SamplingParams()
    for case in range(100):
        k = rng.randrange(0, 6)
        logits = random_logits(rng, k + 1, 12, ties=case % 2 == 0)
        best = [argmax(row) for row in logits]
        drafts = [b if rng.random() < 0.7 else rng.randrange(12) for b in best[:k]]
        fast_best = mx.argmax(mx.array(logits), axis=-1).tolist()
        assert longest_accepted_prefix(drafts, fast_best) == longest_accepted_prefix(drafts, best)
        verdict = acceptance.greedy_accept(mx.array(logits), mx.array(drafts, dtype=mx.int32)).tolist()
        expected = longest_accepted_prefix(drafts, best)
        assert verdict == [expected.accepted, expected.next_token]
        assert acceptance.pick_token(mx.array(logits[0]), greedy, 0.5).item() == best[0]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_first_token_draw_equals_the_reference(name):
    sampling = SETTINGS[name]
    rng = random.Random(11)
    for _ in range(200):
        row = random_logits(rng, 1, 20, ties=rng.random() < 0.3)[0]
        u = f32([rng.random()])[0]
        expected = sample_index(distribution(row, sampling), u)
        assert acceptance.pick_token(mx.array(row), sampling, u).item() == expected


def test_q_given_as_plain_rows_is_accepted():
    q = [[0.5, 0.5], [0.1, 0.9], [1.0, 0.0]]
    rows = acceptance.as_q_rows(q, 2)
    assert rows.shape == (2, 2) and rows.dtype == mx.float32
    assert acceptance.as_q_rows(None, 3) is None


@pytest.mark.parametrize(
    ("sampling", "q_kind"),
    [
        (SamplingParams(temperature=1.0), "one-hot"),
        (SamplingParams(temperature=1.0), "far"),
        (SamplingParams(temperature=0.8, top_k=4, top_p=0.9), "far"),
    ],
)
def test_the_kernel_reproduces_the_target_distribution(sampling, q_kind):
    """Two-draft blocks: the first two emitted tokens are distributed as the target's own samples."""
    rng = random.Random(2024)
    vocab = 6
    base = f32([rng.gauss(0, 1.5) for _ in range(vocab)])
    p = distribution(base, sampling)
    # The second row's logits depend on the first token, so the joint law is a real check.
    second = [f32([b + 0.8 * ((j * 7 + t) % 5) for j, b in enumerate(base)]) for t in range(vocab)]
    q_row = f32([w / sum(range(1, vocab + 1)) for w in range(vocab, 0, -1)])
    n = 3000
    first_counts = [0] * vocab
    pair_counts = [0] * (vocab * vocab)
    batch_logits, batch_drafts, batch_u, batch_q = [], [], [], []
    for _ in range(n):
        if q_kind == "one-hot":
            d1 = rng.randrange(vocab)
            d2 = rng.randrange(vocab)
        else:
            d1 = sample_index(q_row, rng.random())
            d2 = sample_index(q_row, rng.random())
        batch_logits.append([base, second[d1], second[d2]])
        batch_drafts.append([d1, d2])
        batch_u.append([rng.random() for _ in range(3)])
        batch_q.append(None if q_kind == "one-hot" else [q_row, q_row])
    verdicts = [
        acceptance.accept_block(
            mx.array(lg), mx.array(d, dtype=mx.int32), acceptance.as_q_rows(q, 2), mx.array(u), sampling
        )
        for lg, d, q, u in zip(batch_logits, batch_drafts, batch_q, batch_u, strict=True)
    ]
    mx.eval(verdicts)
    for d, v in zip(batch_drafts, verdicts, strict=True):
        accepted, nxt = v.tolist()
        tokens = [*d[:accepted], nxt]
        first_counts[tokens[0]] += 1
        if len(tokens) > 1:
            pair_counts[tokens[0] * vocab + tokens[1]] += 1
    assert chi_square_p_value(first_counts, p) > 1e-3
    # Given the first token t, the second follows the target's row for t (only rounds that emitted two).
    for t in range(vocab):
        row = pair_counts[t * vocab : (t + 1) * vocab]
        if sum(row) >= 200:
            assert chi_square_p_value(row, distribution(second[t], sampling)) > 1e-3
