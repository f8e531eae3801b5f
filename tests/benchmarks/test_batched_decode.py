"""pytest-benchmark: aggregate plain decoding of 1, 2, 4 and 8 concurrent requests through the step engine,
in one group so the table shows each width's time relative to the others (same run, same model).

    .venv/bin/pytest tests/benchmarks/test_batched_decode.py --benchmark-enable

A random float32 llama (hidden 256, 4 layers): big enough that the forward, not Python, dominates. With
benchmarks disabled (the default) each width runs once and every row is still checked against solo decoding.
"""

from __future__ import annotations

import functools

import pytest

from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.generation import GenerationRequest, GenerationService
from mlx_dspark.domain.model import LoadedModel
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.tiny_models import tiny_model
from tests.integration.mlx.test_batching import IdTokenizer, Job, make_engine

pytestmark = [pytest.mark.benchmark_suite]

REQUESTS = tuple(GenerationRequest(prompt=tuple(range(10 + i, 30 + i)), max_tokens=32) for i in range(8))


@functools.cache
def service() -> GenerationService:
    model = tiny_model(
        "llama", seed=1, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4
    )
    target = MlxTargetModel(model)
    loaded = LoadedModel(
        name="bench", identity="bench", target=target, tokenizer=IdTokenizer(), context_window=4096, family="llama"
    )
    return GenerationService(loaded, clock=FakeClock(), telemetry=RecordingTelemetrySink())


@functools.cache
def solo(i: int) -> tuple[int, ...]:
    service().model.target.reset(0)
    return service().generate(REQUESTS[i]).token_ids


def run(n: int) -> list[Job]:
    gen = service()
    gen.model.target.reset(0)
    jobs = [Job(r) for r in REQUESTS[:n]]
    queued = iter(jobs[1:])
    make_engine(gen, n).run(jobs[0], lambda: next(queued, None))
    return jobs


@pytest.mark.benchmark(group="batched-plain-decode")
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_batched_decode(benchmark, n: int) -> None:
    jobs = benchmark.pedantic(run, args=(n,), rounds=3, iterations=1)
    assert [j.tokens() for j in jobs] == [solo(i) for i in range(n)]
