"""Anthropic Messages routes: /v1/messages and /v1/messages/count_tokens (also without /v1)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from litestar import Request, Response, Router, post
from litestar.response import Stream

from mlx_dspark.adapters.api.anthropic_messages import codec, errors, wire
from mlx_dspark.adapters.api.anthropic_messages.stream import MessageStream
from mlx_dspark.adapters.api.common import new_id
from mlx_dspark.application.chat_service import Prepared
from mlx_dspark.domain.chat import ChatEvent, ChatRequest
from mlx_dspark.entrypoints.http import driver, support

DIALECT = driver.Dialect("anthropic", errors.from_exception, errors.envelope)


@attrs.define
class MessagesExchange(driver.WireExchange):
    wreq: wire.MessagesRequest
    message_id: str = attrs.Factory(lambda: new_id("msg_"))

    def chat_request(self, request_id: str) -> ChatRequest:
        return codec.to_chat_request(self.wreq, request_id=request_id)

    def stream(self, prepared: Prepared) -> MessageStream:
        return MessageStream(model=self.model, message_id=self.message_id, input_tokens=prepared.prompt_tokens)

    def body(self, events: Sequence[ChatEvent], prepared: Prepared) -> dict[str, Any]:
        return codec.message_body(events, model=self.model, message_id=self.message_id)


@post(["/v1/messages", "/messages"], status_code=200)
async def create_message(request: Request[Any, Any, Any]) -> Response[Any] | Stream:
    """Create a message, streamed (named SSE events) or whole."""
    return await driver.drive(request, DIALECT, lambda _, body: MessagesExchange(codec.parse_messages(body)))


def _count_request(body: Any) -> tuple[str, ChatRequest]:
    wreq = codec.parse_count_tokens(body)
    return wreq.model, codec.to_chat_request(wreq)


@post(["/v1/messages/count_tokens", "/messages/count_tokens"], status_code=200)
async def count_tokens(request: Request[Any, Any, Any]) -> Response[Any]:
    """Prompt tokens through the real chat template and tokenizer."""
    n = await driver.count(request, DIALECT, _count_request)
    return Response(content={"input_tokens": n}, status_code=200)


def router() -> Router:
    return Router(
        path="/",
        route_handlers=[create_message, count_tokens],
        guards=[support.api_key_guard],
        exception_handlers={Exception: support.error_handler(DIALECT.name, DIALECT.from_exception, DIALECT.envelope)},
    )
