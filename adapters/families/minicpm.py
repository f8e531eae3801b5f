"""MiniCPM5 calls: `<function name="fn"><param name="p">v</param></function>`, no wrapper; values holding `<`,
`&` or a line break come in a CDATA block; parallel calls are consecutive `<function>` blocks."""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_dspark.adapters.families.base import FamilyCodec, ParsedCalls
from mlx_dspark.adapters.families.validation import ArgumentValidator, coerce_scalar
from mlx_dspark.domain.chat import ToolCall

# The body starts after `<function name=`: the quoted name, `>`, then the parameters.
_HEAD = re.compile(r"""\s*(?:"([^"]*)"|'([^']*)'|([^\s"'<>]+))\s*>(.*)\Z""", re.DOTALL)
_PARAM = re.compile(r"""<param\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'<>]+))\s*>(.*?)</param>""", re.DOTALL)
_CDATA = re.compile(r"\A\s*<!\[CDATA\[(.*?)\]\]>\s*\Z", re.DOTALL)


class MiniCpm5Codec(FamilyCodec):
    """Parameter values are text, converted with the type the tool's JSON schema declares."""

    name = "minicpm5"
    tool_start = "<function name="
    tool_end = "</function>"

    def call_opening(self, name: str | None) -> str:
        return f'"{name}">' if name is not None else '"'

    def parse_calls(self, body: str, validator: ArgumentValidator) -> ParsedCalls:
        head = _HEAD.match(body)
        if head is None:
            return None
        name = next(g for g in head.group(1, 2, 3) if g is not None).strip()
        props: dict[str, Any] = {}
        if validator.knows(name):
            props = dict(validator.schema(name).get("properties") or {})
        args: dict[str, Any] = {}
        rest = head.group(4)
        for p in _PARAM.finditer(rest):
            key = next(g for g in p.group(1, 2, 3) if g is not None).strip()
            raw = p.group(4)
            cdata = _CDATA.match(raw)
            value = cdata.group(1) if cdata else raw.strip()
            args[key] = coerce_scalar(value, props.get(key))
        if _PARAM.sub("", rest).strip():
            return None  # text between the parameters: not a clean call
        return [(name, args)]

    def format_call(self, call: ToolCall) -> str:
        params = "".join(f'<param name="{k}">{_value(v)}</param>' for k, v in call.arguments.items())
        return f'{self.tool_start}"{call.name}">{params}{self.tool_end}'


def _value(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    if any(c in text for c in "<&\n") and "]]>" not in text:
        return f"<![CDATA[{text}]]>"
    return text
