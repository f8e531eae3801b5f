"""Incremental reading of one tool call (Hermes JSON, Qwen XML), so its arguments stream as they are written.

A call is *released* to the client (start event, then argument deltas) only once it is certain to be a call:
the name is an offered tool, every required argument has begun with a value its schema accepts, and every
finished argument has passed its own schema. Before that it is held back, and a call that never gets there
comes back as plain text. After release, argument text is re-encoded as canonical JSON, so the deltas always
concatenate to valid JSON; a member that fails after release (or output that stops mid-call) ends the call at
the last valid point, the rest of the block comes back as text, and the call is reported *cut* — the turn then
finishes as if cut by the token limit, so no client runs a call that the model did not finish.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from mlx_dspark.adapters.families.validation import ArgumentValidator
from mlx_dspark.domain.chat import ChatEvent, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

_WS = " \t\r\n"
_ARG_KEYS = ('"arguments"', '"parameters"')
# The only root keywords a member-by-member check can judge; a tool whose schema has others (anyOf, allOf,
# dependentRequired, …) has its calls parsed and checked whole at the end marker instead.
_SIMPLE_ROOT = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "$schema",
    "$defs",
    "definitions",
    "description",
    "title",
    "$id",
    "$comment",
    "default",
    "examples",
    "strict",
}
# A string value under only these keywords is valid however it ends, so it may stream before its end.
_PLAIN_STRING = {"type", "description", "title", "default", "examples", "$comment"}


class _Stop(Exception):
    """The text seen so far ends before the current token does."""


class _Bad(Exception):
    """The text cannot be the expected shape."""


class _CallReader:
    """What every incremental call reader shares: release, canonical JSON output, the end of a call.

    Subclasses scan one family's call syntax in `_step`, calling `_begin`, `_member`, `_open_string`,
    `_string_text`, `_close_string` and `_close_args` as they go.

    Args:
        validator: the offered tools' schemas.
        index: the call's index in this turn.
        make_id: a fresh call id (taken at release).
    """

    _WHOLE: tuple[str, ...] = ("tail",)  # phases in which the arguments are complete

    def __init__(self, validator: ArgumentValidator, index: int, make_id: Callable[[], str]) -> None:
        self._validator = validator
        self._index = index
        self._make_id = make_id
        self._text = ""
        self._pos = 0
        self._phase = "head"  # scanner phases, then "tail" (whole) | "failed" | "fallback"
        self.name = ""
        self._id = ""
        self._schema: Mapping[str, Any] = {}
        self._required: set[str] = set()
        self._members: dict[str, Any] = {}
        self._emitted: list[str] = []  # canonical argument text, released or not
        self._sent = 0  # how many of _emitted went out
        self.released = False
        self._key = ""
        self._member_start = 0  # where the current member's text starts (for the text fallback)
        self._in_string = False  # streaming a string value right now
        self._string: list[str] = []
        self._args_closed = False
        self._fail_at: int | None = None

    @property
    def fallback(self) -> bool:
        """The call cannot be streamed (and was not released): parse the whole block at the end instead."""
        return self._phase == "fallback"

    # ---- driving --------------------------------------------------------------------------------------

    def feed(self, chunk: str) -> list[ChatEvent]:
        self._text += chunk
        while self._phase not in ("fallback", "failed"):
            saved = self._pos
            try:
                if not self._step():
                    break
            except _Stop:
                self._pos = saved  # each step is all or nothing, so it can be retried with more text
                break
            except _Bad:
                self._fail()
        return self._flush()

    def _step(self) -> bool:
        """Advance one token; False: wait for more text; raises _Stop (retry later) or _Bad (not this shape)."""
        raise NotImplementedError

    def finish(self) -> tuple[list[ChatEvent], str, bool]:
        """After release only: the call's last events, the text of the block that must come back as text, and
        whether the call is whole (False: it was cut short or failed after release)."""
        whole = self._phase in self._WHOLE and self._fail_at is None
        if self._phase not in self._WHOLE:  # stopped or failed before the arguments were whole
            if self._fail_at is None:
                self._fail_at = len(self._text) if self._in_string else self._member_start
            if self._in_string:
                self._emit('"')
                self._in_string = False
            if not self._args_closed:
                self._emit("}")
        rest = self._text[self._fail_at :] if self._fail_at is not None else ""
        out = self._flush()
        out.append(ToolCallEnd(index=self._index, id=self._id, name=self.name, arguments="".join(self._emitted)))
        return out, rest if rest.strip() else "", whole

    def _fail(self) -> None:
        if not self.released:
            self._phase = "fallback"
            return
        at_token = self._in_string or self._phase == "tail"
        self._phase = "failed"
        self._fail_at = self._pos if at_token else self._member_start

    # ---- output -----------------------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        if text:
            self._emitted.append(text)

    def _flush(self) -> list[ChatEvent]:
        if not self.released:
            return []
        out: list[ChatEvent] = []
        if self._sent == 0 and not self._id:
            self._id = self._make_id()
            out.append(ToolCallStart(index=self._index, id=self._id, name=self.name))
        delta = "".join(self._emitted[self._sent :])
        self._sent = len(self._emitted)
        if delta:
            out.append(ToolCallArgsDelta(index=self._index, delta=delta))
        return out

    def _maybe_release(self) -> None:
        if not self.released and self._required <= (set(self._members) | ({self._key} if self._in_string else set())):
            self.released = True

    def _skip(self) -> None:
        while self._pos < len(self._text) and self._text[self._pos] in _WS:
            self._pos += 1

    def _literal(self, options: tuple[str, ...]) -> str:
        self._skip()
        rest = self._text[self._pos :]
        for lit in options:
            if rest.startswith(lit):
                self._pos += len(lit)
                return lit
        if any(lit.startswith(rest) for lit in options):
            raise _Stop
        raise _Bad

    def _prefix(self) -> str:
        return ", " if self._members else ""

    def _member(self, value: Any) -> None:
        if not self._member_ok(self._key, value):
            raise _Bad
        self._emit(self._prefix() + _dumps(self._key) + ": " + _dumps(value))
        self._members[self._key] = value
        self._member_start = self._pos
        self._maybe_release()

    def _begin(self, name: str) -> None:
        """The call's name is known: check that its arguments can be read member by member."""
        if not self._validator.knows(name):
            raise _Bad
        schema = self._validator.schema(name) or {}
        if not isinstance(schema, Mapping) or not set(schema) <= _SIMPLE_ROOT:
            raise _Bad
        if schema.get("type", "object") != "object" or not isinstance(schema.get("properties", {}), Mapping):
            raise _Bad
        self.name, self._schema = name, schema
        self._required = {r for r in schema.get("required", []) if isinstance(r, str)}
        self._emit("{")
        self._member_start = self._pos
        self._maybe_release()

    def _repeated(self, key: str) -> None:
        if key in self._members:
            raise _Bad  # a repeated key: JSON readers would silently keep only one
        self._key = key

    def _open_string(self) -> None:
        self._emit(self._prefix() + _dumps(self._key) + ': "')
        self._in_string = True
        self._string = []
        self._maybe_release()

    def _string_text(self, piece: str) -> None:
        if piece:
            self._string.append(piece)
            self._emit(_dumps(piece)[1:-1])
        if self._pos > 4096:  # in a string nothing before the cursor is needed again (call _string_text last)
            self._text = self._text[self._pos :]
            self._pos = self._member_start = 0

    def _close_string(self) -> None:
        self._in_string = False
        self._emit('"')
        self._members[self._key] = "".join(self._string)
        self._member_start = self._pos

    def _close_args(self) -> None:
        if not self._validator.valid(self.name, self._members):
            raise _Bad
        self._args_closed = True
        self._emit("}")
        self._maybe_release()
        self._member_start = self._pos

    def _property(self, key: str) -> Any:
        props = self._schema.get("properties") or {}
        if key in props:
            return props[key]
        return self._schema.get("additionalProperties", True)

    def _member_ok(self, key: str, value: Any) -> bool:
        schema = self._property(key)
        if schema is False:
            return False
        return self._validator.valid_member(self.name, key, value)

    def _streams(self, key: str) -> bool:
        """Whether a string for `key` can go out before it ends (nothing about it is checked at its end)."""
        schema = self._property(key)
        if schema is True:
            return True
        return isinstance(schema, Mapping) and set(schema) <= _PLAIN_STRING and schema.get("type", "string") == "string"


