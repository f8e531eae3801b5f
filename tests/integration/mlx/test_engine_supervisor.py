"""The engine supervises itself: a failure of its serving loop ends the in-flight jobs at once with a clear error,
and the engine serves on (the model still loaded), reloading the model when failures repeat.

The failure is injected into the step engine's step (a stand-in for any bug there); the requests after it
must still equal their solo runs, so the restart left no half-written state behind.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mlx_dspark.adapters.mlx.rows import mlx_rows
from mlx_dspark.application.engine import Engine, EngineRestarted, EngineThread
from mlx_dspark.application.generation import GenerationJob, GenerationRequest, GenerationService, TextChunk
from tests.integration.mlx.test_batching import requests, service, solo


class Bomb:
    """Makes the engine's step raise on its `at`-th call, `times` times in a row."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int, times: int = 1) -> None:
        self.calls = 0
        self.at, self.times = at, times
        original = Engine.step

        def step(engine: Engine) -> None:
            self.calls += 1
            if self.at <= self.calls < self.at + self.times:
                raise RuntimeError(f"injected failure {self.calls}")
            original(engine)

        monkeypatch.setattr(Engine, "step", step)


def _engine(factory: Any) -> EngineThread:
    engine = EngineThread(factory, max_batch=4, rows=mlx_rows)
    engine.start()
    assert engine.wait_ready(30)
    return engine


async def _outcome(engine: EngineThread, req: GenerationRequest) -> tuple[int, ...] | BaseException:
    job = engine.submit_decode(lambda g, emit: GenerationJob(g, req, emit))
    try:
        return tuple(t for item in [i async for i in job] if isinstance(item, TextChunk) for t in item.token_ids)
    except Exception as exc:
        return exc


def test_a_failure_ends_the_in_flight_requests_and_the_engine_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    Bomb(monkeypatch, at=6)
    engine = _engine(lambda: service("llama"))
    reqs = [GenerationRequest(prompt=r.prompt, max_tokens=30) for r in requests(3, sampled=False, seed=4)]

    async def main() -> tuple[list[Any], list[Any]]:
        first = await asyncio.gather(*(_outcome(engine, r) for r in reqs))
        after = await asyncio.gather(*(_outcome(engine, r) for r in reqs))
        return list(first), list(after)

    try:
        first, after = asyncio.run(asyncio.wait_for(main(), 60))
        health = (engine.ready, engine.restarts, engine.last_restart)
    finally:
        engine.stop(10)
    assert all(isinstance(o, EngineRestarted) for o in first), first
    assert "injected failure 6" in str(first[0]) and "send the request again" in str(first[0])
    ready, restarts, last = health
    assert ready and restarts == 1 and last is not None
    assert "RuntimeError: injected failure 6" in last.cause and not last.reloaded
    assert after == [solo("llama", r)[0] for r in reqs]  # nothing half-written survived the restart


def test_repeated_failures_reload_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    Bomb(monkeypatch, at=2, times=3)
    loads: list[GenerationService] = []

    def factory() -> GenerationService:
        loads.append(service("llama"))
        return loads[-1]

    engine = _engine(factory)
    req = GenerationRequest(prompt=(10, 11, 12, 13), max_tokens=12)

    async def main() -> list[Any]:
        return [await _outcome(engine, req) for _ in range(4)]

    try:
        outcomes = asyncio.run(asyncio.wait_for(main(), 60))
        restarts, last = engine.restarts, engine.last_restart
        serving = engine.generator
    finally:
        engine.stop(10)
    assert [isinstance(o, EngineRestarted) for o in outcomes] == [True, True, True, False]
    assert outcomes[3] == solo("llama", req)[0]
    assert restarts == 3 and last is not None and last.reloaded
    assert len(loads) == 2 and serving is loads[1]  # the third failure within a minute loaded the model again


def test_a_failed_reload_leaves_the_engine_down_with_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    Bomb(monkeypatch, at=1, times=3)
    loads = 0

    def factory() -> GenerationService:
        nonlocal loads
        loads += 1
        if loads > 1:
            raise OSError("the weights are gone")
        return service("llama")

    engine = _engine(factory)
    req = GenerationRequest(prompt=(10, 11, 12), max_tokens=4)

    async def main() -> list[Any]:
        return [await _outcome(engine, req) for _ in range(3)]

    try:
        outcomes = asyncio.run(asyncio.wait_for(main(), 60))
        engine._thread.join(10)
        alive, error = engine.alive, engine.load_error
    finally:
        engine.stop(10)
    assert all(isinstance(o, EngineRestarted) for o in outcomes)
    assert not alive and isinstance(error, OSError)
