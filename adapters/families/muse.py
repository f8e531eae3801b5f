"""Muse (Spark, Glimmer) calls: `<atem:function_calls><atem:invoke name="fn"><atem:parameter name="p">v
</atem:parameter></atem:invoke></atem:function_calls>`, several invokes per block; values are JSON or text."""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_dspark.adapters.families.base import FamilyCodec, ParsedCalls
from mlx_dspark.adapters.families.validation import ArgumentValidator, coerce_scalar
from mlx_dspark.domain.chat import ToolCall

_INVOKE = re.compile(r'<atem:invoke\b[^>]*?\bname="([^"]+)"[^>]*>(.*?)</atem:invoke>', re.DOTALL)
_PARAM = re.compile(r'<atem:parameter\b[^>]*?\bname="([^"]+)"[^>]*>(.*?)</atem:parameter>', re.DOTALL)


class MuseCodec(FamilyCodec):
    """A value that parses as JSON is that value, else the text; the tool's schema then types the text."""

    name = "muse"
    tool_start = "<atem:function_calls>"
    tool_end = "</atem:function_calls>"

    def call_opening(self, name: str | None) -> str:
        return f'\n<atem:invoke name="{name}">\n' if name is not None else '\n<atem:invoke name="'

    def parse_calls(self, body: str, validator: ArgumentValidator) -> ParsedCalls:
        calls: list[tuple[str, Any]] = []
        for invoke in _INVOKE.finditer(body):
            name = invoke.group(1).strip()
            props: dict[str, Any] = {}
            if validator.knows(name):
                props = dict(validator.schema(name).get("properties") or {})
            args: dict[str, Any] = {}
            for p in _PARAM.finditer(invoke.group(2)):
                key, raw = p.group(1).strip(), p.group(2)
                args[key] = _value(raw, props.get(key))
            if _PARAM.sub("", invoke.group(2)).strip():
                return None
            calls.append((name, args))
        if _INVOKE.sub("", body).strip():
            return None  # text around the invokes: not a clean call block
        return calls or None

    def format_call(self, call: ToolCall) -> str:
        params = "".join(
            f'<atem:parameter name="{k}">{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}'
            "</atem:parameter>\n"
            for k, v in call.arguments.items()
        )
        return f'{self.tool_start}\n<atem:invoke name="{call.name}">\n{params}</atem:invoke>\n{self.tool_end}'


def _value(raw: str, schema: Any) -> Any:
    text = raw.strip()
    if schema and "string" in str(schema.get("type", "")):
        return coerce_scalar(raw, schema)  # a string parameter keeps its text, "42" included
    try:
        return json.loads(text)
    except ValueError:
        return coerce_scalar(text, schema)
