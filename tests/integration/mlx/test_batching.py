"""Continuous batching: every row's output equals the same request decoded alone, token for token.

Tiny float32 mlx-lm models of the dense families; 1-8 concurrent requests (greedy and seeded sampling)
that join at different steps, prefill in chunks beside decoding rows, leave at different lengths, and
one cancelled mid-flight. Rotating and recurrent targets are not batched (they run serially).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import pytest

from mlx_dspark.adapters.mlx.acceptance import pick_token
from mlx_dspark.adapters.mlx.batched_target import batch_backend
from mlx_dspark.adapters.mlx.rows import mlx_rows
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import (
    TELEMETRY_ID,
    Engine,
    EngineThread,
    JobEvent,
    JobFailed,
    JobItem,
    StepJob,
    forkable,
    speculates,
)
from mlx_dspark.application.generation import (
    GenerationDone,
    GenerationJob,
    GenerationRequest,
    GenerationService,
    TextChunk,
)
from mlx_dspark.domain.events import BatchStepped
from mlx_dspark.domain.model import LoadedModel
from mlx_dspark.domain.tokens import FinishReason, SamplingParams
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.tiny_models import FAMILIES, STATE, VOCAB, tiny_model

EOS = 7


class IdTokenizer:
    """Each id reads back as its own bracketed number (no merges, so text never holds a token back)."""

    chat_template = None
    eos_ids = frozenset({EOS})

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


@functools.cache
def _model(family: str) -> Any:
    return tiny_model(family, seed=0)


def service(family: str, *, chunk: int = 4) -> GenerationService:
    target = MlxTargetModel(_model(family), prefill_chunk=chunk)
    model = LoadedModel(
        name="tiny",
        identity=f"tiny-{family}",
        target=target,
        tokenizer=IdTokenizer(),
        context_window=4096,
        family=family,
    )
    return GenerationService(model, clock=FakeClock(), telemetry=RecordingTelemetrySink())


def requests(n: int, *, sampled: bool, seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tuple(rng.randrange(8, VOCAB) for _ in range(rng.randrange(2, 23)))
        sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i) if sampled else SamplingParams()
        out.append(GenerationRequest(prompt=prompt, max_tokens=rng.randrange(4, 28), sampling=sampling))
    return out


class Job:
    """The task shape the step engine needs (start, push, cancelled, cancel); collects what is pushed."""

    def __init__(self, request: GenerationRequest, cancel_after: int | None = None) -> None:
        self.request = request
        self.cancelled = False
        self.cancel_after = cancel_after
        self.items: list[Any] = []
        self.ended: str | None = None
        self.error: BaseException | None = None

    def start(self, service: GenerationService, emit: Callable[[Any], None]) -> StepJob:
        return GenerationJob(service, self.request, emit)

    def push(self, event: JobEvent) -> None:
        if isinstance(event, JobItem):
            self.items.append(event.value)
            if self.cancel_after is not None and len(self.items) >= self.cancel_after:
                self.cancel()
        elif isinstance(event, JobFailed):
            self.error = event.error
            self.ended = "error"
        else:
            self.ended = "end"

    def cancel(self) -> None:
        self.cancelled = True

    def tokens(self) -> tuple[int, ...]:
        return tuple(t for item in self.items if isinstance(item, TextChunk) for t in item.token_ids)

    def result(self) -> Any:
        done = [item for item in self.items if isinstance(item, GenerationDone)]
        return done[0].result if done else None


def make_engine(gen: GenerationService, max_batch: int) -> Engine:
    """The server's step engine over the service's batched rows."""
    assert forkable(gen)
    rows = mlx_rows(gen.model.target, speculates(gen))
    assert rows is not None
    return Engine(rows, gen, max_batch=max_batch)


def run_batched(gen: GenerationService, jobs: list[Job], *, max_batch: int, join_every: int) -> Engine:
    """Jobs join one at a time, `join_every` take() calls apart (so later ones arrive mid-flight)."""
    scheduler = make_engine(gen, max_batch)
    waiting = list(jobs[1:])
    calls = 0

    def take() -> Job | None:
        nonlocal calls
        calls += 1
        if waiting and calls % join_every == 0:
            return waiting.pop(0)
        return None

    scheduler.run(jobs[0], take)
    while waiting:  # the batch drained before everyone joined: the engine would start the next run
        scheduler.run(waiting.pop(0), take)
    return scheduler


@functools.cache
def solo(family: str, request: GenerationRequest) -> tuple[tuple[int, ...], FinishReason]:
    result = service(family).generate(request)
    return result.token_ids, result.finish_reason


# Every family: dense and MoE, sliding windows of 8 tokens beside global layers (the rows' rings wrap at
# different phases) and hybrid recurrent (gated DeltaNet, short-conv or Mamba state beside attention).
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_batched_rows_equal_solo_decoding(family: str, sampled: bool, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    draws = record_draws(monkeypatch)
    reqs = requests(n, sampled=sampled, seed=n)
    jobs = [Job(r) for r in reqs]
    scheduler = run_batched(service(family), jobs, max_batch=8, join_every=3)
    batched = dict(draws)
    for job, req in zip(jobs, reqs):
        assert job.ended == "end", job.error
        tokens, reason = solo(family, req)
        if job.tokens() != tokens:
            assert_rounding_near_tie(family, req, job.tokens(), batched, draws)
            continue
        assert job.result().finish_reason is reason
    first, later = (len(solo(family, r)[0]) for r in reqs[:2]) if n > 1 else (0, 0)
    if first > 4 and later > 1:  # the second request joined while the first still ran (not cut by EOS)
        assert scheduler.widest > 1  # rows really shared forwards
        assert scheduler.migrations >= 1  # the first row started solo and moved into the batch


def record_draws(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, mx.array]]:
    """Every token draw, solo and batched, as (uniform, the logits it was drawn from), in order."""
    from mlx_dspark.adapters.mlx import batched_target, target

    draws: list[tuple[float, mx.array]] = []

    def spy(logits: mx.array, sampling: SamplingParams, uniform: float) -> mx.array:
        draws.append((float(uniform), logits))
        return pick_token(logits, sampling, uniform)

    monkeypatch.setattr(batched_target, "pick_token", spy)
    monkeypatch.setattr(target, "pick_token", spy)
    return draws


def assert_rounding_near_tie(
    family: str, req: GenerationRequest, got: tuple[int, ...], batched: dict[float, mx.array], draws: list
) -> None:
    """A sampled batched row may part from solo decoding only where its draw saw the solo logits up to float
    noise (the fast BLAS sums a [B, n] GEMM in another order than a one-row one) and the uniform fell at a
    boundary they move: a top-p cut or a CDF step. A stale row or a wrong mask moves logits by whole units."""
    assert not req.sampling.greedy, "greedy batched rows must equal solo decoding"
    want = solo(family, req)[0]
    k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    draws.clear()
    solo.__wrapped__(family, req)  # the solo draws again, recorded
    uniform, logits = draws[k]
    assert uniform in batched, "the batched row drew token k with another uniform"
    gap = mx.abs(logits.astype(mx.float32) - batched[uniform].astype(mx.float32)).max().item()
    assert gap < 1e-4, f"token {k}: the batched logits differ from solo by {gap} (not float noise)"


def test_every_tick_reports_its_width_to_telemetry_and_the_drained_batch_reports_zero() -> None:
    gen = service("llama")
    reqs = requests(4, sampled=False, seed=5)
    jobs = [Job(r) for r in reqs]
    scheduler = run_batched(gen, jobs, max_batch=3, join_every=2)
    recorded = gen.telemetry.events  # type: ignore[attr-defined]
    ticks = [e for rid, e in recorded if isinstance(e, BatchStepped)]
    assert all(rid == TELEMETRY_ID for rid, e in recorded if isinstance(e, BatchStepped))
    assert max(t.width for t in ticks) == scheduler.widest == 3  # max_batch bounds what is reported too
    assert ticks[-1] == BatchStepped(width=0, prefilling=0)
    assert any(t.prefilling for t in ticks)
    # Every decoded token after a row's first (which comes from its prefill) came from a reported step,
    # so the widths add up to at least that (a finishing row may take one step whose token is not kept).
    decoded = sum(max(len(j.tokens()) - 1, 0) for j in jobs)
    assert decoded <= sum(t.width for t in ticks) <= decoded + len(jobs)


def test_a_lone_request_takes_the_serial_path_with_its_prefix_reuse() -> None:
    gen = service("llama")
    first = GenerationRequest(prompt=(30, 40, 50, 60, 70), max_tokens=8)
    jobs = [Job(first)]
    scheduler = run_batched(gen, jobs, max_batch=8, join_every=1)
    # A batch of one on the same step path, its row the serial target (the batch itself never held a row).
    assert scheduler.steps > 0 and scheduler.widest == 1 and scheduler.migrations == 0
    assert scheduler.backend.batch.width == 0 and gen.model.target.cached_tokens > len(first.prompt)  # type: ignore[attr-defined]
    follow = GenerationRequest(prompt=first.prompt + jobs[0].tokens() + (90,), max_tokens=8)
    again = Job(follow)
    run_batched(gen, [again], max_batch=8, join_every=1)
    assert again.result().cached_prompt_tokens > len(first.prompt)
    assert again.tokens() == solo("llama", follow)[0]


def test_max_batch_bounds_the_width_and_queued_requests_still_match() -> None:
    reqs = requests(6, sampled=True, seed=11)
    jobs = [Job(r) for r in reqs]
    scheduler = run_batched(service("llama"), jobs, max_batch=2, join_every=1)
    assert scheduler.widest == 2
    for job, req in zip(jobs, reqs):
        assert job.tokens() == solo("llama", req)[0]


def test_one_cancelled_row_leaves_and_the_others_are_undisturbed() -> None:
    reqs = [*requests(4, sampled=False, seed=3), *requests(2, sampled=True, seed=4)]
    reqs = [GenerationRequest(prompt=r.prompt, max_tokens=24, sampling=r.sampling) for r in reqs]
    jobs = [Job(r, cancel_after=5 if i == 1 else None) for i, r in enumerate(reqs)]
    run_batched(service("qwen3"), jobs, max_batch=8, join_every=2)
    cancelled = jobs[1]
    assert cancelled.ended == "end" and cancelled.result() is None
    assert 0 < len(cancelled.tokens()) < len(solo("qwen3", reqs[1])[0])
    assert cancelled.tokens() == solo("qwen3", reqs[1])[0][: len(cancelled.tokens())]
    for job, req in zip(jobs, reqs):
        if job is not cancelled:
            assert job.tokens() == solo("qwen3", req)[0]


def test_a_long_prompt_prefills_in_chunks_while_other_rows_decode() -> None:
    short = GenerationRequest(prompt=(20, 30, 40), max_tokens=24)
    long = GenerationRequest(prompt=tuple(range(8, 8 + 60)), max_tokens=4)
    jobs = [Job(short), Job(long)]
    gen = service("llama", chunk=4)
    steps_before_long_joined: list[int] = []
    scheduler = make_engine(gen, 4)
    pending = [jobs[1]]

    def take() -> Job | None:
        if pending and len(jobs[0].items) == 2:
            return pending.pop()
        if not pending and not jobs[1].items:
            steps_before_long_joined.append(scheduler.steps)
        return None

    scheduler.run(jobs[0], take)
    # 59 body tokens in chunks of 4 = 15 chunks: the short row kept decoding through them.
    assert max(steps_before_long_joined) >= 10
    assert jobs[0].tokens() == solo("llama", short)[0]
    assert jobs[1].tokens() == solo("llama", long)[0]


def test_a_failing_row_does_not_disturb_the_others() -> None:
    reqs = requests(3, sampled=False, seed=5)
    bad = GenerationRequest(prompt=(), max_tokens=4)  # the service refuses an empty prompt
    jobs = [Job(reqs[0]), Job(bad), Job(reqs[1]), Job(reqs[2])]
    run_batched(service("llama"), jobs, max_batch=8, join_every=1)
    assert jobs[1].ended == "error"
    for job, req in zip([jobs[0], jobs[2], jobs[3]], reqs):
        assert job.tokens() == solo("llama", req)[0]


@pytest.mark.parametrize("family", [f for f in FAMILIES if STATE[f] != "kv"])
def test_sliding_window_and_recurrent_targets_batch_plain_decoding_only(family: str) -> None:
    # A ring or a recurrent state cannot roll one row back, so speculative modes over them are served one at a
    # time.
    from mlx_dspark.domain.drafting.lookup import LookupDraftSource

    backend = batch_backend(MlxTargetModel(_model(family)))
    assert backend is not None and not backend.speculative
    assert batch_backend(MlxTargetModel(_model("llama"))).speculative  # type: ignore[union-attr]
    plain = service(family)
    assert mlx_rows(plain.model.target, speculates(plain)) is not None
    drafting = GenerationService(
        plain.model, source=LookupDraftSource(block=3), mode="lookup", clock=FakeClock(), telemetry=plain.telemetry
    )
    assert forkable(drafting) and mlx_rows(drafting.model.target, speculates(drafting)) is None
    backend.feed(0, [10, 11, 12])
    first = None
    while first is None:  # the prompt's body, then its last token
        first = backend.prefill_step(0, SamplingParams(), 0.5)
    with pytest.raises(ValueError, match="decode plainly"):
        backend.verify({0: backend.row_verify(first, (5, 6), None, SamplingParams(), (0.5, 0.5, 0.5))})


def test_quantized_kv_caches_have_no_batched_form() -> None:
    assert batch_backend(MlxTargetModel(_model("llama"), kv_bits=8)) is None


def engine_streams(
    make: Callable[[], GenerationService], reqs: list[GenerationRequest]
) -> tuple[list[tuple[int, ...]], Any]:
    """The token ids each request streams when all are submitted at once to a batching engine thread, and the
    engine's batcher (for its counters)."""
    engine = EngineThread(make, max_batch=4, rows=mlx_rows)
    engine.start()
    assert engine.wait_ready(30)

    async def one(req: GenerationRequest) -> tuple[int, ...]:
        job = engine.submit_decode(lambda g, emit: GenerationJob(g, req, emit))
        return tuple(t for item in [i async for i in job] if isinstance(item, TextChunk) for t in item.token_ids)

    async def main() -> list[tuple[int, ...]]:
        return await asyncio.gather(*(one(r) for r in reqs))

    try:
        outs = asyncio.run(main())
    finally:
        engine.stop(timeout=10)
    return outs, engine.engine