class JsonCallReader(_CallReader):
    """Hermes-style calls: `{"name": NAME, "arguments": {…}}` (or `"parameters"`), name first."""

    _WHOLE = ("tail", "outer")  # a call object whose closing brace never came is still whole

    # ---- scanning ---------------------------------------------------------------------------------------

    def _string_token(self) -> str:
        """A whole JSON string at the cursor."""
        self._skip()
        if self._pos >= len(self._text):
            raise _Stop
        if self._text[self._pos] != '"':
            raise _Bad
        end = _string_end(self._text, self._pos + 1)
        if end is None:
            raise _Stop
        try:
            value = json.loads(self._text[self._pos : end + 1], strict=False)
        except ValueError as exc:
            raise _Bad from exc
        self._pos = end + 1
        return str(value)

    def _value_token(self) -> Any:
        """A whole non-string JSON value at the cursor (object, array, number, literal)."""
        self._skip()
        start = self._pos
        if start >= len(self._text):
            raise _Stop
        end = _value_end(self._text, start)
        if end is None:
            raise _Stop
        try:
            value = json.loads(self._text[start:end], strict=False)
        except (ValueError, RecursionError) as exc:
            raise _Bad from exc
        self._pos = end
        return value

    def _step(self) -> bool:
        phase = self._phase
        if phase == "head":
            self._literal(("{",))
            self._literal(('"name"',))
            self._literal((":",))
            name = self._string_token()
            self._literal((",",))
            self._literal(_ARG_KEYS)
            self._literal((":",))
            self._literal(("{",))
            self._begin(name)
            self._phase = "key"
            return True
        if phase == "key":
            self._skip()
            if not self._members:
                self._member_start = self._pos
            if self._text[self._pos : self._pos + 1] == "}" and not self._members:
                self._pos += 1
                self._close_args()
                self._phase = "outer"
                return True
            self._repeated(self._string_token())
            self._phase = "colon"
            return True
        if phase == "colon":
            self._literal((":",))
            self._phase = "value"
            return True
        if phase == "value":
            return self._value()
        if phase == "next":
            sep = self._literal((",", "}"))
            if sep == "}":
                self._close_args()
                self._phase = "outer"
            else:
                self._phase = "key"
            return True
        if phase == "outer":
            self._literal(("}",))
            self._phase = "tail"
            return True
        self._skip()  # tail: only whitespace may follow the call object
        if self._pos < len(self._text):
            raise _Bad
        return False

    def _value(self) -> bool:
        if not self._in_string:
            self._skip()
            if self._pos >= len(self._text):
                raise _Stop
            if self._text[self._pos] != '"':
                self._member(self._value_token())
                self._phase = "next"
                return True
            if not self._streams(self._key):
                self._member(self._string_token())
                self._phase = "next"
                return True
            self._pos += 1
            self._open_string()
        # inside a streamed string: decode what is complete and send it re-encoded
        piece, end, closed = _string_piece(self._text, self._pos)
        self._pos = end
        self._string_text(piece)
        if not closed:
            return False
        self._close_string()
        self._phase = "next"
        return True


