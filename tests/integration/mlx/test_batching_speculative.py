"""Speculative continuous batching: every row's output equals the same request decoded alone.

Tiny float32 targets whose next token depends mostly on the last one (so DSpark drafts are often, not
always, right) and lookup drafts over repetitive prompts; 1-4 concurrent requests, greedy and seeded
sampling, joining mid-flight, one cancelled, a plain row beside speculative ones, and the width decision.
Rows verify blocks of different lengths in one forward and keep different numbers of rows, so the batch
cache's per-row rollback (holes, their squeezing out) is exercised; drafts and acceptance counts must match
the solo run exactly, which also pins each row's drafter context (features) to the solo one.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from mlx_dspark.adapters.mlx import batched_target
from mlx_dspark.adapters.mlx.draft_model import DraftModelSource
from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.rows import mlx_rows
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import TELEMETRY_ID, Engine, forkable
from mlx_dspark.application.generation import GenerationRequest, GenerationService
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.costmodel.draft_cap import CapPolicy, FixedCap, MeasuredCap
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.events import BatchSpeculation, BatchStepped, RoundFinished
from mlx_dspark.domain.model import LoadedModel
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.integration.drafters import helpers
from tests.integration.mlx import test_batching as plain_rig
from tests.integration.mlx.test_batching import IdTokenizer, Job, engine_streams, make_engine

VOCAB = helpers.VOCAB
BLOCK = 4


@functools.cache
def _target_model() -> Any:
    return helpers.tiny_target("qwen3", seed=2)


@functools.cache
def _drafter_dir(kind: str) -> Path:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix=f"batch-{kind}-")) / "d"
    if kind == "dflash":
        return helpers.write_dflash(root, variant="v2")
    return helpers.write_dspark(root, _target_model())


def service(
    kind: str, policy: Callable[[], CapPolicy] | None = None, *, min_n: int = 1, threshold: float = 0.0
) -> GenerationService:
    model = _target_model()
    target = MlxTargetModel(model, prefill_chunk=4)
    source: Any
    if kind == "lookup":
        source = LookupDraftSource(block=BLOCK, min_n=min_n, max_n=max(3, min_n))
    elif kind == "draft":
        source = DraftModelSource(helpers.perturbed(model, 0.3, seed=4))
    else:
        source = load_drafter(
            kind, str(_drafter_dir(kind)), model, target=target, bits=0, confidence_threshold=threshold
        )
    loaded = LoadedModel(
        name="tiny",
        identity=f"tiny-{kind}",
        target=target,
        tokenizer=IdTokenizer(),
        context_window=4096,
        family="qwen3",
    )
    return GenerationService(
        loaded,
        source=source,
        mode=kind,
        clock=FakeClock(),
        telemetry=RecordingTelemetrySink(),
        cap_policy_factory=policy or (lambda: FixedCap(BLOCK)),
    )


def requests(n: int, *, sampled: bool, seed: int = 0, max_tokens: int | None = None) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(8, VOCAB) for _ in range(rng.randrange(2, 5))]
        prompt = tuple((motif * 6)[: rng.randrange(5, 21)])  # repetitive: lookup has something to continue
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=200 + i) if sampled else SamplingParams()
        out.append(GenerationRequest(prompt=prompt, max_tokens=max_tokens or rng.randrange(10, 30), sampling=sampling))
    return out


def solo(
    kind: str, request: GenerationRequest, policy: Callable[[], CapPolicy] | None = None, threshold: float = 0.0
) -> Any:
    return service(kind, policy, threshold=threshold).generate(request)


def run_batched(gen: GenerationService, jobs: list[Job], *, join_every: int, max_batch: int = 8) -> Engine:
    assert forkable(gen)
    return plain_rig.run_batched(gen, jobs, max_batch=max_batch, join_every=join_every)


def assert_like_solo(job: Job, want: Any) -> None:
    assert job.ended == "end", job.error
    got = job.result()
    assert job.tokens() == want.token_ids
    assert got.finish_reason is want.finish_reason
    # The same drafts were proposed and accepted: each row's drafter saw exactly its solo context.
    assert (got.rounds, got.drafted, got.accepted) == (want.rounds, want.drafted, want.accepted)


@pytest.mark.parametrize("kind", ["dspark", "lookup", "draft"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_speculative_rows_equal_solo_decoding(kind: str, sampled: bool, n: int) -> None:
    reqs = requests(n, sampled=sampled, seed=n + 10 * sampled)
    jobs = [Job(r) for r in reqs]
    gen = service(kind)
    scheduler = run_batched(gen, jobs, join_every=2)
    for job, req in zip(jobs, reqs):
        assert_like_solo(job, solo(kind, req))
    if n > 1:
        assert scheduler.widest > 1 and scheduler.drafting_steps > 0
        rounds = [e for rid, e in gen.telemetry.events if isinstance(e, RoundFinished)]  # type: ignore[attr-defined]
        assert any(r.accepted for r in rounds)
        if kind in ("dspark", "draft"):  # rows rejected drafts and kept different numbers of rows: per-row rollback ran
            assert any(r.drafted > r.accepted for r in rounds)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_dflash_rows_equal_solo_decoding(sampled: bool) -> None:
    reqs = requests(3, sampled=sampled, seed=30 + sampled)
    jobs = [Job(r) for r in reqs]
    scheduler = run_batched(service("dflash"), jobs, join_every=1)
    assert scheduler.widest == 3 and scheduler.drafting_steps > 0
    for job, req in zip(jobs, reqs):
        assert_like_solo(job, solo("dflash", req))


def _spy_on_drafting(monkeypatch: pytest.MonkeyPatch, gen: GenerationService) -> tuple[list[Any], list[Any]]:
    """Record the forks in every batched draft call and every fork that drafted alone."""
    together: list[Any] = []
    alone: list[Any] = []
    root: Any = gen.selector.source  # type: ignore[attr-defined]
    batched, single = type(root).propose_rows, type(root).propose

    def propose_rows(self: Any, rows: Any) -> Any:
        together.append([fork for fork, _, _ in rows])
        return batched(self, rows)

    def propose(self: Any, *args: Any) -> Any:
        alone.append(self)
        return single(self, *args)

    monkeypatch.setattr(type(root), "propose_rows", propose_rows)
    monkeypatch.setattr(type(root), "propose", propose)
    return together, alone


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_greedy_rows_draft_together_and_sampled_rows_draft_alone(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A sampled row's q is part of its seeded output, so only greedy rows share a drafter forward; either
    # way every row's output is its solo output.
    reqs = [*requests(3, sampled=False, seed=50, max_tokens=24), *requests(1, sampled=True, seed=51, max_tokens=24)]
    jobs = [Job(r) for r in reqs]
    gen = service(kind)
    together, alone = _spy_on_drafting(monkeypatch, gen)
    run_batched(gen, jobs, join_every=1)
    assert together and max(len(forks) for forks in together) == 3
    batched_forks = {id(f) for forks in together for f in forks}
    assert len(batched_forks) == 3  # the three greedy rows' forks, and never the sampled row's
    assert any(id(f) not in batched_forks for f in alone)  # the sampled row drafted, alone
    monkeypatch.undo()
    for job, req in zip(jobs, reqs):
        assert_like_solo(job, solo(kind, req))


def test_rows_drafting_together_truncate_on_their_own_confidences() -> None:
    # A confidence threshold cuts each row's block where its own running confidence drops: rows of one
    # batched draft call end up with blocks of different lengths, verified in one forward.
    reqs = requests(3, sampled=False, seed=60, max_tokens=24)
    jobs = [Job(r) for r in reqs]
    gen = service("dspark", threshold=0.3)
    run_batched(gen, jobs, join_every=1)
    rounds = [e for _, e in gen.telemetry.events if isinstance(e, RoundFinished)]  # type: ignore[attr-defined]
    assert {r.drafted for r in rounds if r.drafted} - {BLOCK}  # some blocks were cut short
    for job, req in zip(jobs, reqs):
        assert_like_solo(job, solo("dspark", req, threshold=0.3))


def auto_service() -> GenerationService:
    """`--mode auto` over DSpark, lookup and plain decoding (fixed caps inside, so its arbiter alone moves)."""
    from mlx_dspark.application.auto_mode import AutoSelector
    from mlx_dspark.domain.drafting.selection import PLAIN

    model = _target_model()
    target = MlxTargetModel(model, prefill_chunk=4)
    dspark = load_drafter("dspark", str(_drafter_dir("dspark")), model, target=target, bits=0)
    candidates = {"dspark": dspark, "lookup": LookupDraftSource(block=BLOCK, min_n=1, max_n=3), PLAIN: None}
    policies = {"dspark": lambda: FixedCap(BLOCK), "lookup": lambda: FixedCap(BLOCK)}
    selector = AutoSelector(candidates, policies, {"dspark": 30.0, "lookup": 20.0, PLAIN: 10.0})
    loaded = LoadedModel(
        name="tiny", identity="tiny-auto", target=target, tokenizer=IdTokenizer(), context_window=4096, family="qwen3"
    )
    return GenerationService(loaded, selector=selector, clock=FakeClock(), telemetry=RecordingTelemetrySink())


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_auto_mode_rows_batch_and_each_equals_its_solo_run(sampled: bool) -> None:
    # Each batched request runs auto's own rule over its lane's forks; a seeded request decides on modelled
    # costs, so its source schedule, and with it its tokens, is the solo one.
    reqs = requests(3, sampled=sampled, seed=70 + sampled, max_tokens=24)
    jobs = [Job(r) for r in reqs]
    gen = auto_service()
    assert forkable(gen)
    scheduler = run_batched(gen, jobs, join_every=1)
    assert scheduler.widest == 3 and scheduler.drafting_steps > 0
    for job, req in zip(jobs, reqs):
        assert job.ended == "end", job.error
        want = auto_service().generate(req)
        assert job.tokens() == want.token_ids and job.result().finish_reason is want.finish_reason
        if sampled:
            assert (job.result().rounds, job.result().source_rounds) == (want.rounds, want.source_rounds)


def test_the_engine_thread_batches_concurrent_auto_jobs() -> None:
    # `serve`'s default mode: concurrent requests (an agent's side requests beside its main one) share the batch.
    reqs = requests(3, sampled=True, seed=72, max_tokens=20)
    outs, batcher = engine_streams(auto_service, reqs)
    assert batcher is not None and batcher.widest > 1
    assert outs == [auto_service().generate(r).token_ids for r in reqs]


def test_a_batched_speculative_turn_reuses_and_saves_the_prefix_with_its_drafter_features() -> None:
    # Both turns run batched beside a side request: the first saves its rows (holes squeezed out) and features
    # out of the batch, the second loads them into its row and its drafter reads the loaded features.
    gen = _cached_service()
    side = requests(2, sampled=False, seed=80, max_tokens=30)
    turn1 = requests(1, sampled=False, seed=81, max_tokens=12)[0]
    first = Job(turn1)
    run_batched(gen, [Job(side[0]), first], join_every=1)
    turn2 = GenerationRequest(prompt=turn1.prompt + first.tokens() + (9, 10), max_tokens=12)
    second = Job(turn2)
    scheduler = run_batched(gen, [Job(side[1]), second], join_every=1)
    assert scheduler.widest == 2
    assert second.result().cached_prompt_tokens >= len(turn1.prompt)
    assert second.result().drafted > 0
    for job, req in [(first, turn1), (second, turn2)]:
        assert job.ended == "end", job.error
        assert job.tokens() == solo("dspark", req).token_ids


def test_a_seeded_request_with_an_adaptive_cap_gives_its_tokens_on_any_clock_and_in_any_batch() -> None:
    # `--max-draft auto`: caps decide how many uniforms a round draws, so a seeded request's must not follow wall
    # time (a slower run, or the batch's plan beside other rows). Its policy learns from modelled seconds.
    def measured() -> CapPolicy:
        return MeasuredCap(curves=KNEE, max_cap=BLOCK)

    def run_alone(tick: float, req: GenerationRequest) -> Any:
        gen = service("dspark", measured)
        gen._clock = FakeClock(tick)  # type: ignore[attr-defined]
        return gen.generate(req)

    reqs = requests(3, sampled=True, seed=90, max_tokens=30)
    for req in reqs:
        fast, slow = run_alone(0.001, req), run_alone(0.05, req)
        assert fast.token_ids == slow.token_ids and fast.cap_histogram == slow.cap_histogram
    jobs = [Job(r) for r in reqs]
    scheduler = run_batched(service("dspark", measured), jobs, join_every=1, max_batch=3)
    assert scheduler.widest == 3 and scheduler.drafting_steps > 0
    for job, req in zip(jobs, reqs):
        assert job.ended == "end", job.error
        assert job.tokens() == run_alone(0.001, req).token_ids


def test_holes_are_squeezed_out_and_rows_still_equal_solo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched_target, "_COMPACT_MIN", 2)
    reqs = requests(3, sampled=True, seed=5, max_tokens=40)
    jobs = [Job(r) for r in reqs]
    gen = service("dspark")
    scheduler = make_engine(gen, 4)
    pending = list(jobs[1:])
    scheduler.run(jobs[0], lambda: pending.pop(0) if pending else None)
    assert scheduler.backend.stats["compactions"] >= 1
    for job, req in zip(jobs, reqs):
        assert_like_solo(job, solo("dspark", req))


def test_rows_join_mid_flight_and_one_cancelled_row_leaves_the_others_undisturbed() -> None:
    reqs = [*requests(2, sampled=False, seed=3, max_tokens=24), *requests(2, sampled=True, seed=4, max_tokens=24)]
    jobs = [Job(r, cancel_after=3 if i == 1 else None) for i, r in enumerate(reqs)]
    run_batched(service("dspark"), jobs, join_every=3)
    cancelled = jobs[1]
    assert cancelled.ended == "end" and cancelled.result() is None
    full = solo("dspark", reqs[1]).token_ids
    assert 0 < len(cancelled.tokens()) < len(full) and cancelled.tokens() == full[: len(cancelled.tokens())]
    for job, req in zip(jobs, reqs):
        if job is not cancelled:
            assert_like_solo(job, solo("dspark", req))


def test_a_plain_row_shares_the_forward_with_speculative_rows() -> None:
    caps = iter([BLOCK, 0, BLOCK, 0])
    policies: list[CapPolicy] = []

    def alternating() -> CapPolicy:
        policies.append(FixedCap(next(caps)))
        return policies[-1]

    reqs = requests(4, sampled=True, seed=8, max_tokens=20)
    jobs = [Job(r) for r in reqs]
    gen = service("dspark", alternating)
    run_batched(gen, jobs, join_every=1)
    steps = [e for rid, e in gen.telemetry.events if isinstance(e, BatchStepped) and e.width > 1]  # type: ignore[attr-defined]
    assert any(0 < s.drafting < s.width for s in steps)  # drafting rows and plain rows in one forward
    for i, (job, req) in enumerate(zip(jobs, reqs)):
        want = solo("dspark", req, lambda i=i: FixedCap(policies[i].value))  # type: ignore[attr-defined]
        assert_like_solo(job, want)
        assert (job.result().drafted == 0) == (policies[i].value == 0)  # type: ignore[attr-defined]


# Flat up to 2 tokens per forward, then linear: one row speculating pays, three rows do not.
KNEE = CostCurves(
    verify_s={1: 0.010, 2: 0.0105, 4: 0.021, 8: 0.042, 16: 0.084}, draft_s={c: 0.0002 * c for c in range(1, 6)}
)
FLAT = CostCurves(verify_s={1: 0.010, 40: 0.0105}, draft_s={c: 0.0001 * c for c in range(1, 6)})


@pytest.mark.parametrize("curves", [KNEE, FLAT], ids=["knee", "flat"])
def test_the_width_decision_comes_from_the_curves_and_is_reported(curves: CostCurves) -> None:
    def measured() -> CapPolicy:
        return MeasuredCap(curves=curves, max_cap=BLOCK)

    reqs = requests(3, sampled=False, seed=12, max_tokens=30)
    jobs = [Job(r) for r in reqs]
    gen = service("dspark", measured)
    scheduler = run_batched(gen, jobs, join_every=1, max_batch=3)
    events = gen.telemetry.events  # type: ignore[attr-defined]
    decisions = [e for rid, e in events if isinstance(e, BatchSpeculation)]
    assert all(rid == TELEMETRY_ID for rid, e in events if isinstance(e, BatchSpeculation))
    wide = [d for d in decisions if d.width == 3]
    assert wide and wide[0].reason == "calibrated"
    steps = [e for rid, e in events if isinstance(e, BatchStepped) and e.width == 3]
    drafting = sum(1 for s in steps if s.drafting)
    if curves is KNEE:
        assert not wide[0].speculate and wide[0].plain_tok_s > wide[0].speculative_tok_s / 1.05
        assert drafting <= len(steps) // 8 + 1  # only probe ticks draft at width 3
    else:
        assert wide[0].speculate and wide[0].cap > 0
        assert drafting > len(steps) // 2
    assert scheduler.plan.decisions[-1].width >= 1
    for job, req in zip(jobs, reqs):  # greedy: lossless whatever the decision
        assert job.ended == "end", job.error
        assert job.tokens() == solo("dspark", req, measured).token_ids


def test_rows_that_are_offered_a_cap_and_draft_nothing_count_as_misses_in_the_batch_plan() -> None:
    # A lookup whose n-grams are longer than any prompt never drafts. Offered caps it cannot use, every row
    # commits one token per tick: the pooled estimate must learn that, or the plan keeps widening the forward
    # for nothing (the rows that do find a match make all the others pay for their blocks).
    def measured() -> CapPolicy:
        return MeasuredCap(curves=FLAT, max_cap=BLOCK)

    gen = service("lookup", measured, min_n=64)
    reqs = requests(3, sampled=False, seed=12, max_tokens=30)
    jobs = [Job(r) for r in reqs]
    scheduler = run_batched(gen, jobs, join_every=1, max_batch=3)
    plans = [e for _, e in gen.telemetry.events if isinstance(e, BatchSpeculation) and e.width > 1]  # type: ignore[attr-defined]
    assert plans[0].speculate  # the prior first: drafting looks worth it on a flat curve
    assert not plans[-1].speculate  # then the rows' empty rounds taught it otherwise
    assert scheduler.plan.acceptance.estimate()[0] < 0.3  # from the 0.7 prior
    for job in jobs:
        assert job.ended == "end", job.error
        assert job.result().drafted == 0


def test_probes_back_off_while_they_keep_speculation_off() -> None:
    # KNEE: three rows never pay for speculating. Each probe tick drafts every row (a wide, costly forward),
    # so while probes keep saying "off" they come ever further apart.
    def measured() -> CapPolicy:
        return MeasuredCap(curves=KNEE, max_cap=BLOCK)

    reqs = requests(3, sampled=False, seed=12, max_tokens=160)  # 16 + 32 + 64 off ticks between three probes
    jobs = [Job(r) for r in reqs]
    gen = service("dspark", measured)
    run_batched(gen, jobs, join_every=1, max_batch=3)
    steps = [e for _, e in gen.telemetry.events if isinstance(e, BatchStepped) and e.width == 3]  # type: ignore[attr-defined]
    probes = [i for i, e in enumerate(steps) if e.drafting]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] >= 2 * gaps[0]
    for job, req in zip(jobs, reqs):  # greedy: lossless whatever the decision
        assert job.ended == "end", job.error
        assert job.tokens() == solo("dspark", req, measured).token_ids


class _TimidCap:
    """An adaptive policy (calibrated curves, a max cap) that on its own drafts one token a round."""

    def __init__(self, curves: CostCurves) -> None:
        self.curves = curves
        self.max_cap = BLOCK
        self.observed: list[int] = []

    def cap(self, depth: int) -> int:
        return 1

    def observe(self, drafted: int, accepted: int, seconds: float, depth: int, cap: int | None = None) -> None:
        self.observed.append(drafted)


def test_while_rows_share_the_batch_its_plan_sets_every_adaptive_rows_cap() -> None:
    # FLAT: a wide forward costs about a narrow one, so the plan drafts the whole block at width 3. Each
    # row's own policy (one draft a round) neither decides nor hears of the batched rounds' shared ticks.
    policies: list[_TimidCap] = []

    def timid() -> CapPolicy:
        policies.append(_TimidCap(FLAT))
        return policies[-1]

    reqs = requests(3, sampled=False, seed=12, max_tokens=30)
    jobs = [Job(r) for r in reqs]
    gen = service("dspark", timid)
    run_batched(gen, jobs, join_every=1, max_batch=3)
    events = gen.telemetry.events  # type: ignore[attr-defined]
    wide = [e for _, e in events if isinstance(e, BatchSpeculation) and e.width == 3]
    assert wide and wide[0].speculate and wide[0].cap > 1
    rounds = [e for _, e in events if isinstance(e, RoundFinished)]
    assert max(r.cap for r in rounds) == max(d.cap for d in wide) and any(r.drafted > 1 for r in rounds)
    heard = sum(len(p.observed) for p in policies[-3:])
    assert heard < len(rounds) and all(d <= 1 for p in policies for d in p.observed)  # solo rounds only
    for job, req in zip(jobs, reqs):  # greedy: lossless whatever the cap
        assert job.ended == "end", job.error
        assert job.tokens() == solo("dspark", req).token_ids


def test_the_concurrency_bench_pairs_each_mode_with_plain_decoding_at_every_level() -> None:
    from mlx_dspark.application.lab.bench_concurrency import render_concurrency, run_concurrency_modes

    spec = service("dspark")
    plain = GenerationService(spec.model, clock=FakeClock(), telemetry=RecordingTelemetrySink())
    modes = {"baseline": plain, "dspark": spec}
    prompts = ["abcabcabc", "hello hello"]
    points = run_concurrency_modes(modes, mlx_rows, prompts, FakeClock(), levels=(1, 3, 2), max_tokens=8, trials=2)
    assert [(p.mode, p.concurrency) for p in points] == [(m, n) for n in (1, 2, 3) for m in modes]
    assert all(p.trials == 2 and p.full_tokens_per_second > 0 for p in points)
    # While every request decodes the rate is at least the rate that also counts the tail after the first ends.
    assert all(p.full_tokens_per_second >= p.decode_tokens_per_second * 0.999 for p in points if p.concurrency > 1)
    assert points[0].full_vs_baseline == 1.0
    assert all(p.lossless for p in points)  # greedy: every mode's first request gives plain decoding's tokens
    # One scheduler per mode serves every level; each level still reports its own widest batch and forwards.
    assert [p.widest_batch for p in points] == [1, 1, 2, 2, 3, 3]
    assert points[0].vs_baseline == points[4].vs_baseline == 1.0 and points[5].drafting_steps > 0
    assert points[3].drafting_steps > 0
    plain3, spec3 = points[4].decode_tokens_per_second, points[5].decode_tokens_per_second
    assert points[5].vs_baseline == pytest.approx(spec3 / plain3)
    # Rounds and tokens per round come from each request's own result: plain steps commit one token each.
    for p in points:  # every request's tokens after its prefill token came out of its rounds
        assert p.rounds > 0 and p.tokens_per_round * p.rounds == pytest.approx(p.generated_tokens - p.concurrency)
        assert p.tokens_per_round == 1.0 if p.mode == "baseline" else p.rounds < p.generated_tokens - p.concurrency
    table = render_concurrency(points)
    assert "x vs plain" in table and "full x plain" in table and "tok/round" in table
    assert table.count("dspark") == 3


def test_the_engine_thread_batches_concurrent_speculative_jobs() -> None:
    reqs = requests(3, sampled=True, seed=40)
    outs, batcher = engine_streams(lambda: service("dspark"), reqs)
    assert batcher is not None and batcher.widest > 1 and batcher.drafting_steps > 0
    assert outs == [solo("dspark", r).token_ids for r in reqs]


def _cached_service() -> GenerationService:
    from mlx_dspark.application.prefix_cache import PrefixCache

    base = service("dspark")
    return GenerationService(
        base.model,
        source=base.selector.source,  # type: ignore[attr-defined]
        mode="dspark",
        clock=FakeClock(),
        telemetry=RecordingTelemetrySink(),
        cap_policy_factory=lambda: FixedCap(BLOCK),
        prefix_cache=PrefixCache(1 << 26),
    )


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_row_that_moved_into_the_batch_saves_its_drafter_features_and_the_next_turn_drafts_as_alone(
    sampled: bool,
) -> None:
    # Turn 1 starts alone on the serial target, and moves into the batch when a side request opens: its saved
    # state must still carry the features its drafter took before the move. Turn 2 loads that state beside
    # another request; its drafter must see its solo context, so its drafts (and a seeded row's tokens) are solo's.
    # Before, the moved row saved no features and turn 2's drafter started blind (the soak's seeded finding).
    gen = _cached_service()
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7) if sampled else SamplingParams()
    turn1 = attrs.evolve(requests(1, sampled=False, seed=91, max_tokens=20)[0], sampling=sampling)
    first = Job(turn1)
    engine = run_batched(gen, [first, Job(requests(1, sampled=False, seed=92, max_tokens=30)[0])], join_every=4)
    assert engine.widest == 2 and engine.migrations >= 1
    cache = gen.prefix_cache
    assert cache is not None
    (saved,) = [e for e in cache.entries(gen.model.target.state_tag) if e.tokens[: len(turn1.prompt)] == turn1.prompt]
    assert saved.handle.features is not None and saved.handle.features.shape[0] == len(saved.tokens)
    turn2 = GenerationRequest(prompt=turn1.prompt + first.tokens() + (9, 10), max_tokens=16, sampling=sampling)
    second = Job(turn2)
    run_batched(gen, [Job(requests(1, sampled=False, seed=93, max_tokens=30)[0]), second], join_every=1)
    assert second.result().cached_prompt_tokens >= len(turn1.prompt)
    assert_like_solo(first, solo("dspark", turn1))
    assert_like_solo(second, solo("dspark", turn2))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_loaded_state_without_features_is_not_kept_by_a_batched_row_whose_drafter_reads_them(
    monkeypatch: pytest.MonkeyPatch, sampled: bool
) -> None:
    # A state saved without features (a cut row's, whose features no longer matched its rows) gives a drafter no
    # context for its rows: a feature-reading batched row must prefill them, as the serial target's reset does,
    # rather than decode over rows its drafter never saw.
    original = batched_target.BatchedPlainTarget.row_state
    monkeypatch.setattr(
        batched_target.BatchedPlainTarget,
        "row_state",
        lambda self, row, tokens, features: original(self, row, tokens, None),
    )
    gen = _cached_service()
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11) if sampled else SamplingParams()
    turn1 = attrs.evolve(requests(1, sampled=False, seed=94, max_tokens=12)[0], sampling=sampling)
    first = Job(turn1)
    run_batched(gen, [Job(requests(1, sampled=False, seed=95, max_tokens=30)[0]), first], join_every=1)
    turn2 = GenerationRequest(prompt=turn1.prompt + first.tokens() + (9, 10), max_tokens=16, sampling=sampling)
    second = Job(turn2)
    engine = run_batched(gen, [Job(requests(1, sampled=False, seed=96, max_tokens=30)[0]), second], join_every=1)
    assert engine.widest == 2
    assert_like_solo(second, solo("dspark", turn2))
    assert second.result().cached_prompt_tokens == 0
