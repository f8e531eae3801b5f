"""OpenAI Chat Completions and model-list routes: /v1/chat/completions, /v1/models (also without /v1)."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, Router, get, post

from mlx_dspark.adapters.api.anthropic_messages import codec as anthropic_codec
from mlx_dspark.adapters.api.common import new_id
from mlx_dspark.adapters.api.openai_chat import codec, errors
from mlx_dspark.adapters.api.openai_chat.stream import CompletionStream
from mlx_dspark.entrypoints.http import support


@post(["/v1/chat/completions", "/chat/completions"], status_code=200)
async def create_completion(request: Request[Any, Any, Any]) -> Response[Any]:
    """Create a chat completion, streamed (`data:` chunks) or whole."""
    ctx = support.context(request)
    wreq = codec.parse(await support.read_json(request))
    ctx.check_model(wreq.model)
    request_id = new_id("")
    creq = codec.to_chat_request(wreq, request_id=request_id)
    record = support.RequestLog("openai_chat", request.url.path, wreq.model, bool(wreq.stream), request_id)
    job = support.submit(ctx, creq)
    await support.first(job)
    completion_id, created = new_id("chatcmpl-"), int(time.time())
    if wreq.stream:
        include_usage = bool(wreq.stream_options and wreq.stream_options.include_usage)
        stream = CompletionStream(
            model=wreq.model, completion_id=completion_id, created=created, include_usage=include_usage
        )
        return support.sse_response(ctx, job, stream, record)
    events = await support.collect(request, job, record)
    body = codec.completion_body(events, model=wreq.model, completion_id=completion_id, created=created)
    record.emit(200)
    return Response(content=body, status_code=200)


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
        exception_handlers={Exception: support.error_handler("openai_chat", errors.from_exception, errors.envelope)},
    )
