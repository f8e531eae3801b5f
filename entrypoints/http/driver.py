"""The one route driver: parse → check model → convert → submit → stream or collect, for every dialect.

A dialect supplies a `Dialect` (its name and error envelopes) and, per request, an `Exchange`: the parsed
request and how to frame the answer (SSE stream or whole body). Everything else — the engine job, keep-alives,
cancellation on disconnect, the canonical log line — happens here once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
import attrs
import structlog
from litestar import Request, Response
from litestar.response import Stream

from mlx_dspark.application.chat_service import ChatItem, Prepared, Report, Turn
from mlx_dspark.application.engine import EngineJob
from mlx_dspark.domain.chat import ChatEvent, ChatRequest
from mlx_dspark.domain.errors import CapacityExceeded
from mlx_dspark.entrypoints.http.request_log import RequestLog
from mlx_dspark.entrypoints.http.sse import stream_job
from mlx_dspark.entrypoints.http.support import HttpContext, context, read_json, read_json_sized

log = structlog.get_logger("mlx_dspark.http")
CLIENT_GONE = 499  # nginx's "client closed request": logged, never seen by the client
OFF_LOOP_BYTES = 1 << 20  # bodies from this size are parsed and converted in a worker thread


@attrs.frozen
class Dialect:
    """An API dialect as the driver sees it: its name and how it words errors."""

    name: str
    from_exception: Callable[[BaseException], tuple[int, dict[str, Any]]]
    envelope: Callable[[int, str], dict[str, Any]]


class DialectStream(Protocol):
    """A dialect's SSE state machine for one response (adapters/api/*/stream.py)."""

    done: bool

    def start(self) -> list[bytes]: ...

    def keepalive(self) -> bytes: ...

    def feed(self, event: ChatEvent) -> list[bytes]: ...

    def error(self, exc: BaseException) -> list[bytes]: ...


class Exchange(Protocol):
    """One parsed request of a dialect, and how its answer is framed."""

    @property
    def model(self) -> str: ...

    @property
    def streaming(self) -> bool: ...

    def chat_request(self, request_id: str) -> ChatRequest: ...

    def stream(self, prepared: Prepared) -> DialectStream: ...

    def body(self, events: Sequence[ChatEvent], prepared: Prepared) -> dict[str, Any]: ...

    def observe(self, event: ChatEvent) -> None:
        """Sees every event before it is framed (Responses remembers turns for previous_response_id)."""


class WireExchange:
    """The `model` and `streaming` of an exchange whose wire request `wreq` has `model` and `stream` fields."""

    wreq: Any

    @property
    def model(self) -> str:
        model: str = self.wreq.model
        return model

    @property
    def streaming(self) -> bool:
        return bool(self.wreq.stream)

    def observe(self, event: ChatEvent) -> None:
        """Most dialects frame events without remembering them."""


Begin = Callable[[HttpContext, Any], Exchange]


async def drive(request: Request[Any, Any, Any], dialect: Dialect, begin: Begin) -> Response[Any] | Stream:
    """Answer one generation request of `dialect`; errors propagate to the dialect's exception handler."""
    ctx = context(request)
    record = RequestLog.of(request, dialect.name)
    body, size = await read_json_sized(request)

    def parse() -> tuple[Exchange, ChatRequest]:
        exchange = begin(ctx, body)
        record.model, record.stream = exchange.model, exchange.streaming
        ctx.check_model(exchange.model)
        return exchange, exchange.chat_request(record.request_id)

    # A large body's conversion (hundreds of thousands of messages) runs off the event loop, so the other
    # requests' streams go on meanwhile.
    exchange, creq = parse() if size < OFF_LOOP_BYTES else await anyio.to_thread.run_sync(parse)
    turn: Turn | None = None
    if ctx.engine.ready:
        # Checked and rendered here, in a worker thread: the prompt's own errors come at once, and the engine
        # thread only decodes (a long prompt's tokenizing never holds up the other rows).
        model = ctx.engine.generator.model
        ctx.chat.admit(model, creq)  # what the body's size alone proves does not fit: milliseconds
        turn = await anyio.to_thread.run_sync(ctx.chat.prepare_turn, model, creq)
    job = ctx.engine.submit_decode(_chat_work(ctx, creq, turn))
    if turn is not None:
        prepared = turn.prepared
        record.observe(prepared)
    else:  # still loading: the job's own Prepared says whether the turn fits
        prepared = await first(job, record, early=(ctx, creq) if exchange.streaming else None)
    if exchange.streaming:
        return sse_response(ctx, dialect, job, exchange, exchange.stream(prepared), record)
    events = await collect(request, job, record)
    if events is None:  # the client hung up: nobody reads an answer, and a cut turn has no whole body
        record.emit(CLIENT_GONE, outcome="cancelled")
        return Response(content=b"", status_code=CLIENT_GONE)
    for event in events:
        exchange.observe(event)
    body = exchange.body(events, prepared)
    record.emit(200)
    return Response(content=body, status_code=200)