def test_the_engine_thread_batches_concurrent_jobs() -> None:
    reqs = requests(4, sampled=True, seed=9)
    outs, batcher = engine_streams(lambda: service("llama"), reqs)
    assert batcher is not None and batcher.widest > 1
    assert outs == [solo("llama", r)[0] for r in reqs]


def test_concurrency_bench_measures_each_level_against_one_request() -> None:
    from mlx_dspark.application.lab.bench_concurrency import run_concurrency_modes

    gen = service("llama")
    points = run_concurrency_modes(
        {gen.mode: gen}, mlx_rows, ["abcdefgh", "hello there"], FakeClock(), levels=(1, 3), max_tokens=6
    )
    assert [p.concurrency for p in points] == [1, 3]
    assert [p.widest_batch for p in points] == [1, 3]
    assert points[0].speedup == 1.0 and all(p.lossless for p in points)
    assert points[1].generated_tokens == 18


def test_max_batch_is_a_setting_and_a_serve_flag() -> None:
    from mlx_dspark.application.settings import load_settings
    from mlx_dspark.domain.errors import InvalidRequest
    from mlx_dspark.entrypoints.cli.serve import parser

    assert load_settings({}, {}).server.max_batch == 8
    assert load_settings({}, {"MLX_DSPARK_MAX_BATCH": "3"}).server.max_batch == 3
    assert parser().parse_args(["--max-batch", "2"]).max_batch == 2
    with pytest.raises(InvalidRequest):
        load_settings({"max_batch": 0}, {})


