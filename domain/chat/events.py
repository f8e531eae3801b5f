"""Neutral output events of one chat turn, produced by family parsers and consumed by dialect streams."""

from __future__ import annotations

import attrs

from mlx_dspark.domain.tokens import FinishReason


@attrs.frozen
class TextDelta:
    """Visible assistant text."""

    text: str


@attrs.frozen
class ReasoningDelta:
    """Thinking text."""

    text: str


@attrs.frozen(kw_only=True)
class ToolCallStart:
    """A validated tool call begins; `index` counts calls in this turn from 0."""

    index: int
    id: str
    name: str


@attrs.frozen(kw_only=True)
class ToolCallArgsDelta:
    """A fragment of the call's JSON arguments; the fragments of one call concatenate to valid JSON."""

    index: int
    delta: str


@attrs.frozen(kw_only=True)
class ToolCallEnd:
    """The call is complete; `arguments` is its whole JSON object text."""

    index: int
    id: str
    name: str
    arguments: str


@attrs.frozen(kw_only=True)
class ChatUsage:
    """Token accounting of one turn."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen(kw_only=True)
class TurnFinished:
    """The turn ended (always the last event); `reason` is the decode loop's FinishReason."""

    reason: FinishReason
    usage: ChatUsage
    stop_sequence: str | None = None


ChatEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | TurnFinished