class XmlCallReader(_CallReader):
    """Qwen3-Coder / Qwen3.5-class calls: `<function=NAME>` then `<parameter=KEY>\nvalue\n</parameter>`s.

    Values are text; a string-typed one streams as written, the others are converted with their schema
    type when their closing tag arrives (as the whole-block parser does).
    """

    _END_VALUE = "</parameter>"

    def __init__(
        self,
        validator: ArgumentValidator,
        index: int,
        make_id: Callable[[], str],
        coerce: Callable[[str, Any], Any],
    ) -> None:
        super().__init__(validator, index, make_id)
        self._coerce = coerce

    def _tag_name(self) -> str:
        end = self._text.find(">", self._pos)
        if end < 0:
            if "\n" in self._text[self._pos :]:
                raise _Bad
            raise _Stop
        name = self._text[self._pos : end].strip()
        if not name or "\n" in name:
            raise _Bad
        self._pos = end + 1
        return name

    def _step(self) -> bool:
        if self._phase == "head":
            self._literal(("<function=",))
            self._begin(self._tag_name())
            self._phase = "param"
            return True
        if self._phase == "param":
            tag = self._literal(("<parameter=", "</function>"))
            if tag == "</function>":
                self._close_args()
                self._phase = "tail"
                return True
            self._repeated(self._tag_name())
            self._phase = "value"
            return True
        if self._phase == "value":
            return self._value()
        self._skip()  # tail: only whitespace may follow the function
        if self._pos < len(self._text):
            raise _Bad
        return False

    def _value(self) -> bool:
        schema = self._property(self._key)
        if not self._in_string:
            if not (self._streams(self._key) and _is_text(schema)):
                end = self._text.find(self._END_VALUE, self._pos)
                if end < 0:
                    raise _Stop
                raw = strip_one_newline(self._text[self._pos : end])
                self._pos = end + len(self._END_VALUE)
                self._member(self._coerce(raw, schema if isinstance(schema, Mapping) else None))
                self._phase = "param"
                return True
            if self._pos >= len(self._text):
                raise _Stop
            if self._text[self._pos] == "\n":  # the line break after the tag is layout, not value
                self._pos += 1
            self._open_string()
        end = self._text.find(self._END_VALUE, self._pos)
        if end >= 0:
            piece = self._text[self._pos : end]
            self._pos = end + len(self._END_VALUE)
            self._string_text(piece[:-1] if piece.endswith("\n") else piece)
            self._close_string()
            self._phase = "param"
            return True
        rest = self._text[self._pos :]
        keep = next(
            (n for n in range(min(len(rest), len(self._END_VALUE) - 1), 0, -1) if rest.endswith(self._END_VALUE[:n])), 0
        )
        safe = rest[: len(rest) - keep]
        if safe.endswith("\n"):
            safe = safe[:-1]  # may be the layout line break before the closing tag
        self._pos += len(safe)
        self._string_text(safe)
        return False