async def count(
    request: Request[Any, Any, Any], dialect: Dialect, parse: Callable[[Any], tuple[str, ChatRequest]]
) -> int:
    """Prompt tokens of a request through the real template and tokenizer, counted on the engine thread."""
    ctx = context(request)
    record = RequestLog.of(request, dialect.name)
    record.model, creq = parse(await read_json(request))
    ctx.check_model(record.model)
    chat = ctx.chat
    job: EngineJob[int] = ctx.engine.submit(lambda generator: iter([chat.count_tokens(generator, creq)]), quick=True)
    try:
        n = await job.next()
    finally:
        job.cancel()
    record.fields["prompt_tokens"] = n
    record.emit(200)
    return n


def _chat_work(ctx: HttpContext, creq: ChatRequest, turn: Turn | None) -> Callable[[Any, Any], Any]:
    chat = ctx.chat
    return lambda generator, emit: chat.job(generator, creq, emit, turn)


async def first(
    job: EngineJob[ChatItem], record: RequestLog, early: tuple[HttpContext, ChatRequest] | None = None
) -> Prepared:
    """Wait for the turn to be prepared; errors (context overflow, template) surface here as exceptions.

    A streaming turn (`early`) queued behind another request does not wait in silence: after
    `keepalive_s` the same checks run in a worker thread (same errors, same status codes; the tokenizer
    adapter serialises its calls, so this thread and the engine's never use it at once) and the stream starts,
    so the client gets keep-alives while the job waits in the queue as well as in prefill.
    """
    try:
        try:
            item = await job.next(timeout=early[0].settings.server.keepalive_s if early else None)
        except TimeoutError:
            if early is None:  # pragma: no cover - no timeout without it
                raise
            ctx, creq = early
            # Off the engine thread, which may be inside a long forward: the tokenizer serialises its own calls.
            prepared: Prepared = await anyio.to_thread.run_sync(ctx.chat.prepare, ctx.engine.generator.model, creq)
            record.observe(prepared)
            return prepared
    except BaseException:
        job.cancel()
        raise
    if not isinstance(item, Prepared):  # pragma: no cover - ChatService always starts with Prepared
        job.cancel()
        raise RuntimeError("the chat service did not start with Prepared")
    record.observe(item)
    return item


class _DialectFramer:
    """A dialect's stream state machine as the streamer's framer: Prepared and Report only reach the log."""

    def __init__(self, stream: DialectStream, exchange: Exchange, record: RequestLog) -> None:
        self._stream, self._exchange, self._record = stream, exchange, record

    @property
    def done(self) -> bool:
        return self._stream.done

    def start(self) -> list[bytes]:
        return self._stream.start()

    def keepalive(self) -> bytes:
        return self._stream.keepalive()

    def feed(self, item: Any) -> list[bytes]:
        self._record.observe(item)
        if isinstance(item, Prepared | Report):
            return []
        self._exchange.observe(item)
        return self._stream.feed(item)

    def error(self, exc: BaseException) -> list[bytes]:
        return self._stream.error(exc)


def sse_response(
    ctx: HttpContext,
    dialect: Dialect,
    job: EngineJob[ChatItem],
    exchange: Exchange,
    stream: DialectStream,
    record: RequestLog,
) -> Stream:
    """Stream a prepared job as SSE in the dialect's frames (the one streamer, `sse.py`)."""

    def failed(exc: Exception) -> None:
        status = dialect.from_exception(exc)[0]
        record.failed(exc, status)
        if status >= 500 and not isinstance(exc, CapacityExceeded):
            log.error("http.stream_failed", request_id=record.request_id, error=repr(exc)[:300], exc_info=exc)
        else:  # overloaded, shutting down, restarted: expected, and said so in the request's line
            log.warning("http.stream_failed", request_id=record.request_id, error=repr(exc)[:300])

    def ended(outcome: str) -> None:
        ctx.stream_outcomes[outcome] += 1
        record.emit(200, outcome=outcome)

    framer = _DialectFramer(stream, exchange, record)
    return stream_job(job, framer, keepalive_s=ctx.settings.server.keepalive_s, on_failed=failed, on_end=ended)


async def collect(
    request: Request[Any, Any, Any], job: EngineJob[ChatItem], record: RequestLog
) -> list[ChatEvent] | None:
    """All events of a non-streaming job; None when the client went away meanwhile (the job is cancelled)."""
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                job.cancel()
                return

    watcher = asyncio.create_task(watch())
    events: list[ChatEvent] = []
    try:
        async for item in job:
            record.observe(item)
            if not isinstance(item, Prepared | Report):
                events.append(item)
    finally:
        watcher.cancel()
        job.cancel()
    return None if gone else events
