"""The neutral chat model: conversations in, output events out; every dialect and family translates to these."""

from mlx_dspark.domain.chat.conversation import (
    ChatRequest,
    Conversation,
    Message,
    Role,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from mlx_dspark.domain.chat.errors import OutputTooLong, PromptTooLong
from mlx_dspark.domain.chat.events import (
    ChatEvent,
    ChatUsage,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    TurnFinished,
)

__all__ = [
    "ChatEvent",
    "ChatRequest",
    "ChatUsage",
    "Conversation",
    "Message",
    "OutputTooLong",
    "PromptTooLong",
    "ReasoningDelta",
    "Role",
    "TextDelta",
    "ToolCall",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "ToolChoice",
    "ToolChoiceMode",
    "ToolSpec",
    "TurnFinished",
]
