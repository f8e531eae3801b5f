"""OpenAI Responses route: /v1/responses (also without /v1), stateless, with a small previous_response_id store."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from litestar import Request, Response, Router, post
from litestar.response import Stream

from mlx_dspark.adapters.api.common import new_id
from mlx_dspark.adapters.api.openai_responses import codec, errors, wire
from mlx_dspark.adapters.api.openai_responses.stream import ResponseStream
from mlx_dspark.application.chat_service import Prepared
from mlx_dspark.domain.chat import ChatEvent, ChatRequest, Message, TurnFinished
from mlx_dspark.domain.errors import InvalidRequest, quoted
from mlx_dspark.entrypoints.http import driver, support

DIALECT = driver.Dialect("openai_responses", errors.from_exception, errors.envelope)


@attrs.define
class ResponsesExchange(driver.WireExchange):
    """One Responses turn; remembers the finished conversation for a later previous_response_id."""

    ctx: support.HttpContext
    wreq: wire.ResponsesRequest
    history: tuple[Message, ...]
    response_id: str = attrs.Factory(lambda: new_id("resp_"))
    _creq: ChatRequest | None = None
    _tool_map: codec.ToolMap | None = None
    _seen: list[ChatEvent] = attrs.Factory(list)

    def chat_request(self, request_id: str) -> ChatRequest:
        self._creq, self._tool_map = codec.to_chat_request(self.wreq, self.history, request_id=request_id)
        return self._creq

    def stream(self, prepared: Prepared) -> ResponseStream:
        assert self._tool_map is not None
        return ResponseStream(self.wreq, self._tool_map, response_id=self.response_id)

    def body(self, events: Sequence[ChatEvent], prepared: Prepared) -> dict[str, Any]:
        stream = self.stream(prepared)
        for event in events:
            stream.feed(event)
        assert stream.final is not None
        return stream.final

    def observe(self, event: ChatEvent) -> None:
        self._seen.append(event)
        if isinstance(event, TurnFinished) and self._creq is not None:
            turn = support.assistant_message(self._seen)
            self.ctx.responses.remember(self.response_id, (*self._creq.conversation.messages, turn))


def _begin(ctx: support.HttpContext, body: Any) -> ResponsesExchange:
    wreq = codec.parse(body)
    history: tuple[Message, ...] = ()
    if wreq.previous_response_id:
        known = ctx.responses.recall(wreq.previous_response_id)
        if known is None:
            raise InvalidRequest(
                message=f"previous response {quoted(wreq.previous_response_id)} is not known to this server; "
                "send the whole conversation instead",
                param="previous_response_id",
            )
        history = known
    return ResponsesExchange(ctx, wreq, history)


@post(["/v1/responses", "/responses"], status_code=200)
async def create_response(request: Request[Any, Any, Any]) -> Response[Any] | Stream:
    """Create a response, streamed (sequence-numbered events, closed after response.completed) or whole."""
    return await driver.drive(request, DIALECT, _begin)


def router() -> Router:
    return Router(
        path="/",
        route_handlers=[create_response],
        guards=[support.api_key_guard],
        exception_handlers={Exception: support.error_handler(DIALECT.name, DIALECT.from_exception, DIALECT.envelope)},
    )
