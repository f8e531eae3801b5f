"""`mlx-dspark bench --concurrency`: aggregate decode tok/s of N requests decoded together, 1 first.

All N requests arrive at once and run through the server's own step engine (N = 1 is a batch of one). Decode
throughput counts the tokens committed after every row has its first token, over the time from then to the last
token, so prefill does not hide in it; end-to-end tok/s is reported beside it.
Each level's first request is checked against the same request at N = 1 (greedy: token for token;
sampled: the same seed gives the same tokens).

With several modes (`--modes baseline,dspark,lookup`) every level runs each mode back to back, plain
decoding first, so each mode's ratio against batched plain decoding at the same N is paired in time
(`run_concurrency_modes`); greedy runs also check each mode's first request against plain decoding's. Each mode
keeps one engine over the levels, as a server keeps one: its width decisions start each level from what the
earlier levels taught them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from mlx_dspark.application.engine import Engine, JobEvent, JobFailed, JobItem, RowsFactory, StepJob, speculates
from mlx_dspark.application.generation import (
    GenerationDone,
    GenerationJob,
    GenerationRequest,
    GenerationResult,
    GenerationService,
    TextChunk,
)
from mlx_dspark.domain.ports import Clock
from mlx_dspark.domain.tokens import SamplingParams


@attrs.frozen(kw_only=True)
class ConcurrencyPoint:
    concurrency: int
    generated_tokens: int
    decode_tokens_per_second: float
    end_to_end_tokens_per_second: float
    wall_s: float
    widest_batch: int
    speedup: float  # decode tok/s over the N = 1 level of the same mode in the same run
    lossless: bool
    mode: str = "baseline"
    vs_baseline: float = 1.0  # decode tok/s over plain decoding at the same N, measured just before
    drafting_steps: int = 0  # batched forwards in which some row verified drafts
    rounds: int = 0  # decode rounds over every request (a plain step is a round)
    tokens_per_round: float = 0.0  # committed per round, bonus included, the prefill token excluded
    # Decode tok/s while all N requests decode: from the last first token to the first request's end. Rows
    # that speculate finish apart, and the tail after the first one ends runs at a lower width.
    full_tokens_per_second: float = 0.0
    full_vs_baseline: float = 1.0  # the same against plain decoding's
    trials: int = 1  # paired runs of every mode at this N (rates and ratios are their medians)


class _Job:
    """One request as the engine's task: it records when each chunk of tokens arrived."""

    def __init__(self, request: GenerationRequest, clock: Clock) -> None:
        self.request = request
        self.cancelled = False
        self.clock = clock
        self.stamps: list[tuple[float, int]] = []  # (time, tokens) per pushed chunk
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.result: GenerationResult | None = None

    def start(self, service: GenerationService, emit: Callable[[Any], None]) -> StepJob:
        return GenerationJob(service, self.request, emit)

    def push(self, event: JobEvent) -> None:
        value = event.value if isinstance(event, JobItem) else None
        if isinstance(value, TextChunk) and value.token_ids:
            self.stamps.append((self.clock.now(), len(value.token_ids)))
            self.tokens.extend(value.token_ids)
        elif isinstance(value, GenerationDone):
            self.result = value.result
        elif isinstance(event, JobFailed):
            self.error = event.error

    def cancel(self) -> None:
        self.cancelled = True


def _taker(jobs: Sequence[_Job]) -> Callable[[], _Job | None]:
    queued = iter(jobs)
    return lambda: next(queued, None)


@attrs.frozen
class _Run:
    jobs: list[_Job]
    decode: float  # tok/s from the last first token to the last token
    full: float  # tok/s from the last first token to the first request's last token
    wall: float
    widest: int
    drafting: int


def _measure(
    generator: GenerationService,
    requests: Sequence[GenerationRequest],
    clock: Clock,
    engine: Engine,
) -> _Run:
    """Run the requests together on the mode's engine."""
    generator.model.target.reset(0)  # no prefix from the previous level
    jobs = [_Job(r, clock) for r in requests]
    engine.widest, drafted_before = 0, engine.drafting_steps
    start = clock.now()
    engine.run(jobs[0], _taker(jobs[1:]))
    wall = clock.now() - start
    failed = [j.error for j in jobs if j.error is not None]
    if failed:
        raise failed[0]
    stamped = [j for j in jobs if j.stamps]
    all_started = max((j.stamps[0][0] for j in stamped), default=start)

    def rate(until: float) -> float:
        tokens = sum(c for j in stamped for t, c in j.stamps if all_started < t <= until)
        return tokens / (until - all_started) if until > all_started else 0.0

    last = max((j.stamps[-1][0] for j in stamped), default=all_started)
    first_done = min((j.stamps[-1][0] for j in stamped), default=all_started)
    return _Run(
        jobs, rate(last), rate(first_done), wall, max(engine.widest, 1), engine.drafting_steps - drafted_before
    )


def _paired(runs: Sequence[_Run], plain: Sequence[_Run], rate: Callable[[_Run], float]) -> float:
    """The median over trials of each run's rate against plain decoding's run just before it."""
    return statistics.median([rate(r) / rate(p) if rate(p) > 0 else 0.0 for r, p in zip(runs, plain, strict=True)])


