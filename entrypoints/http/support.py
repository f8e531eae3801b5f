"""Plumbing shared by the dialect routes: the per-app context, body reading, auth and error answers."""

from __future__ import annotations

import hmac
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import attrs
import structlog
from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException, NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler

from mlx_dspark.adapters.api.common import parse_json_body
from mlx_dspark.application.chat_service import ChatService
from mlx_dspark.application.engine import EngineThread
from mlx_dspark.application.ports import ResponseStore
from mlx_dspark.application.settings import Settings
from mlx_dspark.domain.chat import ChatEvent, Message
from mlx_dspark.domain.errors import CapacityExceeded, InvalidRequest, ModelUnavailable, Overloaded, quoted

log = structlog.get_logger("mlx_dspark.http")


@attrs.define(auto_exc=True, kw_only=True)
class BodyTooLarge(InvalidRequest):
    """The request body is over the server's limit (answered with 413)."""


@attrs.define
class HttpContext:
    """What every handler needs; stored in `app.state.ctx`."""

    engine: EngineThread
    chat: ChatService
    settings: Settings
    responses: ResponseStore  # previous_response_id turns
    stream_outcomes: Counter[str] = attrs.Factory(Counter)  # streamed answers by outcome, for /metrics

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
            raise ModelUnavailable(
                message=f"model {quoted(name)} is not served here; this server serves {quoted(names[0])}"
            )


def context(request: Request[Any, Any, Any]) -> HttpContext:
    ctx: HttpContext = request.app.state.ctx
    return ctx


_OFF_LOOP_PARSE_BYTES = 1 << 20  # bodies from this size are parsed in a worker thread, off the event loop


async def read_json(request: Request[Any, Any, Any]) -> Any:
    """The body as JSON, refusing anything over the size limit before it is all read."""
    value, _ = await read_json_sized(request)
    return value


async def read_json_sized(request: Request[Any, Any, Any]) -> tuple[Any, int]:
    """The body as JSON and its size in bytes. A declared Content-Length over the limit is refused before any
    byte is read, a longer body as soon as it passes the limit; a large body is parsed in a worker thread."""
    limit = context(request).settings.server.max_body_bytes
    too_large = BodyTooLarge(message=f"the request body is larger than the server's limit of {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if size < _OFF_LOOP_PARSE_BYTES:
        return parse_json_body(raw), size
    return await anyio.to_thread.run_sync(parse_json_body, raw), size


def api_key_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Accept `Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time."""
    key = connection.app.state.ctx.settings.server.api_key
    if not key:
        return
    auth = connection.headers.get("authorization", "")
    offered = auth[7:].strip() if auth.lower().startswith("bearer ") else connection.headers.get("x-api-key", "")
    if not hmac.compare_digest(offered.encode(), key.encode()):
        raise NotAuthorizedException(detail="invalid or missing API key")


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
) -> Callable[[Request[Any, Any, Any], Exception], Response[Any]]:
    """A router exception handler that answers in the dialect's own error envelope and logs the request."""
    from mlx_dspark.entrypoints.http.request_log import RequestLog

    def handle(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        if isinstance(exc, BodyTooLarge):
            status, body = 413, envelope(413, exc.message)
        elif isinstance(exc, HTTPException):
            status, body = exc.status_code, envelope(exc.status_code, str(exc.detail))
        else:
            status, body = from_exception(exc)
        if isinstance(exc, CapacityExceeded):
            # Expected under load (429/529/503): a warning beside the canonical line, no traceback.
            log.warning("http.overloaded", dialect=dialect, path=request.scope["path"], error=exc.message)
        elif status >= 500:
            # The traceback carries no local variables (log_config), so no key and no body reach the log.
            log.error("http.error", dialect=dialect, path=request.scope["path"], error=repr(exc)[:300], exc_info=exc)
        record = RequestLog.of(request, dialect)
        record.failed(exc, status)
        record.emit(status, outcome="rejected" if isinstance(exc, Overloaded) else None)
        headers = {"Retry-After": "1"} if isinstance(exc, Overloaded) else None
        return Response(content=body, status_code=status, headers=headers)

    return handle
