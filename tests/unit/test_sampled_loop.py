"""End to end through the decode loop: speculative sampling yields the target's own joint distribution."""

from __future__ import annotations

import itertools
import math

import pytest

from mlx_dspark.application.engine import decode
from mlx_dspark.domain.events import TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from mlx_dspark.domain.verification.distribution import distribution
from tests.fakes.clock import FakeClock
from tests.fakes.drafts import RandomDraftSource, SampledDraftSource
from tests.fakes.oracle import OracleTarget
from tests.stats import chi_square_p_value

VOCAB = 3
SAMPLING = dict(temperature=1.0)


def exact_joint(
    target: OracleTarget, prompt: list[int], n: int, sampling: SamplingParams
) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=n):
        prob, prefix = 1.0, list(prompt)
        for tok in seq:
            prob *= distribution(target.logits(prefix), sampling)[tok]
            prefix.append(tok)
        out[seq] = prob
    return out


def sample_runs(source_factory, sampling_kw, runs=4000):
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(runs):
        target = OracleTarget(vocab=VOCAB, context=2, logits_fn=None)
        sampling = SamplingParams(seed=seed, **sampling_kw)
        toks: list[int] = []
        source = source_factory()
        for ev in decode(target, [1, 0], sampling, StopRule(max_tokens=3), FakeClock(), source=source):
            if isinstance(ev, TokensCommitted):
                toks.extend(ev.tokens)
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    return counts


def _q(prefix):
    # A drafter that prefers what the target dislikes: q far from p.
    z = [math.exp(-v) for v in OracleTarget(vocab=VOCAB).logits(prefix)]
    s = sum(z)
    return [v / s for v in z]


@pytest.mark.parametrize(
    ("name", "factory", "sampling_kw"),
    [
        ("stochastic-drafter", lambda: SampledDraftSource(_q, block=2), SAMPLING),
        ("one-hot-drafter", lambda: RandomDraftSource(VOCAB, block=2, seed=11), SAMPLING),
        ("top-k", lambda: SampledDraftSource(_q, block=2), dict(temperature=0.8, top_k=2)),
    ],
)
def test_speculative_sampling_matches_the_target_joint(name, factory, sampling_kw):
    counts = sample_runs(factory, sampling_kw)
    joint = exact_joint(OracleTarget(vocab=VOCAB), [1, 0], 3, SamplingParams(**sampling_kw))
    keys = sorted(joint)
    observed = [counts.get(k, 0) for k in keys]
    assert sum(observed) == sum(counts.values()), "every run generated exactly 3 tokens"
    assert chi_square_p_value(observed, [joint[k] for k in keys]) > 1e-3


def test_sampling_is_reproducible_with_a_seed():
    def run(seed):
        target = OracleTarget(vocab=VOCAB)
        out = []
        src = SampledDraftSource(_q, block=3)
        sampling = SamplingParams(temperature=0.9, seed=seed)
        for ev in decode(target, [1], sampling, StopRule(max_tokens=20), FakeClock(), source=src):
            if isinstance(ev, TokensCommitted):
                out.extend(ev.tokens)
        return out

    assert run(5) == run(5)
    assert run(5) != run(6)