def test_prompts_split_by_prefill_progress_still_equal_solo_in_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Progress every 5 tokens: the decode loop hands batched rows their prompts in pieces (extend, then prefill).
    from mlx_dspark.domain import decoder as prefill_mod

    monkeypatch.setattr(prefill_mod, "PROGRESS_EVERY", 5)
    reqs = requests(4, sampled=False, seed=11)
    jobs = [Job(r) for r in reqs]
    scheduler = run_batched(service("llama"), jobs, max_batch=8, join_every=2)
    for job, req in zip(jobs, reqs):
        assert job.ended == "end", job.error
        assert job.tokens() == solo("llama", req)[0]
    assert scheduler.widest > 1


def cached_service(family: str = "llama") -> GenerationService:
    from mlx_dspark.application.prefix_cache import PrefixCache

    gen = service(family)
    cache = PrefixCache(1 << 26)
    return GenerationService(gen.model, clock=FakeClock(), telemetry=RecordingTelemetrySink(), prefix_cache=cache)


def test_lanes_keep_the_prefix_cache_and_a_side_request_does_not_evict_the_conversation() -> None:
    gen = cached_service()
    turn1 = GenerationRequest(prompt=tuple(range(10, 40)), max_tokens=6)
    first = Job(turn1)
    run_batched(gen, [first], max_batch=8, join_every=1)
    side = Job(GenerationRequest(prompt=(50, 51, 52), max_tokens=3))  # a title request between two turns
    run_batched(gen, [side], max_batch=8, join_every=1)
    turn2 = GenerationRequest(prompt=turn1.prompt + first.tokens() + (60, 61), max_tokens=6)
    second = Job(turn2)
    run_batched(gen, [second], max_batch=8, join_every=1)
    assert second.result().cached_prompt_tokens >= len(turn1.prompt)  # from the cache, not the live rows
    assert second.tokens() == solo("llama", turn2)[0]


