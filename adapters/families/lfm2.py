"""LFM2 pythonic calls: `<|tool_call_start|>[name(arg="v", n=1)]<|tool_call_end|>`."""

from __future__ import annotations

import ast
from typing import Any

from mlx_dspark.adapters.families.base import FamilyCodec, ParsedCalls
from mlx_dspark.adapters.families.validation import ArgumentValidator
from mlx_dspark.domain.chat import ToolCall

_JSON_NAMES = {"true": True, "false": False, "null": None}


class Lfm2Codec(FamilyCodec):
    """A Python list of calls with keyword arguments; values are Python (or JSON) literals."""

    name = "lfm2"
    tool_start = "<|tool_call_start|>"
    tool_end = "<|tool_call_end|>"

    def call_opening(self, name: str | None) -> str:
        return f"[{name}(" if name is not None else "["

    def parse_calls(self, body: str, validator: ArgumentValidator) -> ParsedCalls:
        tree = ast.parse(body.strip(), mode="eval").body
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls: list[tuple[str, Any]] = []
        for node in nodes:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
            if len(args) != len(node.keywords):
                return None  # **kwargs
            calls.append((node.func.id, args))
        return calls or None

    def format_call(self, call: ToolCall) -> str:
        args = ", ".join(f"{k}={_py(v)}" for k, v in call.arguments.items())
        return f"{self.tool_start}[{call.name}({args})]{self.tool_end}"


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)


def _py(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    return repr(value)
