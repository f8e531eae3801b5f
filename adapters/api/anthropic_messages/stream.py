"""The Anthropic SSE sequence: message_start, ping, indexed content blocks, message_delta, message_stop.

Every frame carries its `event:` name (the SDK dispatches on it and silently drops unnamed events).
"""

from __future__ import annotations

from typing import Any

from mlx_dspark.adapters.api.anthropic_messages import codec, errors
from mlx_dspark.adapters.api.common import sse
from mlx_dspark.domain.chat import (
    ChatEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    TurnFinished,
)


class MessageStream:
    """Turns neutral events into Anthropic SSE frames for one response."""

    def __init__(
        self, *, model: str, message_id: str, input_tokens: int, signer: codec.ThinkingSigner | None = None
    ) -> None:
        self._signer = signer
        self._model = model
        self._id = message_id
        self._input_tokens = input_tokens
        self._index = -1
        self._open: str | None = None  # type of the open content block
        self._thinking: list[str] = []
        self.done = False

    def _frame(self, event: str, data: dict[str, Any]) -> bytes:
        return sse({"type": event, **data}, event=event)

    def start(self) -> list[bytes]:
        message = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self._input_tokens, "output_tokens": 0},
        }
        return [self._frame("message_start", {"message": message}), self.keepalive()]

    def keepalive(self) -> bytes:
        return self._frame("ping", {})

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            sig = codec.signature("".join(self._thinking), self._signer)
            out.append(
                self._frame(
                    "content_block_delta",
                    {"index": self._index, "delta": {"type": "signature_delta", "signature": sig}},
                )
            )
            self._thinking = []
        out.append(self._frame("content_block_stop", {"index": self._index}))
        self._open = None
        return out

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._index += 1
        self._open = kind
        out.append(self._frame("content_block_start", {"index": self._index, "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self._frame("content_block_delta", {"index": self._index, "delta": delta})

    def feed(self, event: ChatEvent) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, ReasoningDelta):
            if self._open != "thinking":
                out += self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking.append(event.text)
            out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, TextDelta):
            if self._open != "text":
                out += self._open_block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        elif isinstance(event, ToolCallStart):
            block = {"type": "tool_use", "id": codec.tool_use_id(event.id), "name": event.name, "input": {}}
            out += self._open_block("tool_use", block)
        elif isinstance(event, ToolCallArgsDelta):
            out.append(self._delta({"type": "input_json_delta", "partial_json": event.delta}))
        elif isinstance(event, ToolCallEnd):
            out += self._close()
        elif isinstance(event, TurnFinished):
            out += self._close()
            usage = codec.usage_json(event.usage)
            delta = {"stop_reason": codec.STOP_REASONS[event.reason], "stop_sequence": event.stop_sequence}
            out.append(self._frame("message_delta", {"delta": delta, "usage": usage}))
            out.append(self._frame("message_stop", {}))
            self.done = True
        return out

    def error(self, exc: BaseException) -> list[bytes]:
        """A mid-stream failure as Anthropic's `error` event."""
        _, body = errors.from_exception(exc)
        self.done = True
        return [sse(body, event="error")]