def run_concurrency_modes(
    generators: Mapping[str, GenerationService],
    rows: RowsFactory,
    prompts: Sequence[str],
    clock: Clock,
    *,
    levels: Sequence[int] = (1, 2, 4, 8),
    max_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    trials: int = 1,
    progress: Callable[[str, float], None] | None = None,
) -> list[ConcurrencyPoint]:
    """Each level in order (1 first), every mode at that level back to back, the first mode (plain decoding)
    first, `trials` times: each run's decode tok/s against plain decoding's run just before it is a paired
    ratio, and a point reports the medians over its trials."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    order = sorted({1, *levels})
    modes = list(generators)
    # One engine per mode for every level, as the server keeps one for its life: what its width decisions
    # learned (pooled acceptance, tick costs by width) carries from one level to the next.
    engines: dict[str, Engine] = {}
    for mode, gen in generators.items():
        backend = rows(gen.model.target, speculates(gen))
        if backend is None:
            raise ValueError(f"{mode}: this target has no batched rows for this mode")
        engines[mode] = Engine(backend, gen, max_batch=max(order), observe_forwards=True)

    def request(i: int) -> GenerationRequest:
        sampling = SamplingParams(temperature=temperature, seed=seed + i)
        return GenerationRequest(prompt=prompts[i % len(prompts)], max_tokens=max_tokens, sampling=sampling)

    points: list[ConcurrencyPoint] = []
    reference: dict[str, list[int]] = {}
    base: dict[str, float] = {}
    steps = len(order) * len(modes) * trials
    for k, n in enumerate(order):
        runs: dict[str, list[_Run]] = {mode: [] for mode in modes}
        for trial in range(trials):
            for m, mode in enumerate(modes):
                if progress is not None:
                    progress(f"{mode} at {n} concurrent", ((k * trials + trial) * len(modes) + m) / steps)
                runs[mode].append(_measure(generators[mode], [request(i) for i in range(n)], clock, engines[mode]))
        plain = runs[modes[0]]
        for m, mode in enumerate(modes):
            done = runs[mode]
            decode = statistics.median([r.decode for r in done])
            if mode not in base:
                reference[mode], base[mode] = done[0].jobs[0].tokens, decode
            lossless = all(r.jobs[0].tokens == reference[mode] for r in done)
            if temperature == 0.0 and m:  # greedy: every mode must give plain decoding's tokens
                lossless = lossless and all(r.jobs[0].tokens == reference[modes[0]] for r in done)
            jobs = done[0].jobs
            generated = sum(len(j.tokens) for j in jobs)
            results = [j.result for j in jobs if j.result is not None]
            rounds = sum(r.rounds for r in results)
            committed = sum(r.mean_accepted * r.rounds for r in results)
            wall = statistics.median([r.wall for r in done])
            points.append(
                ConcurrencyPoint(
                    concurrency=n,
                    generated_tokens=generated,
                    decode_tokens_per_second=decode,
                    end_to_end_tokens_per_second=generated / wall if wall > 0 else 0.0,
                    wall_s=wall,
                    widest_batch=max(r.widest for r in done),
                    speedup=decode / base[mode] if base[mode] > 0 else 0.0,
                    lossless=lossless,
                    mode=mode,
                    # Paired: each trial's ratio against plain decoding's run just before it.
                    vs_baseline=_paired(done, plain, lambda r: r.decode),
                    drafting_steps=sum(r.drafting for r in done) // len(done),
                    rounds=rounds,
                    tokens_per_round=committed / rounds if rounds else 0.0,
                    full_tokens_per_second=statistics.median([r.full for r in done]),
                    full_vs_baseline=_paired(done, plain, lambda r: r.full),
                    trials=trials,
                )
            )
    if progress is not None:
        progress("done", 1.0)
    return [p for p in points if p.concurrency in levels or p.concurrency == 1]


def render_concurrency(points: Sequence[ConcurrencyPoint]) -> str:
    modes = list(dict.fromkeys(p.mode for p in points))
    several = len(modes) > 1
    head = "concurrent  decode tok/s  x vs 1  full tok/s  e2e tok/s  widest  tokens  tok/round  lossless"
    lines = [f"{'mode':<10}  {head}  x vs plain  full x plain  drafting" if several else head]
    for p in points:
        row = (
            f"{p.concurrency:>10}  {p.decode_tokens_per_second:>12.1f}  {p.speedup:>6.2f}"
            f"  {p.full_tokens_per_second:>10.1f}  {p.end_to_end_tokens_per_second:>9.1f}  {p.widest_batch:>6}"
            f"  {p.generated_tokens:>6}  {p.tokens_per_round:>9.2f}  {'yes' if p.lossless else 'NO':>8}"
        )
        extra = f"  {p.vs_baseline:>10.2f}  {p.full_vs_baseline:>12.2f}  {p.drafting_steps:>8}"
        lines.append(f"{p.mode:<10}  {row}{extra}" if several else row)
    return "\n".join(lines) + "\n"