def test_a_turn_that_arrives_while_another_request_decodes_still_hits_and_saves_the_prefix_cache() -> None:
    # An agent's side request decodes while the conversation's turns arrive: every turn joins the batch (so it
    # starts from a saved state loaded into its batched row, and saves its rows out of the batch) and still
    # reuses the previous turn's rows.
    gen = cached_service()
    turn1 = GenerationRequest(prompt=tuple(range(10, 40)), max_tokens=6)
    first = Job(turn1)
    run_batched(gen, [Job(GenerationRequest(prompt=(50, 51, 52), max_tokens=20)), first], max_batch=8, join_every=1)
    assert first.result().cached_prompt_tokens == 0
    turn2 = GenerationRequest(prompt=turn1.prompt + first.tokens() + (90, 91), max_tokens=6)
    second = Job(turn2)
    scheduler = run_batched(
        gen, [Job(GenerationRequest(prompt=(70, 71, 72), max_tokens=20)), second], max_batch=8, join_every=1
    )
    assert scheduler.widest == 2 and scheduler.migrations == 1  # the side request started alone, then moved in
    assert second.result().cached_prompt_tokens >= len(turn1.prompt) + len(first.tokens()) - 1
    assert second.tokens() == solo("llama", turn2)[0]


def test_batched_rows_that_end_on_an_eos_still_save_their_prefix() -> None:
    # A round whose next token is EOS keeps none of its rows and ends the row; its state is still saved.
    pool = [r for seed in range(6) for r in requests(8, sampled=False, seed=seed)]
    ending = [r for r in pool if solo("llama", r)[1] is FinishReason.STOP and solo("llama", r)[0]][:3]
    assert len(ending) == 3
    gen = cached_service()
    jobs = [Job(r) for r in ending]
    scheduler = run_batched(gen, jobs, max_batch=8, join_every=1)
    assert scheduler.widest > 1
    for job, req in zip(jobs, ending):
        assert job.ended == "end", job.error
        assert job.tokens() == solo("llama", req)[0]
    assert gen.prefix_cache is not None
    saved = {e.tokens for e in gen.prefix_cache.entries(gen.model.target.state_tag)}
    # Every row is cached but the last committed token (the next anchor, not yet forwarded).
    assert all(tuple(req.prompt) + tuple(job.tokens())[:-1] in saved for job, req in zip(jobs, ending))


