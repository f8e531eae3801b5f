"""Anthropic Messages routes: /v1/messages and /v1/messages/count_tokens (also without /v1)."""

from __future__ import annotations

from typing import Any

import anyio
from litestar import Request, Response, Router, post

from mlx_dspark.adapters.api.anthropic_messages import codec, errors
from mlx_dspark.adapters.api.anthropic_messages.stream import MessageStream
from mlx_dspark.adapters.api.common import new_id
from mlx_dspark.entrypoints.http import support


@post(["/v1/messages", "/messages"], status_code=200)
async def create_message(request: Request[Any, Any, Any]) -> Response[Any]:
    """Create a message, streamed (named SSE events) or whole."""
    ctx = support.context(request)
    wreq = codec.parse_messages(await support.read_json(request))
    ctx.check_model(wreq.model)
    request_id = new_id("")
    creq = codec.to_chat_request(wreq, request_id=request_id)
    record = support.RequestLog("anthropic", request.url.path, wreq.model, bool(wreq.stream), request_id)
    job = support.submit(ctx, creq)
    prepared = await support.first(job)
    message_id = new_id("msg_")
    if wreq.stream:
        stream = MessageStream(model=wreq.model, message_id=message_id, input_tokens=prepared.prompt_tokens)
        return support.sse_response(ctx, job, stream, record)
    events = await support.collect(request, job, record)
    body = codec.message_body(events, model=wreq.model, message_id=message_id)
    record.emit(200)
    return Response(content=body, status_code=200)


@post(["/v1/messages/count_tokens", "/messages/count_tokens"], status_code=200)
async def count_tokens(request: Request[Any, Any, Any]) -> Response[Any]:
    """Prompt tokens through the real chat template and tokenizer."""
    ctx = support.context(request)
    wreq = codec.parse_count_tokens(await support.read_json(request))
    ctx.check_model(wreq.model)
    creq = codec.to_chat_request(wreq)
    generator = ctx.engine.generator
    n = await anyio.to_thread.run_sync(ctx.chat.count_tokens, generator, creq)
    return Response(content={"input_tokens": n}, status_code=200)


def router() -> Router:
    return Router(
        path="/",
        route_handlers=[create_message, count_tokens],
        guards=[support.api_key_guard],
        exception_handlers={Exception: support.error_handler("anthropic", errors.from_exception, errors.envelope)},
    )
