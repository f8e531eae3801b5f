"""Anthropic Messages ↔ the neutral chat model: one converter, request translation, non-streaming bodies."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Iterable
from typing import Any

from mlx_dspark.adapters.api import common
from mlx_dspark.adapters.api.anthropic_messages import wire
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

BILLING_PREFIX = "x-anthropic-billing-header:"
STOP_REASONS = {
    FinishReason.STOP: "end_turn",
    FinishReason.CANCELLED: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.CONTEXT: "max_tokens",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
    FinishReason.TOOL_CALLS: "tool_use",
}

converter = common.strict_converter()
common.register_tagged(converter, wire.ContentBlock, wire.BLOCK_TAGS, "content block")
common.register_tagged(converter, wire.ResultPart, wire.RESULT_TAGS, "tool result block")
common.register_text_or_list(converter, str | list[wire.ContentBlock], wire.ContentBlock)
common.register_text_or_list(converter, str | list[wire.ResultPart] | None, wire.ResultPart)
common.register_text_or_list(converter, str | list[wire.SystemBlock] | None, wire.SystemBlock)


def parse_messages(body: Any) -> wire.MessagesRequest:
    return common.structure(converter, body, wire.MessagesRequest)


def parse_count_tokens(body: Any) -> wire.CountTokensRequest:
    return common.structure(converter, body, wire.CountTokensRequest)


class ThinkingSigner:
    """Signs thinking blocks with an HMAC under a secret of this server, so replayed thinking can be trusted.

    A block whose signature does not verify (edited, forged, from another server or from before a restart) is
    dropped from the prompt rather than refused: the model never reads reasoning it did not write, and a
    conversation carried over from elsewhere still goes on.

    Args:
        secret: the key; a fresh random one per server process when omitted.
    """

    _PREFIX = "mdsp1."

    def __init__(self, secret: bytes | None = None) -> None:
        self._key = secret if secret is not None else secrets.token_bytes(32)

    def sign(self, thinking: str) -> str:
        mac = hmac.new(self._key, b"mlx-dspark/thinking/v1\n" + thinking.encode(), hashlib.sha256).digest()
        return self._PREFIX + base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def verify(self, thinking: str, signature: str | None) -> bool:
        return bool(signature) and hmac.compare_digest(self.sign(thinking).encode(), (signature or "").encode())


SIGNER = ThinkingSigner()  # the server's; one secret per process


def signature(thinking: str, signer: ThinkingSigner | None = None) -> str:
    """The signature of a thinking block: non-empty, different for different text, verifiable only here."""
    return (signer or SIGNER).sign(thinking)


def to_chat_request(
    req: wire.MessagesRequest | wire.CountTokensRequest, request_id: str = "", signer: ThinkingSigner | None = None
) -> ChatRequest:
    """The neutral request.

    Args:
        req: the parsed request.
        request_id: for logs.
        signer: checks replayed thinking blocks (blocks that fail are left out of the prompt).

    Raises:
        InvalidRequest: unsupported content (images) or an unknown role.
    """
    conversation = Conversation(
        system=_system_text(req.system),
        messages=tuple(_messages(req.messages, signer or SIGNER)),
        tools=tuple(_tools(req.tools or [])),
    )
    thinking = req.thinking is not None and req.thinking.type in ("enabled", "adaptive")
    if isinstance(req, wire.MessagesRequest):
        common.check_range(req.temperature, "temperature", 0, 1)  # Anthropic's ranges
        common.check_range(req.top_p, "top_p", 0, 1)
        sampling = SamplingParams(
            temperature=req.temperature if req.temperature is not None else 0.0,
            top_p=req.top_p if req.top_p is not None else 1.0,
            top_k=req.top_k or 0,
        )
        return ChatRequest(
            conversation=conversation,
            model=req.model,
            max_tokens=req.max_tokens,
            sampling=sampling,
            stop=tuple(s for s in (req.stop_sequences or []) if s),
            thinking=thinking,
            tool_choice=_tool_choice(req.tool_choice),
            strict_budget=True,
            request_id=request_id,
        )
    return ChatRequest(
        conversation=conversation,
        model=req.model,
        thinking=thinking,
        tool_choice=_tool_choice(req.tool_choice),
        request_id=request_id,
    )


def _system_text(system: str | list[wire.SystemBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    # Claude Code's per-request attribution block changes every call and would defeat the prefix cache.
    return "\n\n".join(b.text for b in system if not b.text.startswith(BILLING_PREFIX))


def _messages(items: list[wire.InputMessage], signer: ThinkingSigner) -> Iterable[Message]:
    names: dict[str, str] = {}
    for i, m in enumerate(items):
        blocks: list[Any] = [wire.TextBlock(text=m.content)] if isinstance(m.content, str) else list(m.content)
        where = f"messages.{i}"
        if m.role == "system":
            yield Message(role=Role.SYSTEM, text=_plain_text(blocks, where))
        elif m.role == "assistant":
            text: list[str] = []
            thinking: list[str] = []
            calls: list[ToolCall] = []
            for j, b in enumerate(blocks):
                if isinstance(b, wire.TextBlock):
                    text.append(b.text)
                elif isinstance(b, wire.ThinkingBlock):
                    if signer.verify(b.thinking, b.signature):
                        thinking.append(b.thinking)
                elif isinstance(b, wire.ToolUseBlock):
                    if not isinstance(b.input, dict):
                        raise InvalidRequest(message="tool_use input must be an object", param=f"{where}.content.{j}")
                    names[b.id] = b.name
                    calls.append(ToolCall(id=b.id, name=b.name, arguments=b.input))
                elif not isinstance(b, wire.RedactedThinkingBlock):
                    raise _unsupported(b, f"{where}.content.{j}")
            yield Message(
                role=Role.ASSISTANT, text="".join(text), thinking="\n".join(thinking), tool_calls=tuple(calls)
            )
        elif m.role == "user":
            pending: list[str] = []
            for j, b in enumerate(blocks):
                if isinstance(b, wire.ToolResultBlock):
                    if pending:
                        yield Message(role=Role.USER, text="\n\n".join(pending))
                        pending = []
                    yield Message(
                        role=Role.TOOL,
                        text=_result_text(b.content, f"{where}.content.{j}.content"),
                        tool_call_id=b.tool_use_id,
                        tool_name=names.get(b.tool_use_id),
                        is_error=bool(b.is_error),
                    )
                elif isinstance(b, wire.TextBlock):
                    pending.append(b.text)
                elif isinstance(b, wire.ToolReferenceBlock):
                    pending.append(f"Tool loaded: {b.tool_name}")
                else:
                    raise _unsupported(b, f"{where}.content.{j}")
            if pending:
                yield Message(role=Role.USER, text="\n\n".join(pending))
        else:
            raise InvalidRequest(
                message=f"unknown role {quoted(m.role)} in messages.{i} (supported: user, assistant, system)",
                param=f"{where}.role",
            )


def _plain_text(blocks: list[Any], where: str) -> str:
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, wire.TextBlock):
            raise _unsupported(b, f"{where}.content.{j}")
        out.append(b.text)
    return "\n\n".join(out)


def _result_text(content: str | list[wire.ResultPart] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return _plain_text(list(content), where.rsplit(".content", 1)[0])


def _unsupported(block: Any, where: str) -> InvalidRequest:
    kind = {v: k for k, v in wire.BLOCK_TAGS.items()}.get(type(block), type(block).__name__)
    if kind in ("image", "document"):
        return InvalidRequest(message=f"{kind} input is not supported by this text-only model ({where})", param=where)
    return InvalidRequest(message=f"content block type {kind!r} is not allowed here ({where})", param=where)


def _tools(tools: list[wire.Tool]) -> Iterable[ToolSpec]:
    for t in tools:
        if t.defer_loading:
            continue  # never offered to the model: Claude Code loads these through ToolSearch
        if t.type not in (None, "custom"):
            continue  # server tools (web_search_…) run at Anthropic, not here
        schema = t.input_schema if t.input_schema is not None else {"type": "object", "properties": {}}
        yield ToolSpec(name=t.name, description=t.description or "", parameters=schema)


def _tool_choice(choice: wire.ToolChoice | None) -> ToolChoice:
    if choice is None:
        return ToolChoice()
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "auto":
        return ToolChoice(parallel=parallel)
    if choice.type == "none":
        return ToolChoice(mode=ToolChoiceMode.NONE)
    if choice.type == "any":
        return ToolChoice(mode=ToolChoiceMode.REQUIRED, parallel=parallel)
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest(message="tool_choice.name: a tool_choice of type 'tool' needs a name")
        return ToolChoice(mode=ToolChoiceMode.REQUIRED, name=choice.name, parallel=parallel)
    raise InvalidRequest(
        message=f"tool_choice.type: unknown type {quoted(choice.type)} (supported: auto, any, tool, none)",
        param="tool_choice.type",
    )


def usage_json(usage: ChatUsage) -> dict[str, int]:
    """Anthropic counts cached prompt tokens apart from input_tokens."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_prompt_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_use_id(neutral_id: str) -> str:
    return f"toolu_{neutral_id}"