def test_batched_rows_with_a_prefix_cache_still_equal_solo_decoding() -> None:
    reqs = requests(4, sampled=True, seed=21)
    jobs = [Job(r) for r in reqs]
    scheduler = run_batched(cached_service(), jobs, max_batch=8, join_every=2)
    assert scheduler.widest > 1
    for job, req in zip(jobs, reqs):
        assert job.ended == "end", job.error
        assert job.tokens() == solo("llama", req)[0]


def test_an_exclusive_job_waits_for_the_batch_and_runs_alone_on_the_engines_service() -> None:
    reqs = requests(3, sampled=False, seed=13)
    engine = EngineThread(lambda: service("llama"), max_batch=4, rows=mlx_rows)
    engine.start()
    assert engine.wait_ready(30)
    log: list[Any] = []

    def plain(i: int) -> Any:
        def work(g: GenerationService, emit: Callable[[Any], None]) -> StepJob:
            def out(item: Any) -> None:
                if isinstance(item, GenerationDone):
                    log.append(f"plain{i}")
                emit(item)

            return GenerationJob(g, reqs[i], out)

        return work

    def exclusive(g: GenerationService) -> Any:
        assert engine.engine is not None
        log.append(("exclusive", g is engine.generator, engine.engine.active))
        yield g.generate(reqs[0]).token_ids

    async def collect(job: Any) -> list[Any]:
        return [i async for i in job]

    async def main() -> tuple[list[list[Any]], list[Any], list[Any]]:
        first = [engine.submit_decode(plain(i)) for i in range(3)]
        alone = engine.submit(exclusive, exclusive=True)
        after = engine.submit_decode(plain(1))
        outs = await asyncio.gather(*(collect(j) for j in first))
        return outs, await collect(alone), await collect(after)

    try:
        outs, alone, after = asyncio.run(main())
        widest = engine.engine.widest if engine.engine is not None else 0
    finally:
        engine.stop(timeout=10)
    # The rows queued before it finished first (decoded together); it ran on the engine's own service with no
    # row running; the job after it waited for it.
    assert sorted(log[:3]) == ["plain0", "plain1", "plain2"] and widest > 1
    assert log[3:] == [("exclusive", True, 0), "plain1"]
    assert alone == [solo("llama", reqs[0])[0]]
    tokens = [tuple(t for i in out if isinstance(i, TextChunk) for t in i.token_ids) for out in outs]
    assert tokens == [solo("llama", r)[0] for r in reqs]
    assert tuple(t for i in after if isinstance(i, TextChunk) for t in i.token_ids) == solo("llama", reqs[1])[0]


