"""Responses ↔ the neutral chat model: one converter, request translation (tools, history), Response objects.

Codex's `custom` (freeform) tools become function tools with one string parameter `input` and come back
as `custom_tool_call` items; `namespace` groups are unwrapped; tool types a model cannot run are skipped.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import attrs

from mlx_dspark.adapters.api import common
from mlx_dspark.adapters.api.openai_responses import wire
from mlx_dspark.domain.chat import (
    ChatRequest,
    ChatUsage,
    Conversation,
    Message,
    Role,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from mlx_dspark.domain.errors import InvalidRequest, quoted
from mlx_dspark.domain.tokens import SamplingParams

REASONING_PREFIX = "mlx-dspark:v1:"
_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT}

converter = common.strict_converter()
common.register_tagged(converter, wire.Part, wire.PART_TAGS, "content part")
common.register_text_or_list(converter, str | list[wire.Part], wire.Part)


def _structure_item(v: Any, _: Any) -> Any:
    if isinstance(v, dict) and "type" not in v and "role" in v:
        v = {**v, "type": "message"}  # EasyInputMessage has no type
    if isinstance(v, dict) and v.get("type") in ("item_reference", "compaction"):
        raise common.WireValueError(
            f"input items of type {quoted(v['type'])} are not supported; send the whole conversation (store: false)"
        )
    if not isinstance(v, dict):
        raise common.WireValueError("expected an input item object")
    cls = wire.ITEM_TAGS.get(v.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise common.WireValueError(
            f"unknown input item type {quoted(v.get('type'))} (supported: {', '.join(wire.ITEM_TAGS)})"
        )
    return converter.structure(v, cls)


converter.register_structure_hook(wire.InputItem, _structure_item)
common.register_text_or_list(converter, str | list[wire.InputItem], wire.InputItem)


@attrs.frozen(kw_only=True)
class ToolMap:
    """How tool names the model sees map back to Responses output items."""

    custom: frozenset[str] = frozenset()
    namespaces: Mapping[str, str] = attrs.field(factory=dict)


def parse(body: Any) -> wire.ResponsesRequest:
    return common.structure(converter, body, wire.ResponsesRequest)


def encode_reasoning(text: str) -> str:
    """Our `encrypted_content`: the thinking text, opaque to clients, replayed back to us."""
    return REASONING_PREFIX + base64.b64encode(text.encode()).decode()


def decode_reasoning(item: wire.ReasoningItem) -> str:
    if item.encrypted_content and item.encrypted_content.startswith(REASONING_PREFIX):
        try:
            return base64.b64decode(item.encrypted_content[len(REASONING_PREFIX) :]).decode()
        except ValueError:
            pass
    if item.content:
        return "\n".join(p.text for p in item.content)
    return "\n".join(p.text for p in item.summary)


def to_chat_request(
    req: wire.ResponsesRequest, history: tuple[Message, ...] = (), request_id: str = ""
) -> tuple[ChatRequest, ToolMap]:
    """The neutral request and the tool map for turning calls back into items.

    Args:
        req: the parsed request.
        history: earlier turns restored from `previous_response_id`.
        request_id: for logs.

    Raises:
        InvalidRequest: unknown roles, media content, malformed tools or arguments.
    """
    _refuse_logprobs(req)
    common.check_range(req.temperature, "temperature", 0, 2)  # OpenAI's ranges
    common.check_range(req.top_p, "top_p", 0, 1)
    tools, tool_map = _tools(req.tools or [])
    messages = list(history) + _messages(req.input)
    effort = req.reasoning.effort if req.reasoning else None
    thinking = None if effort is None else effort not in ("none", "minimal")
    return (
        ChatRequest(
            conversation=Conversation(system=req.instructions or "", messages=tuple(messages), tools=tuple(tools)),
            model=req.model,
            max_tokens=req.max_output_tokens,
            sampling=SamplingParams(
                temperature=req.temperature if req.temperature is not None else 0.0,
                top_p=req.top_p if req.top_p is not None else 1.0,
            ),
            thinking=thinking,
            tool_choice=attrs.evolve(_tool_choice(req.tool_choice), parallel=req.parallel_tool_calls is not False),
            request_id=request_id,
        ),
        tool_map,
    )


def _refuse_logprobs(req: wire.ResponsesRequest) -> None:
    """Log probabilities are not implemented: say so instead of answering without them."""
    if req.top_logprobs:
        raise InvalidRequest(message="top_logprobs is not supported by this server", param="top_logprobs")
    if req.include and "message.output_text.logprobs" in req.include:
        raise InvalidRequest(message="logprobs are not supported by this server", param="include")


def _part_text(content: str | list[wire.Part], where: str) -> str:
    if isinstance(content, str):
        return content
    out = common.part_texts(
        content, text=wire.InputText | wire.OutputText, refusal=wire.Refusal, refused="image and file", where=where
    )
    return "\n\n".join(out) if all(isinstance(p, wire.InputText) for p in content) else "".join(out)


def _messages(items: str | list[wire.InputItem]) -> list[Message]:
    if isinstance(items, str):
        return [Message(role=Role.USER, text=items)]
    out: list[Message] = []
    names: dict[str, str] = {}
    turn: dict[str, Any] | None = None  # the assistant turn being assembled from consecutive items

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            out.append(
                Message(
                    role=Role.ASSISTANT,
                    text="".join(turn["text"]),
                    thinking="\n".join(turn["thinking"]),
                    tool_calls=tuple(turn["calls"]),
                )
            )
            turn = None

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"text": [], "thinking": [], "calls": []}
        return turn

    for i, item in enumerate(items):
        where = f"input.{i}"
        if isinstance(item, wire.MessageItem):
            role = _ROLES.get(item.role)
            if role is None:
                raise InvalidRequest(
                    message=f"unknown role {quoted(item.role)} in {where} "
                    "(supported: system, developer, user, assistant)",
                    param=f"{where}.role",
                )
            text = _part_text(item.content, f"{where}.content")
            if role is Role.ASSISTANT:
                t = assistant()
                if t["calls"]:  # text after calls starts a new assistant turn
                    flush()
                    t = assistant()
                t["text"].append(text)
            else:
                flush()
                out.append(Message(role=role, text=text))
        elif isinstance(item, wire.ReasoningItem):
            t = assistant()
            if t["calls"] or t["text"]:
                flush()
                t = assistant()
            t["thinking"].append(decode_reasoning(item))
        elif isinstance(item, wire.FunctionCallItem):
            names[item.call_id] = item.name
            args = common.loads_arguments(item.arguments)
            assistant()["calls"].append(ToolCall(id=item.call_id, name=item.name, arguments=args))
        elif isinstance(item, wire.CustomToolCallItem):
            names[item.call_id] = item.name
            assistant()["calls"].append(ToolCall(id=item.call_id, name=item.name, arguments={"input": item.input}))
        else:  # function_call_output / custom_tool_call_output
            flush()
            out.append(
                Message(
                    role=Role.TOOL,
                    text=_part_text(item.output, f"{where}.output"),
                    tool_call_id=item.call_id,
                    tool_name=names.get(item.call_id),
                )
            )
    flush()
    return out


def _tools(raw: list[dict[str, Any]]) -> tuple[list[ToolSpec], ToolMap]:
    specs: list[ToolSpec] = []
    custom: set[str] = set()
    namespaces: dict[str, str] = {}

    def add(t: Mapping[str, Any], where: str, namespace: str | None) -> None:
        kind = t.get("type")
        if kind not in ("function", "custom"):
            return  # web_search, file_search, mcp, …: nothing here can run them
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(message=f"{where}: a {kind} tool needs a name", param=f"{where}.name")
        description = t.get("description") if isinstance(t.get("description"), str) else ""
        if kind == "function":
            params = t.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise InvalidRequest(message=f"{where}.parameters must be an object", param=f"{where}.parameters")
            specs.append(
                ToolSpec(name=name, description=description, parameters=params or {"type": "object", "properties": {}})
            )
        else:
            custom.add(name)
            specs.append(_freeform(name, description, t.get("format")))
        if namespace:
            namespaces[name] = namespace

    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise InvalidRequest(message=f"tools.{i} must be an object", param=f"tools.{i}")
        if t.get("type") == "namespace":
            for j, inner in enumerate(t.get("tools") or []):
                if isinstance(inner, dict):
                    add(inner, f"tools.{i}.tools.{j}", t.get("name") if isinstance(t.get("name"), str) else None)
        else:
            add(t, f"tools.{i}", None)
    return specs, ToolMap(custom=frozenset(custom), namespaces=namespaces)


def _freeform(name: str, description: str, fmt: Any) -> ToolSpec:
    note = ""
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        note = f"\n\nThe input must follow this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    schema = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": "the tool's raw input text"}},
        "required": ["input"],
    }
    return ToolSpec(name=name, description=description + note, parameters=schema)


def _tool_choice(choice: Any) -> ToolChoice:
    return common.openai_tool_choice(choice, _tool_choice_object)


def _tool_choice_object(choice: dict[str, Any], kind: Any) -> ToolChoice | None:
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        return ToolChoice(mode=ToolChoiceMode.REQUIRED, name=choice["name"])
    if kind == "allowed_tools":
        return common.allowed_tool_choice(choice.get("mode"), choice.get("tools"), lambda t: t.get("name"))
    if isinstance(kind, str):
        raise InvalidRequest(
            message=f"tool_choice {quoted(kind)} names a hosted tool, which this server cannot run", param="tool_choice"
        )
    return None


def usage_json(usage: ChatUsage) -> dict[str, Any]:
    """Codex requires every field, the detail objects included."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def response_json(
    req: wire.ResponsesRequest,
    *,
    response_id: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: ChatUsage | None = None,
    incomplete_reason: str | None = None,
    error: dict[str, Any] | None = None,
    completed_at: int | None = None,
) -> dict[str, Any]:
    """A full Response object (every field the OpenResponses checks expect is present)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": completed_at,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "reasoning": {
            "effort": req.reasoning.effort if req.reasoning else None,
            "summary": req.reasoning.summary if req.reasoning else None,
        },
        "store": bool(req.store),
        "temperature": req.temperature if req.temperature is not None else 0.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": usage_json(usage) if usage is not None else None,
        "metadata": req.metadata if isinstance(req.metadata, dict) else {},
    }
