"""OpenAI Responses route: /v1/responses (also without /v1), stateless, with a small previous_response_id store."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, Router, post

from mlx_dspark.adapters.api.common import new_id
from mlx_dspark.adapters.api.openai_responses import codec, errors
from mlx_dspark.adapters.api.openai_responses.stream import ResponseStream
from mlx_dspark.domain.chat import ChatEvent, Message, TurnFinished
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.entrypoints.http import support


@post(["/v1/responses", "/responses"], status_code=200)
async def create_response(request: Request[Any, Any, Any]) -> Response[Any]:
    """Create a response, streamed (sequence-numbered events, closed after response.completed) or whole."""
    ctx = support.context(request)
    wreq = codec.parse(await support.read_json(request))
    ctx.check_model(wreq.model)
    history: tuple[Message, ...] = ()
    if wreq.previous_response_id:
        if wreq.previous_response_id not in ctx.responses:
            raise InvalidRequest(
                message=f"previous response {wreq.previous_response_id!r} is not known to this server; "
                "send the whole conversation instead",
                param="previous_response_id",
            )
        history = ctx.responses[wreq.previous_response_id]
    request_id = new_id("")
    creq, tool_map = codec.to_chat_request(wreq, history, request_id=request_id)
    record = support.RequestLog("openai_responses", request.url.path, wreq.model, bool(wreq.stream), request_id)
    job = support.submit(ctx, creq)
    await support.first(job)
    stream = ResponseStream(wreq, tool_map, response_id=new_id("resp_"))
    seen: list[ChatEvent] = []

    def remember(event: ChatEvent) -> None:
        seen.append(event)
        if isinstance(event, TurnFinished):
            turn = support.assistant_message(seen)
            ctx.remember(stream.response_id, (*creq.conversation.messages, turn))

    if wreq.stream:
        return support.sse_response(ctx, job, stream, record, on_event=remember)
    for event in await support.collect(request, job, record):
        remember(event)
        stream.feed(event)
    record.emit(200)
    return Response(content=stream.final, status_code=200)


def router() -> Router:
    return Router(
        path="/",
        route_handlers=[create_response],
        guards=[support.api_key_guard],
        exception_handlers={
            Exception: support.error_handler("openai_responses", errors.from_exception, errors.envelope)
        },
    )
