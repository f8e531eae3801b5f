"""The one SSE streamer of an engine job, for the API dialects and the web app alike.

A `Framer` says how items become frames (a dialect's stream state machine, or the app's JSON events). The
streamer sends keep-alives while the engine is silent, ends the job when its client goes away (the cancellation
of the stream's task: `EngineJob.next` checkpoints every item, so it lands even with items queued ahead), turns
a failure into the framer's error frames, and reports how the stream ended: completed, failed or cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from litestar.response import Stream

from mlx_dspark.application.engine import EngineJob

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Framer(Protocol):
    """How one job's items become SSE frames."""

    @property
    def done(self) -> bool:
        """Whether the last frame has gone out (the streamer stops reading)."""
        ...

    def start(self) -> list[bytes]: ...

    def keepalive(self) -> bytes: ...

    def feed(self, item: Any) -> list[bytes]: ...

    def error(self, exc: BaseException) -> list[bytes]: ...


def stream_job(
    job: EngineJob[Any],
    framer: Framer,
    *,
    keepalive_s: float,
    on_failed: Callable[[Exception], None] = lambda _exc: None,
    on_end: Callable[[str], Any] | None = None,
) -> Stream:
    """SSE of `job` through `framer`; `on_end(outcome)` runs once when the stream ends, shielded from the
    cancellation that may have ended it (a coroutine is awaited)."""

    async def frames() -> AsyncIterator[bytes]:
        outcome = "completed"
        try:
            for f in framer.start():
                yield f
            while not framer.done:
                try:
                    item = await job.next(timeout=keepalive_s)
                except TimeoutError:
                    yield framer.keepalive()
                    continue
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    outcome = "failed"
                    on_failed(exc)
                    for f in framer.error(exc):
                        yield f
                    break
                for f in framer.feed(item):
                    yield f
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            job.cancel()
            if on_end is not None:
                await asyncio.shield(asyncio.ensure_future(_call(on_end, outcome)))

    return Stream(frames, media_type="text/event-stream", headers=SSE_HEADERS)


async def _call(fn: Callable[[str], Any], outcome: str) -> None:
    result = fn(outcome)
    if asyncio.iscoroutine(result):
        await result
