"""A conversation in neutral terms: roles, text, thinking, tool calls and tool results, tool specs."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.tokens import SamplingParams


class Role(enum.Enum):
    """Who said a message. `developer` and other system-like roles arrive here as SYSTEM."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@attrs.frozen(kw_only=True)
class ToolCall:
    """A call the assistant made; `arguments` is the decoded JSON object."""

    id: str
    name: str
    arguments: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class Message:
    """One turn.

    Attributes:
        role: who said it.
        text: its visible text ("" when none).
        thinking: the assistant's reasoning for this turn ("" when none).
        tool_calls: calls made by an assistant turn.
        tool_call_id: for a TOOL message, the call it answers.
        tool_name: for a TOOL message, the called tool's name when known.
        is_error: for a TOOL message, whether the tool failed.
    """

    role: Role
    text: str = ""
    thinking: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    tool_name: str | None = None
    is_error: bool = False


@attrs.frozen(kw_only=True)
class ToolSpec:
    """A tool offered to the model; `parameters` is its JSON schema (an object schema)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = attrs.field(factory=lambda: {"type": "object", "properties": {}})


class ToolChoiceMode(enum.Enum):
    """auto = the model decides; none = no calls; required = at least one call."""

    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"


@attrs.frozen(kw_only=True)
class ToolChoice:
    """Whether (and which) tools the model may call.

    Attributes:
        mode: auto, none or required.
        name: that one tool must be called (mode is REQUIRED).
        allowed: only these tools may be called (all tools stay in the prompt, so its prefix stays cached);
            None = every offered tool.
        parallel: more than one call per turn may be made (False: the turn ends with its first call).
    """

    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None
    allowed: tuple[str, ...] | None = None
    parallel: bool = True


@attrs.frozen(kw_only=True)
class Conversation:
    """The system prompt, the turns in order (system turns may appear mid-way), and the tools offered."""

    system: str = ""
    messages: tuple[Message, ...] = ()
    tools: tuple[ToolSpec, ...] = ()


def _check_positive(_: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and value < 1:
        raise InvalidRequest(message=f"{attribute.name} must be >= 1, got {value}", param=attribute.name)


@attrs.frozen(kw_only=True)
class ChatRequest:
    """One chat request in neutral terms.

    Attributes:
        conversation: what the model sees.
        model: the model name the client asked for.
        max_tokens: the output cap the client asked for (None = as much as fits).
        sampling: temperature, top-p, top-k, seed.
        stop: stop strings.
        thinking: True/False to switch the template's thinking on/off; None = the template's default.
        tool_choice: whether tools may be called.
        strict_budget: reject (instead of shrinking) a max_tokens that does not fit the context window.
        request_id: for logs.
    """

    conversation: Conversation
    model: str = ""
    max_tokens: int | None = attrs.field(default=None, validator=_check_positive)
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    thinking: bool | None = None
    tool_choice: ToolChoice = ToolChoice()
    strict_budget: bool = False
    request_id: str = ""