def _is_text(schema: Any) -> bool:
    """A parameter whose value stays text (the XML reader then streams it)."""
    return schema is True or (isinstance(schema, Mapping) and schema.get("type", "string") == "string")


def strip_one_newline(value: str) -> str:
    """An XML parameter value without the one layout line break each side (Qwen writes them)."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _string_end(text: str, i: int) -> int | None:
    """Index of the closing quote of a string whose content starts at i (None: not in the text yet)."""
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i
        i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the non-string JSON value starting at i (None: it may still grow)."""
    first = text[i]
    if first in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i + 1)
                if end is None:
                    return None
                i = end + 1
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    if j == len(text):
        return None  # a number or literal may go on
    if j == i:
        raise _Bad
    return j


def _string_piece(text: str, i: int) -> tuple[str, int, bool]:
    """Decode string content from i up to the closing quote or the last complete escape.

    Returns:
        (decoded text, new position, whether the closing quote was reached; the position is then past it).
    """
    out: list[str] = []
    while i < len(text):
        c = text[i]
        if c == '"':
            return "".join(out), i + 1, True
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(text):
            break
        esc = text[i + 1]
        if esc != "u":
            try:
                out.append(json.loads(f'"\\{esc}"'))
            except ValueError as exc:
                raise _Bad from exc
            i += 2
            continue
        if i + 6 > len(text):
            break
        code = text[i + 2 : i + 6]
        try:
            value = int(code, 16)
        except ValueError as exc:
            raise _Bad from exc
        if 0xD800 <= value < 0xDC00:  # a surrogate pair needs its second half
            if i + 12 > len(text):
                break
            try:
                out.append(json.loads('"' + text[i : i + 12] + '"'))
            except ValueError as exc:
                raise _Bad from exc
            i += 12
            continue
        out.append(chr(value))
        i += 6
    return "".join(out), i, False
