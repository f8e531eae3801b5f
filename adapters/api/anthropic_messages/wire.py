"""Anthropic Messages request types, mirroring the JSON 1:1 (unknown keys are ignored by the converter)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class TextBlock:
    text: str


@attrs.frozen(kw_only=True)
class ImageBlock:
    source: Any = None


@attrs.frozen(kw_only=True)
class DocumentBlock:
    source: Any = None


@attrs.frozen(kw_only=True)
class ToolUseBlock:
    id: str
    name: str
    input: Any = attrs.Factory(dict)


ResultPart = TextBlock | ImageBlock | DocumentBlock


@attrs.frozen(kw_only=True)
class ToolResultBlock:
    tool_use_id: str
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None


@attrs.frozen(kw_only=True)
class ThinkingBlock:
    thinking: str
    signature: str | None = None


@attrs.frozen(kw_only=True)
class RedactedThinkingBlock:
    data: str = ""


@attrs.frozen(kw_only=True)
class ToolReferenceBlock:
    """Claude Code's tool-search result naming a tool whose schema was loaded."""

    tool_name: str = ""


ContentBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | ToolReferenceBlock
)

BLOCK_TAGS: dict[str, type] = {
    "text": TextBlock,
    "image": ImageBlock,
    "document": DocumentBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
    "tool_reference": ToolReferenceBlock,
}
RESULT_TAGS: dict[str, type] = {"text": TextBlock, "image": ImageBlock, "document": DocumentBlock}


@attrs.frozen(kw_only=True)
class InputMessage:
    role: str
    content: str | list[ContentBlock]


@attrs.frozen(kw_only=True)
class SystemBlock:
    text: str
    type: str = "text"


@attrs.frozen(kw_only=True)
class Tool:
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    defer_loading: bool | None = None


@attrs.frozen(kw_only=True)
class ToolChoice:
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


@attrs.frozen(kw_only=True)
class ThinkingConfig:
    type: str
    budget_tokens: int | None = None


@attrs.frozen(kw_only=True)
class CountTokensRequest:
    model: str
    messages: list[InputMessage]
    system: str | list[SystemBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


@attrs.frozen(kw_only=True)
class MessagesRequest:
    model: str
    max_tokens: int
    messages: list[InputMessage]
    system: str | list[SystemBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
