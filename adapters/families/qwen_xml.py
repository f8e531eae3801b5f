"""Qwen3-Coder / Qwen3.5-class XML calls: `<tool_call><function=name><parameter=k>v</parameter></function>`."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mlx_dspark.adapters.families.base import CallReader, FamilyCodec, ParsedCalls
from mlx_dspark.adapters.families.incremental import XmlCallReader, strip_one_newline
from mlx_dspark.adapters.families.validation import ArgumentValidator, coerce_scalar
from mlx_dspark.domain.chat import ToolCall

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class QwenXmlCodec(FamilyCodec):
    """Parameter values are text; each is converted with the type its JSON schema declares."""

    name = "qwen_xml"
    tool_start = "<tool_call>"
    tool_end = "</tool_call>"

    def call_opening(self, name: str | None) -> str:
        return "\n<function=" + (f"{name}>\n" if name is not None else "")

    def call_reader(self, validator: ArgumentValidator, index: int, make_id: Callable[[], str]) -> CallReader | None:
        return XmlCallReader(validator, index, make_id, coerce_scalar)

    def parse_calls(self, body: str, validator: ArgumentValidator) -> ParsedCalls:
        calls: list[tuple[str, Any]] = []
        rest = body
        for match in _FUNCTION.finditer(body):
            name = match.group(1).strip()
            props: dict[str, Any] = {}
            if validator.knows(name):
                props = dict(validator.schema(name).get("properties") or {})
            args: dict[str, Any] = {}
            for p in _PARAMETER.finditer(match.group(2)):
                key = p.group(1).strip()
                value = strip_one_newline(p.group(2))
                args[key] = coerce_scalar(value, props.get(key))
            calls.append((name, args))
            rest = rest.replace(match.group(0), "", 1)
        if rest.strip():
            return None  # text around the functions: not a clean call block
        return calls or None

    def format_call(self, call: ToolCall) -> str:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in call.arguments.items()
        )
        return f"{self.tool_start}\n<function={call.name}>\n{params}</function>\n{self.tool_end}"
