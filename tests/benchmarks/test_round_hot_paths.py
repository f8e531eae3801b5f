"""pytest-benchmark suites for the per-round host work: acceptance bookkeeping, the commit plan, the
cap decision, lookup proposals and a whole decode loop on fakes.

pytest runs with `--benchmark-disable` by default (pyproject), so these execute once as plain tests.
Measure them with:

    .venv/bin/pytest tests/benchmarks --benchmark-enable -m benchmark_suite
    .venv/bin/pytest tests/benchmarks --benchmark-enable --benchmark-autosave   # then --benchmark-compare

Each body also asserts its result, so a disabled run still checks that the hot path works.
"""

from __future__ import annotations

import random

import pytest

from mlx_dspark.application.engine import decode
from mlx_dspark.domain.budget import plan_commit
from mlx_dspark.domain.costmodel.acceptance import AcceptanceStats, EwmaAcceptance
from mlx_dspark.domain.costmodel.curves import CostCurves, best_cap
from mlx_dspark.domain.costmodel.draft_cap import MeasuredCap
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.events import Finished
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from mlx_dspark.domain.verification.greedy import longest_accepted_prefix
from tests.fakes.clock import FakeClock
from tests.fakes.drafts import ScriptedDraftSource
from tests.fakes.oracle import OracleTarget

pytestmark = pytest.mark.benchmark_suite

CURVES = CostCurves(
    verify_s={w: 0.04 + 0.002 * w for w in range(1, 34)},
    draft_s={c: 0.003 * c for c in range(1, 33)},
    slope_s_per_token=2e-6,
    overhead_s=1e-4,
)


def test_acceptance_record(benchmark) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    rounds = [(7, rng.randint(0, 7)) for _ in range(256)]

    def run() -> AcceptanceStats:
        stats, ewma = AcceptanceStats(), EwmaAcceptance(positions=8)
        for drafted, accepted in rounds:
            stats.record(drafted, accepted, accepted + 1)
            ewma.record(drafted, accepted)
        return stats

    stats = benchmark(run)
    assert stats.rounds == 256


def test_greedy_verdict(benchmark) -> None:  # type: ignore[no-untyped-def]
    drafts = list(range(15))
    argmax = [*range(10), 99, 98, 97, 96, 95, 94]
    verdict = benchmark(longest_accepted_prefix, drafts, argmax)
    assert verdict.accepted == 10 and verdict.next_token == 99


def test_plan_commit(benchmark) -> None:  # type: ignore[no-untyped-def]
    rule = StopRule(max_tokens=200, eos_ids=frozenset({2, 151645}))
    candidates = tuple(range(10, 26))
    plan = benchmark(plan_commit, candidates, 100, rule)
    assert len(plan.tokens) == 16 and plan.finish is None


@pytest.mark.parametrize("max_cap", [7, 32])
def test_best_cap(benchmark, max_cap: int) -> None:  # type: ignore[no-untyped-def]
    acceptance = [0.9 - 0.02 * i for i in range(max_cap)]
    cap = benchmark(best_cap, CURVES, acceptance, max_cap, 2048)
    assert 1 <= cap <= max_cap


def test_measured_cap_round(benchmark) -> None:  # type: ignore[no-untyped-def]
    policy = MeasuredCap(curves=CURVES, max_cap=15)

    def one_round() -> int:
        cap = policy.cap(512)
        policy.observe(cap, max(cap - 2, 0), CURVES.round_seconds(cap, 512) * 1.1, 512)
        return cap

    assert benchmark(one_round) >= 0


def test_lookup_proposal(benchmark) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(1)
    words = [rng.randrange(2000) for _ in range(60)]
    # Code-like text: a vocabulary of phrases that repeat, as in the traffic lookup drafts feed on.
    history = [t for _ in range(40) for t in words[rng.randrange(40) :][:20]]
    source = LookupDraftSource(block=8)
    source.begin(history[:64])
    greedy = SamplingParams()

    def propose() -> int:
        ctx = DraftContext(anchor=history[-1], position=len(history) - 1, history=history)
        return len(source.propose(ctx, 8, greedy, [0.5] * 8))

    assert benchmark(propose) >= 0


def test_decode_loop_on_fakes(benchmark) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams()
    stop = StopRule(max_tokens=64, eos_ids=frozenset())

    def run() -> int:
        target = OracleTarget(vocab=16, context=2)
        source = ScriptedDraftSource(target, lambda r, i: i < 4, block=6)
        usage = None
        for ev in decode(target, [1, 2, 3, 4], greedy, stop, FakeClock(), source=source):
            if isinstance(ev, Finished):
                usage = ev.usage
        assert usage is not None
        return usage.generated_tokens

    assert benchmark(run) == 64
