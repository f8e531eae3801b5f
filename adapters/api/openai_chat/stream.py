"""The Chat Completions SSE sequence: `data:` chunks, tool-call deltas with `index`, usage chunk, `[DONE]`."""

from __future__ import annotations

from typing import Any

from mlx_dspark.adapters.api.common import sse
from mlx_dspark.adapters.api.openai_chat import codec, errors
from mlx_dspark.domain.chat import ChatEvent, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart, TurnFinished


class CompletionStream:
    """Turns neutral events into chat.completion.chunk frames for one response."""

    def __init__(self, *, model: str, completion_id: str, created: int, include_usage: bool) -> None:
        self._model = model
        self._id = completion_id
        self._created = created
        self._include_usage = include_usage
        self._call_ids: dict[int, str] = {}
        self.done = False

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "system_fingerprint": "mlx-dspark",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        }
        if self._include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def keepalive(self) -> bytes:
        return b": keep-alive\n\n"  # an SSE comment: clients skip it, idle timers reset

    def feed(self, event: ChatEvent) -> list[bytes]:
        if isinstance(event, TextDelta):
            return [self._chunk({"content": event.text})]
        if isinstance(event, ReasoningDelta):
            return [self._chunk({"reasoning_content": event.text})]
        if isinstance(event, ToolCallStart):
            self._call_ids[event.index] = codec.call_id(event.id)
            call = {
                "index": event.index,
                "id": codec.call_id(event.id),
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            return [self._chunk({"tool_calls": [call]})]
        if isinstance(event, ToolCallArgsDelta):
            return [self._chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.delta}}]})]
        if isinstance(event, TurnFinished):
            out = [self._chunk({}, codec.FINISH_REASONS[event.reason])]
            if self._include_usage:
                out.append(
                    sse(
                        {
                            "id": self._id,
                            "object": "chat.completion.chunk",
                            "created": self._created,
                            "model": self._model,
                            "system_fingerprint": "mlx-dspark",
                            "choices": [],
                            "usage": codec.usage_json(event.usage),
                        }
                    )
                )
            out.append(sse("[DONE]"))
            self.done = True
            return out
        return []

    def error(self, exc: BaseException) -> list[bytes]:
        """A mid-stream failure: a `data:` payload with an `error` key (the SDK raises APIError)."""
        _, body = errors.from_exception(exc)
        self.done = True
        return [sse(body), sse("[DONE]")]
