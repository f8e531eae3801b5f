"""Responses API request types, mirroring the JSON 1:1 (unknown keys are ignored by the converter)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class InputText:
    text: str


@attrs.frozen(kw_only=True)
class OutputText:
    text: str


@attrs.frozen(kw_only=True)
class Refusal:
    refusal: str


@attrs.frozen(kw_only=True)
class InputMedia:
    """input_image / input_file: accepted by the schema, refused by a text-only model."""


Part = InputText | OutputText | Refusal | InputMedia
PART_TAGS: dict[str, type] = {
    "input_text": InputText,
    "output_text": OutputText,
    "text": InputText,
    "refusal": Refusal,
    "input_image": InputMedia,
    "input_file": InputMedia,
}


@attrs.frozen(kw_only=True)
class MessageItem:
    role: str
    content: str | list[Part]


@attrs.frozen(kw_only=True)
class FunctionCallItem:
    call_id: str
    name: str
    arguments: str = ""
    namespace: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCallOutputItem:
    call_id: str
    output: str | list[Part]


@attrs.frozen(kw_only=True)
class SummaryText:
    text: str


@attrs.frozen(kw_only=True)
class ReasoningText:
    text: str


@attrs.frozen(kw_only=True)
class ReasoningItem:
    summary: list[SummaryText] = attrs.Factory(list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


@attrs.frozen(kw_only=True)
class CustomToolCallItem:
    call_id: str
    name: str
    input: str = ""


@attrs.frozen(kw_only=True)
class CustomToolCallOutputItem:
    call_id: str
    output: str | list[Part]


InputItem = (
    MessageItem
    | FunctionCallItem
    | FunctionCallOutputItem
    | ReasoningItem
    | CustomToolCallItem
    | CustomToolCallOutputItem
)
ITEM_TAGS: dict[str, type] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
    "custom_tool_call": CustomToolCallItem,
    "custom_tool_call_output": CustomToolCallOutputItem,
}


@attrs.frozen(kw_only=True)
class ReasoningConfig:
    effort: str | None = None
    summary: str | None = None


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # many tool types; the codec picks the ones a model can run
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: Any = None
    text: Any = None
    # Read only to refuse logprobs: silently answering without them would change what the client gets.
    top_logprobs: int | None = None
    include: list[str] | None = None
