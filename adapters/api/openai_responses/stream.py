"""The Responses SSE sequence: response.created first, sequence numbers, one output item at a time,
content_part.added before deltas, and response.completed last (the caller closes the body right after).

The same state machine also builds the non-streaming Response, so both paths agree by construction.
"""

from __future__ import annotations

import json
import time
from typing import Any

from mlx_dspark.adapters.api.common import new_id, sse
from mlx_dspark.adapters.api.openai_responses import codec, errors, wire
from mlx_dspark.domain.chat import (
    ChatEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    TurnFinished,
)
from mlx_dspark.domain.tokens import FinishReason


class ResponseStream:
    """Turns neutral events into Responses stream events and keeps the growing Response."""

    def __init__(self, req: wire.ResponsesRequest, tool_map: codec.ToolMap, *, response_id: str) -> None:
        self._req = req
        self._tools = tool_map
        self.response_id = response_id
        self._created = int(time.time())
        self._seq = 0
        self.output: list[dict[str, Any]] = []
        self._item: dict[str, Any] | None = None  # the open output item
        self._text: list[str] = []
        self._custom: _InputReader | None = None  # decodes a custom tool's input as its arguments stream
        self.final: dict[str, Any] | None = None
        self.done = False

    # ---- framing ------------------------------------------------------------------------------------

    def _ev(self, kind: str, **data: Any) -> bytes:
        frame = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return sse(frame, event=kind)

    def _item_ev(self, kind: str, **data: Any) -> bytes:
        """An event about the open output item (it carries the item's id and output index)."""
        return self._ev(kind, item_id=self._item_id, output_index=self._index, **data)

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        return codec.response_json(
            self._req, response_id=self.response_id, created_at=self._created, status=status, **extra
        )

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def start(self) -> list[bytes]:
        snapshot = self._response("in_progress", output=[])
        return [self._ev("response.created", response=snapshot), self._ev("response.in_progress", response=snapshot)]

    def keepalive(self) -> bytes:
        """A repeated response.in_progress: valid, ignored by clients, resets their idle timers."""
        return self._ev("response.in_progress", response=self._response("in_progress", output=[]))

    # ---- items --------------------------------------------------------------------------------------

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.output.append(item)
        self._item = item
        self._text = []
        out.append(self._ev("response.output_item.added", output_index=self._index, item=dict(item)))
        return out

    def _close(self) -> list[bytes]:
        item, self._item = self._item, None
        if item is None:
            return []
        out: list[bytes] = []
        ids = {"item_id": item["id"], "output_index": self._index}
        text = "".join(self._text)
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._ev("response.output_text.done", **ids, content_index=0, text=text, logprobs=[]))
            out.append(self._ev("response.content_part.done", **ids, content_index=0, part=part))
            item["content"] = [part]
        elif item["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            out.append(self._ev("response.reasoning_summary_text.done", **ids, summary_index=0, text=text))
            out.append(self._ev("response.reasoning_summary_part.done", **ids, summary_index=0, part=part))
            item["summary"] = [part]
            item["content"] = [{"type": "reasoning_text", "text": text}]
            item["encrypted_content"] = codec.encode_reasoning(text)
        elif item["type"] == "function_call":
            item["arguments"] = text
            out.append(self._ev("response.function_call_arguments.done", **ids, arguments=text))
        elif item["type"] == "custom_tool_call":
            value = _custom_input(text)
            item["input"] = value
            sent = self._custom.text if self._custom is not None else ""
            if not value.startswith(sent):  # pragma: no cover - our arguments are canonical JSON
                sent = ""
            if value[len(sent) :]:
                out.append(self._ev("response.custom_tool_call_input.delta", **ids, delta=value[len(sent) :]))
            out.append(self._ev("response.custom_tool_call_input.done", **ids, input=value))
            self._custom = None
        item["status"] = "completed"
        out.append(self._ev("response.output_item.done", output_index=self._index, item=item))
        return out

    def feed(self, event: ChatEvent) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, ReasoningDelta):
            if self._item is None or self._item["type"] != "reasoning":
                out += self._open({"id": new_id("rs_"), "type": "reasoning", "summary": [], "status": "in_progress"})
                out.append(
                    self._item_ev(
                        "response.reasoning_summary_part.added",
                        summary_index=0,
                        part={"type": "summary_text", "text": ""},
                    )
                )
            self._text.append(event.text)
            out.append(self._item_ev("response.reasoning_summary_text.delta", summary_index=0, delta=event.text))
        elif isinstance(event, TextDelta):
            if self._item is None or self._item["type"] != "message":
                item = {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress"}
                out += self._open({**item, "content": []})
                out.append(
                    self._item_ev(
                        "response.content_part.added",
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                    )
                )
            self._text.append(event.text)
            out.append(self._item_ev("response.output_text.delta", content_index=0, delta=event.text, logprobs=[]))
        elif isinstance(event, ToolCallStart):
            call_id = f"call_{event.id}"
            if event.name in self._tools.custom:
                item = {"id": f"ctc_{event.id}", "type": "custom_tool_call", "call_id": call_id, "name": event.name}
                out += self._open({**item, "input": "", "status": "in_progress"})
                self._custom = _InputReader()
            else:
                item = {"id": f"fc_{event.id}", "type": "function_call", "call_id": call_id, "name": event.name}
                if event.name in self._tools.namespaces:
                    item["namespace"] = self._tools.namespaces[event.name]
                out += self._open({**item, "arguments": "", "status": "in_progress"})
        elif isinstance(event, ToolCallArgsDelta):
            self._text.append(event.delta)
            if self._item is not None and self._item["type"] == "function_call":
                out.append(self._item_ev("response.function_call_arguments.delta", delta=event.delta))
            elif self._item is not None and self._custom is not None:
                piece = self._custom.feed(event.delta)
                if piece:
                    out.append(self._item_ev("response.custom_tool_call_input.delta", delta=piece))
        elif isinstance(event, ToolCallEnd):
            out += self._close()
        elif isinstance(event, TurnFinished):
            out += self._close()
            incomplete = event.reason in (FinishReason.LENGTH, FinishReason.CONTEXT)
            self.final = self._response(
                "incomplete" if incomplete else "completed",
                output=self.output,
                usage=event.usage,
                incomplete_reason="max_output_tokens" if incomplete else None,
                completed_at=int(time.time()),
            )
            # response.completed even when cut short: Codex and the SDK helper finish only on this event
            out.append(self._ev("response.completed", response=self.final))
            self.done = True
        return out

    @property
    def _item_id(self) -> str:
        assert self._item is not None
        return str(self._item["id"])

    def error(self, exc: BaseException) -> list[bytes]:
        """A mid-stream failure as response.failed (Codex reads `error.code`)."""
        _, message, _, code = errors.classify(exc)
        self.done = True
        failed = self._response(
            "failed", output=self.output, error={"code": code or "server_error", "message": message}
        )
        return [self._ev("response.failed", response=failed)]


def _custom_input(arguments: str) -> str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return arguments


class _InputReader:
    """Decodes the `input` string of streamed `{"input": "…"}` arguments as they arrive (raw text for Codex)."""

    _PREFIX = '{"input": "'

    def __init__(self) -> None:
        self._raw = ""
        self._pos = len(self._PREFIX)
        self._closed = False
        self.text = ""  # decoded so far

    def feed(self, delta: str) -> str:
        self._raw += delta
        if self._closed or not self._raw.startswith(self._PREFIX[: len(self._raw)]):
            return ""
        out: list[str] = []
        raw, i = self._raw, self._pos
        while i < len(raw):
            c = raw[i]
            if c == '"':
                self._closed = True
                break
            if c != "\\":
                out.append(c)
                i += 1
                continue
            size = 2
            if raw[i + 1 : i + 2] == "u":
                size = 12 if raw[i + 2 : i + 4].lower() in ("d8", "d9", "da", "db") else 6  # surrogate pairs
            if i + size > len(raw) or i + 1 >= len(raw):
                break
            out.append(json.loads('"' + raw[i : i + size] + '"'))
            i += size
        self._pos = i
        piece = "".join(out)
        self.text += piece
        return piece