def test_a_switch_through_a_batching_engine_serves_the_new_service_in_the_batch() -> None:
    engine = EngineThread(lambda: service("llama"), max_batch=4, rows=mlx_rows)
    engine.start()
    assert engine.wait_ready(30)
    replacement = service("qwen3")
    req = requests(1, sampled=False, seed=17)[0]

    async def main() -> list[Any]:
        await engine.switch(lambda _current: replacement).next()
        return [i async for i in engine.submit_decode(lambda g, emit: GenerationJob(g, req, emit))]

    try:
        out = asyncio.run(main())
    finally:
        engine.stop(timeout=10)
    assert engine.generator is replacement
    assert tuple(t for i in out if isinstance(i, TextChunk) for t in i.token_ids) == solo("qwen3", req)[0]


def test_a_joining_rows_prefill_progress_grows_as_the_scheduler_prefills_its_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Progress every 4 tokens, chunks of 2: each piece of the joining row's prompt takes two ticks.
    from mlx_dspark.domain import decoder as prefill_mod
    from mlx_dspark.domain.events import PrefillProgress, TokensCommitted

    monkeypatch.setattr(prefill_mod, "PROGRESS_EVERY", 4)
    gen = service("llama", chunk=2)
    first = GenerationRequest(prompt=(20, 30, 40), max_tokens=40, request_id="first")
    second = GenerationRequest(prompt=tuple(range(8, 8 + 30)), max_tokens=3, request_id="second")
    assert len(solo("llama", first)[0]) == 40  # the first row decodes all through the second one's prefill
    jobs = [Job(first), Job(second)]
    scheduler = make_engine(gen, 4)
    pending = [jobs[1]]

    def take() -> Job | None:
        return pending.pop() if pending and len(jobs[0].items) == 2 else None

    scheduler.run(jobs[0], take)
    recorded: list[tuple[str, Any]] = gen.telemetry.events  # type: ignore[attr-defined]
    at = [i for i, (rid, e) in enumerate(recorded) if rid == "second" and isinstance(e, PrefillProgress)]
    progress = [recorded[i][1] for i in at]
    assert [p.done for p in progress] == [4, 8, 12, 16, 20, 24, 28, 30]
    assert all(p.total == 30 and p.reused == 0 for p in progress)
    for before, after in itertools.pairwise(at):  # the first row decoded in batched steps between two pieces
        between = recorded[before + 1 : after]
        assert any(rid == "first" and isinstance(e, TokensCommitted) for rid, e in between)
        assert any(isinstance(e, BatchStepped) and e.width >= 1 and e.prefilling >= 1 for _, e in between)
    second_tokens = [i for i, (rid, e) in enumerate(recorded) if rid == "second" and isinstance(e, TokensCommitted)]
    assert second_tokens[0] > at[-1]  # its first token comes after its whole prompt is in
    assert scheduler.migrations == 1 and scheduler.widest == 2
    assert jobs[0].tokens() == solo("llama", first)[0]
    assert jobs[1].tokens() == solo("llama", second)[0]
