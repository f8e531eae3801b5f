"""OpenAI Chat Completions and model-list routes: /v1/chat/completions, /v1/models (also without /v1)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
from litestar import Request, Response, Router, get, post
from litestar.response import Stream

from mlx_dspark.adapters.api.anthropic_messages import codec as anthropic_codec
from mlx_dspark.adapters.api.common import new_id
from mlx_dspark.adapters.api.openai_chat import codec, errors, wire
from mlx_dspark.adapters.api.openai_chat.stream import CompletionStream
from mlx_dspark.application.chat_service import Prepared
from mlx_dspark.domain.chat import ChatEvent, ChatRequest
from mlx_dspark.entrypoints.http import driver, support

DIALECT = driver.Dialect("openai_chat", errors.from_exception, errors.envelope)


@attrs.define
class CompletionExchange(driver.WireExchange):
    wreq: wire.ChatCompletionRequest
    completion_id: str = attrs.Factory(lambda: new_id("chatcmpl-"))
    created: int = attrs.Factory(lambda: int(time.time()))

    def chat_request(self, request_id: str) -> ChatRequest:
        return codec.to_chat_request(self.wreq, request_id=request_id)

    def stream(self, prepared: Prepared) -> CompletionStream:
        include_usage = bool(self.wreq.stream_options and self.wreq.stream_options.include_usage)
        return CompletionStream(
            model=self.model, completion_id=self.completion_id, created=self.created, include_usage=include_usage
        )

    def body(self, events: Sequence[ChatEvent], prepared: Prepared) -> dict[str, Any]:
        return codec.completion_body(events, model=self.model, completion_id=self.completion_id, created=self.created)


@post(["/v1/chat/completions", "/chat/completions"], status_code=200)
async def create_completion(request: Request[Any, Any, Any]) -> Response[Any] | Stream:
    """Create a chat completion, streamed (`data:` chunks) or whole."""
    return await driver.drive(request, DIALECT, lambda _, body: CompletionExchange(codec.parse(body)))


@get(["/v1/models", "/models"])
async def list_models(request: Request[Any, Any, Any]) -> Response[Any]:
    """The served model; Anthropic's list shape when the caller sends `anthropic-version`."""
    names = support.context(request).listed_names()
    if "anthropic-version" in request.headers:
        return Response(content=anthropic_codec.models_body(names))
    return Response(content=codec.models_body(names))


@get(["/v1/models/{model_id:path}", "/models/{model_id:path}"])
async def get_model(request: Request[Any, Any, Any], model_id: str) -> Response[Any]:
    """One model entry (404 unless it is the served model)."""
    ctx = support.context(request)
    name = model_id.lstrip("/")
    ctx.check_model(name)
    return Response(content=codec.model_json(name))


def router() -> Router:
    return Router(
        path="/",
        route_handlers=[create_completion, list_models, get_model],
        guards=[support.api_key_guard],
        exception_handlers={Exception: support.error_handler(DIALECT.name, DIALECT.from_exception, DIALECT.envelope)},
    )
