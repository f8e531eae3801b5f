"""Shared machinery of family codecs: conversation → template messages, and an incremental output parser.

A family codec differs only in its markers and in how one call is written and read; the streaming state
machine (text / thinking / tool call, holding back partial markers) is the same for all of them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from mlx_dspark.adapters.families.validation import ArgumentValidator
from mlx_dspark.domain.chat import (
    ChatEvent,
    Conversation,
    Message,
    ReasoningDelta,
    Role,
    TextDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)
from mlx_dspark.domain.model import ChatMessages, TemplateVars, ToolSpecs

# (name, arguments) pairs read from one tool-call block, or None when the block is not a call.
ParsedCalls = list[tuple[str, Any]] | None
MID_SYSTEM_TAG = "system"


class ChatTemplate(Protocol):
    """The part of the tokenizer a codec uses (structurally the application's Tokenizer port)."""

    @property
    def chat_template(self) -> str | None: ...

    def render_chat(
        self, messages: ChatMessages, *, tools: ToolSpecs | None = None, template_kwargs: TemplateVars | None = None
    ) -> str: ...


@attrs.frozen(kw_only=True)
class RenderedPrompt:
    """The prompt text and whether it leaves the model inside an open thinking block."""

    text: str
    starts_in_thinking: bool


class FamilyCodec:
    """Renders conversations for one model family and parses its output.

    Subclasses set the markers and implement `parse_calls` and `format_call`.

    Args:
        native_tools: the chat template renders `tools`, assistant `tool_calls` and `tool` turns itself;
            otherwise tools go into the system prompt as text and tool history is written out as text.
        think: the (open, close) thinking markers, or None when the family does not think.
        calls_in_content: put earlier tool calls into the assistant content as text even with native
            tools (templates that only print `content`).
    """

    name = "base"
    tool_start = ""
    tool_end = ""

    def __init__(
        self,
        *,
        native_tools: bool,
        think: tuple[str, str] | None = None,
        calls_in_content: bool = False,
    ) -> None:
        self.native_tools = native_tools
        self.think = think
        self.calls_in_content = calls_in_content

    # ---- family specifics -------------------------------------------------------------------------

    def parse_calls(self, body: str, validator: ArgumentValidator) -> ParsedCalls:
        """Read the calls between one pair of tool markers (body excludes the markers)."""
        raise NotImplementedError

    def format_call(self, call: ToolCall) -> str:
        """One earlier call written the way the model writes it, markers included."""
        raise NotImplementedError

    def call_opening(self, name: str | None) -> str:
        """The start of a call body (after `tool_start`) that commits the model to calling `name`
        (None: to some tool). Primed after the generation prompt when tool_choice forces a call."""
        return ""

    def call_reader(self, validator: ArgumentValidator, index: int, make_id: Callable[[], str]) -> CallReader | None:
        """An incremental reader of one call body, so its arguments stream; None: parse the block at its end."""
        return None

    def forced_call(self, name: str | None, *, in_thinking: bool) -> tuple[str, str]:
        """(text to append to the prompt, what the parser has already 'seen') for a call the model must make.

        A prompt that leaves the model thinking is closed first: a forced call is made without reasoning.
        """
        opening = self.call_opening(name)
        close = f"{self.think[1]}\n\n" if (in_thinking and self.think) else ""
        return close + self.tool_start + opening, opening

    def tools_instructions(self, tools: Sequence[ToolSpec]) -> str:
        """System-prompt text that offers tools when the template cannot (Hermes style by default)."""
        lines = "\n".join(json.dumps(_tool_json(t), ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou can call functions to help with the request. Their signatures are listed "
            f"inside <tools></tools>:\n<tools>\n{lines}\n</tools>\n\nTo call a function, reply with a JSON "
            "object holding its name and arguments inside <tool_call></tool_call> tags, like this:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>'
        )

    def tool_result_text(self, message: Message) -> str:
        """A tool result written into a user turn (templates without tool support)."""
        return f"<tool_response>\n{message.text}\n</tool_response>"

    # ---- rendering -----------------------------------------------------------------------------------

    def render(
        self,
        template: ChatTemplate,
        conversation: Conversation,
        *,
        thinking: bool | None,
        offer_tools: bool = True,
    ) -> RenderedPrompt:
        """The conversation through the tokenizer's chat template, ending with the generation prompt."""
        tools = conversation.tools if offer_tools else ()
        messages = self.template_messages(conversation, tools)
        kwargs: dict[str, Any] = {}
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        text = template.render_chat(
            messages,
            tools=[_tool_json(t) for t in tools] if (tools and self.native_tools) else None,
            template_kwargs=kwargs or None,
        )
        opened = self.think is not None and text.rstrip().endswith(self.think[0])
        return RenderedPrompt(text=text, starts_in_thinking=opened)

    def template_messages(self, conversation: Conversation, tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
        """Neutral turns as the OpenAI-style dicts that HF chat templates read.

        Mid-conversation system turns are folded into the neighbouring user turn inside a tag: most
        templates accept a system message only first, and earlier turns stay byte-identical so the
        prefix cache still hits.
        """
        system = conversation.system
        if tools and not self.native_tools:
            system = f"{system}\n\n{self.tools_instructions(tools)}" if system else self.tools_instructions(tools)
        out: list[dict[str, Any]] = []
        if system:
            out.append({"role": "system", "content": system})
        seen_turn = False
        for m in conversation.messages:
            if m.role is Role.SYSTEM:
                if not seen_turn and out and out[0]["role"] == "system":
                    out[0]["content"] += "\n\n" + m.text
                elif not seen_turn:
                    out.insert(0, {"role": "system", "content": m.text})
                else:
                    out.append({"role": "user", "content": f"<{MID_SYSTEM_TAG}>\n{m.text}\n</{MID_SYSTEM_TAG}>"})
                continue
            seen_turn = True
            if m.role is Role.USER:
                out.append({"role": "user", "content": m.text})
            elif m.role is Role.ASSISTANT:
                out.append(self._assistant(m))
            elif self.native_tools:
                out.append(
                    {"role": "tool", "tool_call_id": m.tool_call_id or "", "name": m.tool_name or "", "content": m.text}
                )
            else:
                out.append({"role": "user", "content": self.tool_result_text(m)})
        return _merge_user_turns(out)

    def _assistant(self, m: Message) -> dict[str, Any]:
        content = m.text
        msg: dict[str, Any] = {"role": "assistant"}
        if m.tool_calls and (not self.native_tools or self.calls_in_content):
            calls = "\n".join(self.format_call(c) for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        elif m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.thinking:
            msg["reasoning_content"] = m.thinking
        msg["content"] = content
        return msg

    # ---- parsing -------------------------------------------------------------------------------------

    def parser(
        self,
        tools: Sequence[ToolSpec],
        *,
        starts_in_thinking: bool = False,
        id_factory: Callable[[], str] | None = None,
        forced: str | None = None,
    ) -> StreamParser:
        """A fresh incremental parser for one turn; no tools = tool markers are plain text.

        Args:
            forced: the turn starts inside a call whose body begins with this text (see `forced_call`).
        """
        return StreamParser(
            self, ArgumentValidator(tuple(tools)), bool(tools), starts_in_thinking, id_factory, forced=forced
        )


class CallReader(Protocol):
    """Reads one call body incrementally (see incremental.JsonCallReader)."""

    released: bool

    @property
    def fallback(self) -> bool: ...

    def feed(self, chunk: str) -> list[ChatEvent]: ...

    def finish(self) -> tuple[list[ChatEvent], str, bool]: ...


def _tool_json(t: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)},
    }


def _merge_user_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join adjacent plain user turns (templates that insist on alternation reject two in a row)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if out and m["role"] == "user" and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{m['content']}"}
        else:
            out.append(dict(m))
    return out


_TEXT, _THINK, _TOOL = "text", "think", "tool"


class _Channel:
    """Text of one kind (visible or reasoning) with whitespace trimmed at block boundaries."""

    def __init__(self, make: Callable[[str], ChatEvent]) -> None:
        self._make = make
        self._ws = ""  # trailing whitespace held until more text arrives
        self._held = ""  # whitespace dropped at the last marker (restored if the marker was not one)
        self.boundary = True  # drop leading whitespace (start of turn, after a marker)

    def put(self, text: str, out: list[ChatEvent]) -> None:
        if not text:
            return
        text = self._ws + text
        self._ws = self._held = ""
        if self.boundary:
            text = text.lstrip()
            if not text:
                return
            self.boundary = False
        body = text.rstrip()
        self._ws = text[len(body) :]
        if body:
            out.append(self._make(body))

    def close(self) -> None:
        self._held, self._ws = self._ws, ""
        self.boundary = True

    def reopen(self) -> None:
        """Undo the last close: what looked like a marker turned out to be plain text."""
        self._ws, self._held = self._held, ""
        self.boundary = False


class StreamParser:
    """Splits streamed model text into text, reasoning and validated tool calls.

    Partial markers at the end of a chunk are held back until the next chunk decides them. A call block
    is buffered until its end marker, then parsed and validated against the tool's schema; anything
    that fails is passed on as plain text, so a client never sees an invalid call.
    """

    def __init__(
        self,
        codec: FamilyCodec,
        validator: ArgumentValidator,
        tools_enabled: bool,
        starts_in_thinking: bool,
        id_factory: Callable[[], str] | None,
        *,
        forced: str | None = None,
    ) -> None:
        self._codec = codec
        self._validator = validator
        self._tools = tools_enabled and bool(codec.tool_start)
        self._ids = id_factory or (lambda: uuid.uuid4().hex[:24])
        self._state = _THINK if (starts_in_thinking and codec.think) else _TEXT
        self._buf = ""
        self._text = _Channel(TextDelta)
        self._reason = _Channel(ReasoningDelta)
        self.calls = 0
        self.cut = False  # a call went out that the model did not finish (see incremental.JsonCallReader)
        self.reasoning_text: list[str] = []
        self._raw = ""  # the open call's body so far
        self._reader: CallReader | None = None
        self._pending: list[ChatEvent] = []  # events of a forced opening, sent with the first feed
        if forced is not None and self._tools:
            self._state = _TEXT
            self._enter_call()
            self._feed_call(forced, self._pending)

    def feed(self, chunk: str) -> list[ChatEvent]:
        """Events for `chunk` (possibly none while a marker or a call is incomplete)."""
        self._buf += chunk
        out, self._pending = self._pending, []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ChatEvent]:
        """Flush at the end of the turn: an unterminated call is still tried, leftovers become text."""
        out, self._pending = self._pending, []
        buf, self._buf = self._buf, ""
        if self._state == _TOOL:
            self._feed_call(buf, out)
            self._end_call(out, terminated=False)
        elif self._state == _THINK:
            self._put_reasoning(buf, out)
        else:
            self._text.put(buf, out)
        self._state = _TEXT
        return out

    def _markers(self) -> list[str]:
        if self._state == _TEXT:
            ms = [self._codec.think[0]] if self._codec.think else []
        else:
            ms = [self._codec.think[1]] if self._codec.think else []
        if self._tools:
            ms.append(self._codec.tool_start)  # a call inside unclosed thinking also ends the thinking
        return ms

    def _step(self, out: list[ChatEvent]) -> bool:
        if self._state == _TOOL:
            end_marker = self._codec.tool_end
            end = self._buf.find(end_marker)
            if end < 0:
                keep = _partial_suffix(self._buf, [end_marker])
                safe, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                self._feed_call(safe, out)
                return False
            body, self._buf = self._buf[:end], self._buf[end + len(end_marker) :]
            self._feed_call(body, out)
            self._state = _TEXT
            self._end_call(out, terminated=True)
            return True
        markers = self._markers()
        hit = _earliest(self._buf, markers)
        if hit is None:
            keep = _partial_suffix(self._buf, markers)
            head, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            if self._state == _THINK:
                self._put_reasoning(head, out)
            else:
                self._text.put(head, out)
            return False
        idx, marker = hit
        head, self._buf = self._buf[:idx], self._buf[idx + len(marker) :]
        if self._state == _THINK:
            self._put_reasoning(head, out)
            self._reason.close()
        else:
            self._text.put(head, out)
        self._text.close()
        if marker == self._codec.tool_start and self._tools:
            self._enter_call()
        elif self._state == _TEXT:
            self._state = _THINK
        else:
            self._state = _TEXT
        return True

    def _put_reasoning(self, text: str, out: list[ChatEvent]) -> None:
        n = len(out)
        self._reason.put(text, out)
        self.reasoning_text.extend(e.text for e in out[n:] if isinstance(e, ReasoningDelta))

    def _enter_call(self) -> None:
        self._state = _TOOL
        self._raw = ""
        self._reader = self._codec.call_reader(self._validator, self.calls, self._ids)

    def _feed_call(self, text: str, out: list[ChatEvent]) -> None:
        if not text:
            return
        reader = self._reader
        if reader is not None and not reader.fallback:
            out.extend(reader.feed(text))
            if reader.released:
                return  # the reader keeps what a released call still needs
        self._raw += text

    def _end_call(self, out: list[ChatEvent], *, terminated: bool) -> None:
        reader, self._reader = self._reader, None
        body, self._raw = self._raw, ""
        if reader is None or not reader.released:
            self._complete(body, out, terminated=terminated)
            return
        events, rest, whole = reader.finish()
        out.extend(events)
        self.calls += 1
        self.cut = self.cut or not whole
        if rest:  # the part of a released call that failed: nothing the model wrote is dropped
            self._text.put(rest + (self._codec.tool_end if terminated else ""), out)

    def _complete(self, body: str, out: list[ChatEvent], *, terminated: bool) -> None:
        calls = None
        try:
            calls = self._codec.parse_calls(body, self._validator)
        except (ValueError, SyntaxError, TypeError, KeyError, IndexError, RecursionError):
            calls = None
        if calls and all(self._validator.valid(name, args) for name, args in calls):
            for name, args in calls:
                call_id = self._ids()
                arguments = json.dumps(args, ensure_ascii=False)
                out.append(ToolCallStart(index=self.calls, id=call_id, name=name))
                out.append(ToolCallArgsDelta(index=self.calls, delta=arguments))
                out.append(ToolCallEnd(index=self.calls, id=call_id, name=name, arguments=arguments))
                self.calls += 1
            return
        raw = self._codec.tool_start + body + (self._codec.tool_end if terminated else "")
        self._text.reopen()
        self._text.put(raw, out)


def _earliest(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for m in markers:
        i = text.find(m)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, m)
    return best


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that could still grow into a marker."""
    keep = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), keep, -1):
            if text.endswith(m[:n]):
                keep = n
                break
    return keep
