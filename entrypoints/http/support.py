"""Plumbing shared by the dialect routes: the per-app context, body reading, auth, and stream drivers."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import attrs
import structlog
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Stream

from mlx_dspark.adapters.api.common import parse_json_body
from mlx_dspark.application.chat_service import ChatItem, ChatService, Prepared
from mlx_dspark.application.engine import EngineJob, EngineThread
from mlx_dspark.application.settings import Settings
from mlx_dspark.domain.chat import ChatEvent, ChatRequest, Message, TurnFinished
from mlx_dspark.domain.errors import InvalidRequest, ModelUnavailable

log = structlog.get_logger("mlx_dspark.http")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@attrs.define(auto_exc=True, kw_only=True)
class BodyTooLarge(InvalidRequest):
    """The request body is over the server's limit (answered with 413)."""


@attrs.define
class HttpContext:
    """What every handler needs; stored in `app.state.ctx`."""

    engine: EngineThread
    chat: ChatService
    settings: Settings
    keepalive_s: float
    max_body_bytes: int
    responses: OrderedDict[str, tuple[Message, ...]] = attrs.Factory(OrderedDict)  # previous_response_id store
    responses_limit: int = 64
    stream_outcomes: Counter[str] = attrs.Factory(Counter)  # completed / failed / cancelled streams

    def listed_names(self) -> list[str]:
        """What /v1/models lists: the loaded model's name (the configured one while loading)."""
        return [self.engine.generator.model.name if self.engine.ready else self.settings.model.model]

    def served_names(self) -> list[str]:
        """Every name a request may use for the served model (its name, the configured name, its identity)."""
        names = [self.settings.model.model]
        if self.engine.ready:
            model = self.engine.generator.model
            names = [model.name, *[n for n in (self.settings.model.model, model.identity) if n != model.name]]
        return list(dict.fromkeys(names))

    def check_model(self, name: str) -> None:
        """Raises ModelUnavailable (404) unless `name` is the served model."""
        names = self.served_names()
        if name not in names:
            raise ModelUnavailable(message=f"model {name!r} is not served here; this server serves {names[0]!r}")

    def remember(self, response_id: str, history: tuple[Message, ...]) -> None:
        self.responses[response_id] = history
        while len(self.responses) > self.responses_limit:
            self.responses.popitem(last=False)


def context(request: Request[Any, Any, Any]) -> HttpContext:
    ctx: HttpContext = request.app.state.ctx
    return ctx


async def read_json(request: Request[Any, Any, Any]) -> Any:
    """The body as JSON, refusing anything over the size limit before it is all read."""
    limit = context(request).max_body_bytes
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(message=f"the request body is larger than the server's limit of {limit} bytes")
        chunks.append(chunk)
    return parse_json_body(b"".join(chunks))