def message_body(
    events: Iterable[ChatEvent], *, model: str, message_id: str, signer: ThinkingSigner | None = None
) -> dict[str, Any]:
    """The non-streaming response from a complete list of events."""
    content: list[dict[str, Any]] = []
    finished: TurnFinished | None = None
    for e in events:
        if isinstance(e, ReasoningDelta):
            if content and content[-1]["type"] == "thinking":
                content[-1]["thinking"] += e.text
            else:
                content.append({"type": "thinking", "thinking": e.text, "signature": ""})
        elif isinstance(e, TextDelta):
            if content and content[-1]["type"] == "text":
                content[-1]["text"] += e.text
            else:
                content.append({"type": "text", "text": e.text})
        elif isinstance(e, ToolCallEnd):
            args = common.loads_arguments(e.arguments)
            content.append({"type": "tool_use", "id": tool_use_id(e.id), "name": e.name, "input": args})
        elif isinstance(e, TurnFinished):
            finished = e
    for block in content:
        if block["type"] == "thinking":
            block["signature"] = signature(block["thinking"], signer)
    if finished is None:
        raise RuntimeError("the turn ended without a TurnFinished event")
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP_REASONS[finished.reason],
        "stop_sequence": finished.stop_sequence,
        "usage": usage_json(finished.usage),
    }


def models_body(names: list[str]) -> dict[str, Any]:
    """GET /v1/models in Anthropic's list shape."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    data = [{"type": "model", "id": n, "display_name": n, "created_at": created} for n in names]
    return {
        "data": data,
        "has_more": False,
        "first_id": names[0] if names else None,
        "last_id": names[-1] if names else None,
    }
