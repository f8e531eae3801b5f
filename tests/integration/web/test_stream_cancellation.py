"""A dashboard stream stops when its client hangs up, even while the engine is ahead of it.

Litestar answers an `http.disconnect` by cancelling the stream's task group; uvicorn drops every later send
to the closed socket without a word. So the cancellation is the only sign of a hang-up the stream gets, and
it has to land. When the engine thread has queued items faster than the event loop sends them (a busy loop,
a fast engine), taking the next item need not suspend at all, and Python 3.11's `asyncio.wait_for` returns an
item that arrived with the cancellation instead of raising it; the stream then ran to the end of the job and
saved a reply nobody read as `completed` (the `KeyError: 'outcome'` of issue 24).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anyio

from mlx_dspark.application.engine import EngineThread
from mlx_dspark.domain.chat import TextDelta
from mlx_dspark.entrypoints.http.web.routes import job_stream
from tests.fakes.clock import FakeClock, RecordingTelemetrySink

ITEMS = 20_000


def _engine() -> EngineThread:
    service = SimpleNamespace(
        model=SimpleNamespace(name="fake", target=object()),
        mode="baseline",
        prefix_cache=None,
        selector=None,
        telemetry=RecordingTelemetrySink(),
        clock=FakeClock(),
    )
    engine = EngineThread(lambda: service)  # type: ignore[arg-type, return-value]
    engine.start()
    assert engine.wait_ready(10)
    return engine


def test_a_hang_up_stops_a_stream_whose_engine_has_queued_everything() -> None:
    async def main() -> tuple[list[str], int, bool]:
        engine = _engine()
        queued = threading.Event()

        def work(_: object) -> Iterator[TextDelta]:
            for i in range(ITEMS):
                yield TextDelta(text=f"w{i} ")
            queued.set()

        job = engine.submit(work)
        assert await asyncio.to_thread(queued.wait, 60)  # every item waits in the job: the engine is ahead
        ends: list[str] = []
        frames = 0

        def to_json(item: Any) -> list[dict[str, Any]]:
            return [{"type": "text", "text": item.text}]

        stream = job_stream(job, to_json, on_end=ends.append)
        first = anyio.Event()

        async def send_all() -> None:  # Litestar's _stream: every frame goes to a send that never blocks
            nonlocal frames
            async for _ in stream.iterator():  # type: ignore[operator]
                frames += 1
                first.set()

        async with anyio.create_task_group() as group:
            group.start_soon(send_all)
            await first.wait()
            group.cancel_scope.cancel()  # what Litestar does on http.disconnect
        for _ in range(1000):  # the reply is saved from a shielded task: let it run (bounded)
            if ends:
                break
            await asyncio.sleep(0.01)
        engine.stop(5)
        return ends, frames, job.cancelled

    ends, frames, cancelled = asyncio.run(main())
    assert ends == ["cancelled"] and cancelled
    assert frames < ITEMS // 2  # stopped near where the client left, not at the end of the job