def api_key_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Accept `Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time."""
    key = connection.app.state.ctx.settings.server.api_key
    if not key:
        return
    auth = connection.headers.get("authorization", "")
    offered = auth[7:].strip() if auth.lower().startswith("bearer ") else connection.headers.get("x-api-key", "")
    if not hmac.compare_digest(offered.encode(), key.encode()):
        raise NotAuthorizedException(detail="invalid or missing API key")


def submit(ctx: HttpContext, request: ChatRequest) -> EngineJob[ChatItem]:
    chat = ctx.chat
    return ctx.engine.submit(lambda generator: chat.stream(generator, request))


async def first(job: EngineJob[ChatItem]) -> Prepared:
    """Wait for the turn to be prepared; errors (context overflow, template) surface here as exceptions."""
    try:
        item = await job.next()
    except BaseException:
        job.cancel()
        raise
    if not isinstance(item, Prepared):  # pragma: no cover - ChatService always starts with Prepared
        raise RuntimeError("the chat service did not start with Prepared")
    return item


class DialectStream(Protocol):
    done: bool

    def start(self) -> list[bytes]: ...

    def keepalive(self) -> bytes: ...

    def feed(self, event: ChatEvent) -> list[bytes]: ...

    def error(self, exc: BaseException) -> list[bytes]: ...


@attrs.define
class RequestLog:
    """Builds the one canonical log line of a request."""

    dialect: str
    path: str
    model: str
    stream: bool
    request_id: str
    started: float = attrs.Factory(time.perf_counter)
    fields: dict[str, Any] = attrs.Factory(dict)

    def finished(self, event: TurnFinished) -> None:
        self.fields.update(
            prompt_tokens=event.usage.prompt_tokens,
            cached_prompt_tokens=event.usage.cached_prompt_tokens,
            completion_tokens=event.usage.completion_tokens,
            finish_reason=event.reason.value,
        )

    def emit(self, status: int, **extra: Any) -> None:
        log.info(
            "http.request",
            dialect=self.dialect,
            path=self.path,
            model=self.model,
            stream=self.stream,
            status=status,
            request_id=self.request_id,
            duration_ms=round((time.perf_counter() - self.started) * 1e3, 1),
            **self.fields,
            **extra,
        )


def sse_response(
    ctx: HttpContext,
    job: EngineJob[ChatItem],
    stream: DialectStream,
    record: RequestLog,
    on_event: Callable[[ChatEvent], None] | None = None,
) -> Stream:
    """Stream a prepared job as SSE; keep-alives while the engine is silent; a disconnect cancels the job."""

    async def frames() -> AsyncIterator[bytes]:
        outcome = "completed"
        try:
            for f in stream.start():
                yield f
            while not stream.done:
                try:
                    item = await job.next(timeout=ctx.keepalive_s)
                except TimeoutError:
                    yield stream.keepalive()
                    continue
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    outcome = "failed"
                    log.error("http.stream_failed", request_id=record.request_id, error=str(exc), exc_info=exc)
                    for f in stream.error(exc):
                        yield f
                    break
                if isinstance(item, Prepared):
                    continue
                if on_event is not None:
                    on_event(item)
                if isinstance(item, TurnFinished):
                    record.finished(item)
                for f in stream.feed(item):
                    yield f
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            job.cancel()
            ctx.stream_outcomes[outcome] += 1
            record.emit(200, outcome=outcome)

    return Stream(frames, media_type="text/event-stream", headers=SSE_HEADERS)


async def collect(request: Request[Any, Any, Any], job: EngineJob[ChatItem], record: RequestLog) -> list[ChatEvent]:
    """All events of a non-streaming job; the job is cancelled if the client goes away meanwhile."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel()
                return

    watcher = asyncio.create_task(watch())
    events: list[ChatEvent] = []
    try:
        async for item in job:
            if not isinstance(item, Prepared):
                events.append(item)
                if isinstance(item, TurnFinished):
                    record.finished(item)
    finally:
        watcher.cancel()
        job.cancel()
    return events


def assistant_message(events: list[ChatEvent], call_prefix: str = "call_") -> Message:
    """The assistant turn a list of events amounts to (for previous_response_id replays)."""
    from mlx_dspark.adapters.api.common import loads_arguments
    from mlx_dspark.domain.chat import ReasoningDelta, Role, TextDelta, ToolCall, ToolCallEnd

    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    thinking = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = tuple(
        ToolCall(id=call_prefix + e.id, name=e.name, arguments=loads_arguments(e.arguments))
        for e in events
        if isinstance(e, ToolCallEnd)
    )
    return Message(role=Role.ASSISTANT, text=text, thinking=thinking, tool_calls=calls)


def error_handler(
    dialect: str,
    from_exception: Callable[[BaseException], tuple[int, dict[str, Any]]],
    envelope: Callable[[int, str], dict[str, Any]],
) -> Callable[[Request[Any, Any, Any], Exception], Any]:
    """A router exception handler that answers in the dialect's own error envelope."""
    from litestar import Response
    from litestar.exceptions import HTTPException

    def handle(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        if isinstance(exc, BodyTooLarge):
            status, body = 413, envelope(413, exc.message)
        elif isinstance(exc, HTTPException):
            status, body = exc.status_code, envelope(exc.status_code, str(exc.detail))
        else:
            status, body = from_exception(exc)
        if status >= 500:
            log.error("http.error", dialect=dialect, path=request.url.path, error=repr(exc), exc_info=exc)
        log.info("http.request", dialect=dialect, path=request.url.path, status=status, error=str(exc)[:300])
        return Response(content=body, status_code=status)

    return handle
