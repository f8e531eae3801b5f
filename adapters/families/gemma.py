"""Gemma 4 calls: `<|tool_call>call:name{key:<|"|>text<|"|>,n:1}<tool_call|>`, thinking in a `thought` channel."""

from __future__ import annotations

import json
from typing import Any

from mlx_dspark.adapters.families.base import FamilyCodec, ParsedCalls
from mlx_dspark.adapters.families.validation import ArgumentValidator
from mlx_dspark.domain.chat import ToolCall

QUOTE = '<|"|>'
THINK = ("<|channel>thought", "<channel|>")


class Gemma4Codec(FamilyCodec):
    """Gemma 4's own call syntax: bare keys, `<|"|>`-quoted strings, JSON-like numbers and nesting."""

    name = "gemma4"
    tool_start = "<|tool_call>"
    tool_end = "<tool_call|>"

    def call_opening(self, name: str | None) -> str:
        return f"call:{name or ''}"

    def parse_calls(self, body: str, validator: ArgumentValidator) -> ParsedCalls:
        text = body.strip()
        if not text.startswith("call:"):
            return None
        brace = text.find("{")
        if brace < 0:
            return None
        name = text[5:brace].strip()
        reader = _Reader(text, brace)
        args = reader.value()
        if reader.rest().strip():
            return None
        return [(name, args)]

    def format_call(self, call: ToolCall) -> str:
        return f"{self.tool_start}call:{call.name}{_write(dict(call.arguments))}{self.tool_end}"


def _write(value: Any) -> str:
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_write(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_write(v) for v in value) + "]"
    return json.dumps(value)


class _Reader:
    """A small recursive-descent reader of Gemma 4's argument syntax."""

    def __init__(self, text: str, pos: int) -> None:
        self.text = text
        self.pos = pos

    def rest(self) -> str:
        return self.text[self.pos :]

    def _skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \n\t\r":
            self.pos += 1

    def _peek(self, s: str) -> bool:
        self._skip()
        return self.text.startswith(s, self.pos)

    def _expect(self, s: str) -> None:
        if not self._peek(s):
            raise ValueError(f"expected {s!r} at {self.pos}")
        self.pos += len(s)

    def value(self) -> Any:
        if self._peek(QUOTE):
            self.pos += len(QUOTE)
            end = self.text.find(QUOTE, self.pos)
            if end < 0:
                raise ValueError("unterminated string")
            out = self.text[self.pos : end]
            self.pos = end + len(QUOTE)
            return out
        if self._peek("{"):
            self.pos += 1
            obj: dict[str, Any] = {}
            while not self._peek("}"):
                key = self._key()
                self._expect(":")
                obj[key] = self.value()
                if not self._peek("}"):
                    self._expect(",")
            self.pos += 1
            return obj
        if self._peek("["):
            self.pos += 1
            arr: list[Any] = []
            while not self._peek("]"):
                arr.append(self.value())
                if not self._peek("]"):
                    self._expect(",")
            self.pos += 1
            return arr
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ",}] \n":
            self.pos += 1
        return json.loads(self.text[start : self.pos])  # numbers, true/false/null

    def _key(self) -> str:
        self._skip()
        if self._peek(QUOTE):
            value = self.value()
            return str(value)
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ":":
            self.pos += 1
        key = self.text[start : self.pos].strip().strip('"')
        if not key:
            raise ValueError("empty key")
        return key
