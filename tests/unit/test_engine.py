"""The engine thread: a bounded queue, a quick lane between two items, and no caller left waiting."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from mlx_dspark.application.engine import EngineDown, EngineThread
from mlx_dspark.domain.errors import Overloaded
from tests.fakes.clock import FakeClock, RecordingTelemetrySink


def _service(name: str) -> Any:
    """What the engine reads of a service that only runs iterator jobs (its step engine stays idle)."""
    return SimpleNamespace(
        model=SimpleNamespace(name=name, target=object()),
        mode="baseline",
        prefix_cache=None,
        selector=None,
        telemetry=RecordingTelemetrySink(),
        clock=FakeClock(),
    )


def _engine(max_queue: int = 2) -> EngineThread:
    loaded = _service("fake")
    engine = EngineThread(lambda: loaded, max_queue=max_queue)  # type: ignore[arg-type, return-value]
    engine.start()
    assert engine.wait_ready(5)
    return engine


def _held(gate: threading.Event, started: threading.Event, log: list[str], n: int = 3) -> Any:
    def work(_: object) -> Iterator[int]:
        for i in range(n):
            if i == 1:
                started.set()
                gate.wait(10)
            log.append(f"item{i}")
            yield i

    return work


def test_a_quick_job_runs_between_two_items_of_the_running_job() -> None:
    async def main() -> list[str]:
        engine = _engine()
        gate, started, log = threading.Event(), threading.Event(), []
        long = engine.submit(_held(gate, started, log))
        await asyncio.to_thread(started.wait, 10)

        def count(_: object) -> Iterator[str]:
            log.append(f"count on {threading.current_thread().name}")
            yield "n"

        quick = engine.submit(count, quick=True)
        gate.set()
        assert await quick.next() == "n"
        assert [i async for i in long] == [0, 1, 2]
        engine.stop(5)
        return log

    log = asyncio.run(main())
    assert log == ["item0", "item1", "count on mlx-dspark-engine", "item2"]


def test_past_the_bound_a_submit_is_overloaded_and_the_queue_recovers() -> None:
    async def main() -> None:
        engine = _engine(max_queue=2)
        gate, started, log = threading.Event(), threading.Event(), []
        running = engine.submit(_held(gate, started, log))
        await asyncio.to_thread(started.wait, 10)
        waiting = [engine.submit(lambda _: iter([1])), engine.submit(lambda _: iter([2]), quick=True)]
        assert engine.queue_depth == 2
        with pytest.raises(Overloaded, match="try again"):
            engine.submit(lambda _: iter([3]))
        gate.set()
        assert [i async for i in running] == [0, 1, 2]
        assert [await job.next() for job in waiting] == [1, 2]
        assert engine.queue_depth == 0
        assert await engine.submit(lambda _: iter([4])).next() == 4  # room again
        engine.stop(5)

    asyncio.run(main())


def test_a_failing_quick_job_reports_its_error_and_the_engine_goes_on() -> None:
    async def main() -> None:
        engine = _engine()

        def broken(_: object) -> Iterator[int]:
            raise ValueError("bad template")
            yield 0

        with pytest.raises(ValueError, match="bad template"):
            await engine.submit(broken, quick=True).next()
        assert engine.alive and await engine.submit(lambda _: iter([5])).next() == 5
        engine.stop(5)

    asyncio.run(main())


def test_stopping_answers_every_queued_job_in_both_lanes() -> None:
    async def main() -> None:
        engine = _engine(max_queue=4)
        gate, started, log = threading.Event(), threading.Event(), []
        engine.submit(_held(gate, started, log))
        await asyncio.to_thread(started.wait, 10)
        queued = [engine.submit(lambda _: iter([1])), engine.submit(lambda _: iter([2]), quick=True)]
        stopper = threading.Thread(target=engine.stop, args=(5,))
        stopper.start()
        gate.set()
        await asyncio.to_thread(stopper.join, 10)
        for job in queued:  # dropped with an answer, never run and never left waiting
            with pytest.raises(EngineDown, match="shutting down"):
                await asyncio.wait_for(job.next(), 5)

    asyncio.run(main())


def test_on_serve_sees_each_service_on_the_engine_thread_before_it_is_served_and_cannot_stop_it() -> None:
    first, second = _service("first"), _service("second")
    seen: list[tuple[str, str, bool]] = []

    def on_serve(generator: Any) -> None:
        seen.append((generator.model.name, threading.current_thread().name, engine._generator is generator))
        if generator is second:
            raise RuntimeError("cannot measure")

    engine = EngineThread(lambda: first, on_serve=on_serve)  # type: ignore[arg-type, return-value]
    engine.start()
    assert engine.wait_ready(5)

    async def main() -> None:
        await engine.switch(lambda _current: second).next()  # type: ignore[arg-type, return-value]

    asyncio.run(main())
    engine.stop(5)
    assert seen == [("first", "mlx-dspark-engine", False), ("second", "mlx-dspark-engine", False)]
    assert engine.generator is second  # a failed measurement does not stop the switch


def test_a_consumer_cancelled_with_items_queued_ahead_stops_at_the_next_item() -> None:
    # Every item already queued: taking one never waits, yet the cancellation of the consumer's task (a client
    # that hung up) must land at the next item, not after the whole job.
    from mlx_dspark.application.engine import EngineJob, JobEnded, JobItem

    async def main() -> int:
        job: EngineJob[int] = EngineJob(asyncio.get_running_loop())
        for i in range(10_000):
            job.push(JobItem(i))
        job.push(JobEnded())
        await asyncio.sleep(0.05)  # the pushes land in the queue
        taken = 0

        async def consume() -> None:
            nonlocal taken
            async for _ in job:
                taken += 1

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return taken

    assert asyncio.run(main()) < 10
