"""Chat Completions request types, mirroring the JSON 1:1 (unknown keys are ignored by the converter)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class TextPart:
    text: str


@attrs.frozen(kw_only=True)
class RefusalPart:
    refusal: str


@attrs.frozen(kw_only=True)
class MediaPart:
    """image_url, input_audio and file parts: accepted by the schema, refused by a text-only model."""


ContentPart = TextPart | RefusalPart | MediaPart
PART_TAGS: dict[str, type] = {
    "text": TextPart,
    "refusal": RefusalPart,
    "image_url": MediaPart,
    "input_audio": MediaPart,
    "file": MediaPart,
}


@attrs.frozen(kw_only=True)
class FunctionCall:
    name: str
    arguments: str = ""


@attrs.frozen(kw_only=True)
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"


@attrs.frozen(kw_only=True)
class ChatMessage:
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


@attrs.frozen(kw_only=True)
class FunctionDef:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class Tool:
    type: str
    function: FunctionDef | None = None


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_usage: bool | None = None


@attrs.frozen(kw_only=True)
class ChatCompletionRequest:
    model: str
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int | None = None
    # Read only to refuse them when set: silently ignoring them would change what the client gets.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
