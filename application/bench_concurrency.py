"""`mlx-dspark bench --concurrency`: aggregate decode tok/s of N requests decoded together, 1 first.

All N requests arrive at once and run through the engine's own `BatchScheduler` (N = 1 is the serial
path). Decode throughput counts the tokens committed after every row has its first token, over the time
from then to the last token, so prefill does not hide in it; end-to-end tok/s is reported beside it.
Each level's first request is checked against the same request at N = 1 (greedy: token for token;
sampled: the same seed gives the same tokens).

With several modes (`--modes baseline,dspark,lookup`) every level runs each mode back to back, plain
decoding first, so each mode's ratio against batched plain decoding at the same N is paired in time
(`run_concurrency_modes`); greedy runs also check each mode's first request against plain decoding's. Each mode
keeps one scheduler over the levels, as a server keeps one: its width decisions start each level from what the
earlier levels taught them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from mlx_dspark.application.batching import BatchBackend, BatchScheduler
from mlx_dspark.application.generation import (
    GenerationDone,
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


class _Job:
    def __init__(self, request: GenerationRequest, clock: Clock) -> None:
        self.request = request
        self.cancelled = False
        self.clock = clock
        self.stamps: list[tuple[float, int]] = []  # (time, tokens) per pushed chunk
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.result: GenerationResult | None = None

    def work(self, generator: GenerationService) -> Any:
        return generator.stream(self.request)

    def cancel(self) -> None:
        self.cancelled = True


def _push(job: _Job, kind: str, value: Any) -> None:
    if kind == "item" and isinstance(value, TextChunk) and value.token_ids:
        job.stamps.append((job.clock.now(), len(value.token_ids)))
        job.tokens.extend(value.token_ids)
    elif kind == "item" and isinstance(value, GenerationDone):
        job.result = value.result
    elif kind == "error":
        job.error = value


def _taker(jobs: Sequence[_Job]) -> Callable[[], _Job | None]:
    queued = iter(jobs)
    return lambda: next(queued, None)


def _measure(
    generator: GenerationService,
    requests: Sequence[GenerationRequest],
    clock: Clock,
    scheduler: BatchScheduler,
) -> tuple[list[_Job], float, float, int, int]:
    """Run the requests together on the mode's scheduler: (jobs, decode tok/s, wall seconds, widest batch,
    drafting forwards of this run)."""
    generator.model.target.reset(0)  # no prefix from the previous level
    jobs = [_Job(r, clock) for r in requests]
    scheduler.widest, drafted_before = 0, scheduler.drafting_steps
    start = clock.now()
    scheduler.run(jobs[0], _taker(jobs[1:]))
    wall = clock.now() - start
    failed = [j.error for j in jobs if j.error is not None]
    if failed:
        raise failed[0]
    all_started = max(j.stamps[0][0] for j in jobs if j.stamps) if any(j.stamps for j in jobs) else start
    last = max((j.stamps[-1][0] for j in jobs if j.stamps), default=all_started)
    after = sum(c for j in jobs for t, c in j.stamps if t > all_started)
    decode = after / (last - all_started) if last > all_started else 0.0
    return jobs, decode, wall, max(scheduler.widest, 1), scheduler.drafting_steps - drafted_before


def run_concurrency_modes(
    generators: Mapping[str, GenerationService],
    backend: BatchBackend,
    prompts: Sequence[str],
    clock: Clock,
    *,
    levels: Sequence[int] = (1, 2, 4, 8),
    max_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    progress: Callable[[str, float], None] | None = None,
) -> list[ConcurrencyPoint]:
    """Each level in order (1 first), every mode at that level back to back, the first mode (plain decoding)
    first: its decode tok/s at the same N is every other mode's `vs_baseline`."""
    order = sorted({1, *levels})
    modes = list(generators)
    # One scheduler per mode for every level, as the engine keeps one for its life: what its width decisions
    # learned (pooled acceptance, tick costs by width) carries from one level to the next.
    schedulers = {
        mode: BatchScheduler(backend, gen, max_batch=max(order), push=_push, observe_forwards=True)
        for mode, gen in generators.items()
    }

    def request(i: int) -> GenerationRequest:
        sampling = SamplingParams(temperature=temperature, seed=seed + i)
        return GenerationRequest(prompt=prompts[i % len(prompts)], max_tokens=max_tokens, sampling=sampling)

    points: list[ConcurrencyPoint] = []
    reference: dict[str, list[int]] = {}
    base: dict[str, float] = {}
    steps = len(order) * len(modes)
    for k, n in enumerate(order):
        plain_rate = 0.0
        for m, mode in enumerate(modes):
            if progress is not None:
                progress(f"{mode} at {n} concurrent", (k * len(modes) + m) / steps)
            jobs, decode, wall, widest, drafting = _measure(
                generators[mode], [request(i) for i in range(n)], clock, schedulers[mode]
            )
            if mode not in reference:
                reference[mode], base[mode] = jobs[0].tokens, decode
            if m == 0:
                plain_rate = decode
            lossless = jobs[0].tokens == reference[mode]
            if temperature == 0.0 and m:  # greedy: every mode must give plain decoding's tokens
                lossless = lossless and jobs[0].tokens == reference[modes[0]]
            generated = sum(len(j.tokens) for j in jobs)
            results = [j.result for j in jobs if j.result is not None]
            rounds = sum(r.rounds for r in results)
            committed = sum(r.mean_accepted * r.rounds for r in results)
            points.append(
                ConcurrencyPoint(
                    concurrency=n,
                    generated_tokens=generated,
                    decode_tokens_per_second=decode,
                    end_to_end_tokens_per_second=generated / wall if wall > 0 else 0.0,
                    wall_s=wall,
                    widest_batch=widest,
                    speedup=decode / base[mode] if base[mode] > 0 else 0.0,
                    lossless=lossless,
                    mode=mode,
                    vs_baseline=decode / plain_rate if plain_rate > 0 else 0.0,
                    drafting_steps=drafting,
                    rounds=rounds,
                    tokens_per_round=committed / rounds if rounds else 0.0,
                )
            )
    if progress is not None:
        progress("done", 1.0)
    return [p for p in points if p.concurrency in levels or p.concurrency == 1]


def render_concurrency(points: Sequence[ConcurrencyPoint]) -> str:
    modes = list(dict.fromkeys(p.mode for p in points))
    several = len(modes) > 1
    head = "concurrent  decode tok/s  x vs 1  e2e tok/s  widest  tokens  tok/round  lossless"
    lines = [f"{'mode':<10}  {head}  x vs plain  drafting" if several else head]
    for p in points:
        row = (
            f"{p.concurrency:>10}  {p.decode_tokens_per_second:>12.1f}  {p.speedup:>6.2f}"
            f"  {p.end_to_end_tokens_per_second:>9.1f}  {p.widest_batch:>6}  {p.generated_tokens:>6}"
            f"  {p.tokens_per_round:>9.2f}  {'yes' if p.lossless else 'NO':>8}"
        )
        lines.append(f"{p.mode:<10}  {row}  {p.vs_baseline:>10.2f}  {p.drafting_steps:>8}" if several else row)
    return "\n".join(lines) + "\n"
