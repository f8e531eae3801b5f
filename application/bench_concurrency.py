"""`mlx-dspark bench --concurrency`: aggregate decode tok/s of N requests decoded together, 1 first.

All N requests arrive at once and run through the engine's own `BatchScheduler` (N = 1 is the serial
path). Decode throughput counts the tokens committed after every row has its first token, over the time
from then to the last token, so prefill does not hide in it; end-to-end tok/s is reported beside it.
Each level's first request is checked against the same request at N = 1 (greedy: token for token;
sampled: the same seed gives the same tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from mlx_dspark.application.batching import BatchBackend, BatchScheduler
from mlx_dspark.application.generation import GenerationRequest, GenerationService, TextChunk
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
    speedup: float  # decode tok/s over the N = 1 level of the same run
    lossless: bool


class _Job:
    def __init__(self, request: GenerationRequest, clock: Clock) -> None:
        self.request = request
        self.cancelled = False
        self.clock = clock
        self.stamps: list[tuple[float, int]] = []  # (time, tokens) per pushed chunk
        self.tokens: list[int] = []
        self.error: BaseException | None = None

    def work(self, generator: GenerationService) -> Any:
        return generator.stream(self.request)

    def cancel(self) -> None:
        self.cancelled = True


def _push(job: _Job, kind: str, value: Any) -> None:
    if kind == "item" and isinstance(value, TextChunk) and value.token_ids:
        job.stamps.append((job.clock.now(), len(value.token_ids)))
        job.tokens.extend(value.token_ids)
    elif kind == "error":
        job.error = value


def _taker(jobs: Sequence[_Job]) -> Callable[[], _Job | None]:
    queued = iter(jobs)
    return lambda: next(queued, None)


def run_concurrency_bench(
    generator: GenerationService,
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
    """Measure each level in order (1 is always measured first: the baseline of the ratios)."""
    order = sorted({1, *levels})

    def request(i: int) -> GenerationRequest:
        sampling = SamplingParams(temperature=temperature, seed=seed + i)
        return GenerationRequest(prompt=prompts[i % len(prompts)], max_tokens=max_tokens, sampling=sampling)

    points: list[ConcurrencyPoint] = []
    reference: list[int] | None = None
    base = 0.0
    for k, n in enumerate(order):
        if progress is not None:
            progress(f"{n} concurrent", k / len(order))
        generator.model.target.reset(0)  # no prefix from the previous level
        jobs = [_Job(request(i), clock) for i in range(n)]
        scheduler = BatchScheduler(backend, generator, max_batch=n, push=_push)
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
        generated = sum(len(j.tokens) for j in jobs)
        if reference is None:
            reference, base = jobs[0].tokens, decode
        points.append(
            ConcurrencyPoint(
                concurrency=n,
                generated_tokens=generated,
                decode_tokens_per_second=decode,
                end_to_end_tokens_per_second=generated / wall if wall > 0 else 0.0,
                wall_s=wall,
                widest_batch=max(scheduler.widest, 1),
                speedup=decode / base if base > 0 else 0.0,
                lossless=jobs[0].tokens == reference,
            )
        )
    if progress is not None:
        progress("done", 1.0)
    return [p for p in points if p.concurrency in levels or p.concurrency == 1]


def render_concurrency(points: Sequence[ConcurrencyPoint]) -> str:
    lines = ["concurrent  decode tok/s  x vs 1  e2e tok/s  widest  tokens  lossless"]
    for p in points:
        lines.append(
            f"{p.concurrency:>10}  {p.decode_tokens_per_second:>12.1f}  {p.speedup:>6.2f}"
            f"  {p.end_to_end_tokens_per_second:>9.1f}  {p.widest_batch:>6}  {p.generated_tokens:>6}"
            f"  {'yes' if p.lossless else 'NO'}"
        )
    return "\n".join(lines) + "\n"
