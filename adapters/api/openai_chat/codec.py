"""Chat Completions ↔ the neutral chat model: one converter, request translation, non-streaming bodies."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import attrs

from mlx_dspark.adapters.api import common
from mlx_dspark.adapters.api.openai_chat import wire
from mlx_dspark.domain.chat import (
    ChatEvent,
    ChatRequest,
    ChatUsage,
    Conversation,
    Message,
    ReasoningDelta,
    Role,
    TextDelta,
    ToolCall,
    ToolCallEnd,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
    TurnFinished,
)
from mlx_dspark.domain.errors import InvalidRequest, quoted
from mlx_dspark.domain.tokens import FinishReason, SamplingParams

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.CANCELLED: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT: "length",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.TOOL_CALLS: "tool_calls",
}
_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT}

converter = common.strict_converter()
common.register_tagged(converter, wire.ContentPart, wire.PART_TAGS, "content part")
common.register_text_or_list(converter, str | list[wire.ContentPart] | None, wire.ContentPart)


def _stop_hook(v: Any, _: Any) -> str | list[str] | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    raise common.WireValueError("expected a string or an array of strings")


converter.register_structure_hook(str | list[str] | None, _stop_hook)


def parse(body: Any) -> wire.ChatCompletionRequest:
    return common.structure(converter, body, wire.ChatCompletionRequest)


def to_chat_request(req: wire.ChatCompletionRequest, request_id: str = "") -> ChatRequest:
    """The neutral request.

    Raises:
        InvalidRequest: unknown roles, media content, n > 1, malformed tool-call arguments.
    """
    if req.n not in (None, 1):
        raise InvalidRequest(message="only n=1 is supported", param="n")
    _refuse_unsupported_sampling(req)
    messages: list[Message] = []
    names: dict[str, str] = {}
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        text = _text(m.content, where)
        if m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequest(
                    message=f"{where}: a tool message needs tool_call_id", param=f"{where}.tool_call_id"
                )
            messages.append(
                Message(role=Role.TOOL, text=text, tool_call_id=m.tool_call_id, tool_name=names.get(m.tool_call_id))
            )
            continue
        role = _ROLES.get(m.role)
        if role is None:
            raise InvalidRequest(
                message=f"unknown role {quoted(m.role)} in {where} "
                "(supported: system, developer, user, assistant, tool)",
                param=f"{where}.role",
            )
        calls = []
        for c in m.tool_calls or []:
            names[c.id] = c.function.name
            calls.append(
                ToolCall(id=c.id, name=c.function.name, arguments=common.loads_arguments(c.function.arguments))
            )
        thinking = m.reasoning_content or m.reasoning or ""
        messages.append(Message(role=role, text=text, thinking=thinking, tool_calls=tuple(calls)))
    tools = [
        ToolSpec(
            name=t.function.name,
            description=t.function.description or "",
            parameters=t.function.parameters or {"type": "object", "properties": {}},
        )
        for t in (req.tools or [])
        if t.type == "function" and t.function is not None
    ]
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return ChatRequest(
        conversation=Conversation(messages=tuple(messages), tools=tuple(tools)),
        model=req.model,
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        sampling=SamplingParams(
            temperature=req.temperature if req.temperature is not None else 0.0,
            top_p=req.top_p if req.top_p is not None else 1.0,
            top_k=req.top_k or 0,
            seed=req.seed,
        ),
        stop=tuple(s for s in stop if s),
        thinking=_thinking(req),
        tool_choice=attrs.evolve(_tool_choice(req.tool_choice), parallel=req.parallel_tool_calls is not False),
        request_id=request_id,
    )


def _refuse_unsupported_sampling(req: wire.ChatCompletionRequest) -> None:
    """Penalties, logit bias and logprobs are not implemented: say so instead of ignoring them. Sampling values
    outside OpenAI's ranges are refused as OpenAI refuses them."""
    common.check_range(req.temperature, "temperature", 0, 2)
    common.check_range(req.top_p, "top_p", 0, 1)
    if req.logprobs or req.top_logprobs:
        raise InvalidRequest(message="logprobs are not supported by this server", param="logprobs")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise InvalidRequest(message=f"{name} is not supported by this server (send 0 or omit it)", param=name)
    if req.logit_bias:
        raise InvalidRequest(message="logit_bias is not supported by this server", param="logit_bias")


def _text(content: str | list[wire.ContentPart] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = common.part_texts(
        content, text=wire.TextPart, refusal=wire.RefusalPart, refused="image, audio and file", where=f"{where}.content"
    )
    return "".join(parts)


def _thinking(req: wire.ChatCompletionRequest) -> bool | None:
    kwargs = req.chat_template_kwargs or {}
    if isinstance(kwargs.get("enable_thinking"), bool):
        return bool(kwargs["enable_thinking"])
    if req.reasoning_effort is not None:
        return req.reasoning_effort not in ("none", "minimal")
    return None


def _tool_choice(choice: Any) -> ToolChoice:
    return common.openai_tool_choice(choice, _tool_choice_object)


def _tool_choice_object(choice: dict[str, Any], kind: Any) -> ToolChoice | None:
    inner = choice.get(kind) if isinstance(kind, str) else None  # {"type": "function", "function": {name}}
    if kind in ("function", "custom") and isinstance(inner, dict) and isinstance(inner.get("name"), str):
        return ToolChoice(mode=ToolChoiceMode.REQUIRED, name=inner["name"])
    if kind == "allowed_tools" and isinstance(inner, dict):
        return common.allowed_tool_choice(
            inner.get("mode"),
            inner.get("tools"),
            lambda t: (t.get("function") or t.get("custom") or {}).get("name"),
        )
    return None


def usage_json(usage: ChatUsage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def call_id(neutral_id: str) -> str:
    return f"call_{neutral_id}"


def completion_body(events: Iterable[ChatEvent], *, model: str, completion_id: str, created: int) -> dict[str, Any]:
    """The non-streaming response from a complete list of events."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    finished: TurnFinished | None = None
    for e in events:
        if isinstance(e, TextDelta):
            text.append(e.text)
        elif isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ToolCallEnd):
            calls.append(
                {"id": call_id(e.id), "type": "function", "function": {"name": e.name, "arguments": e.arguments}}
            )
        elif isinstance(e, TurnFinished):
            finished = e
    if finished is None:
        raise RuntimeError("the turn ended without a TurnFinished event")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None, "refusal": None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": "mlx-dspark",
        "choices": [
            {"index": 0, "message": message, "finish_reason": FINISH_REASONS[finished.reason], "logprobs": None}
        ],
        "usage": usage_json(finished.usage),
    }


def models_body(names: list[str]) -> dict[str, Any]:
    """GET /v1/models in OpenAI's list shape."""
    created = int(time.time())
    return {"object": "list", "data": [model_json(n, created) for n in names]}


def model_json(name: str, created: int | None = None) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created or int(time.time()), "owned_by": "mlx-dspark"}
