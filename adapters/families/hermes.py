"""Hermes-style calls: `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Qwen2.5/Qwen3, ChatML models)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mlx_dspark.adapters.families.base import CallReader, FamilyCodec, ParsedCalls
from mlx_dspark.adapters.families.incremental import JsonCallReader
from mlx_dspark.adapters.families.validation import ArgumentValidator
from mlx_dspark.domain.chat import ToolCall


class HermesCodec(FamilyCodec):
    """JSON objects between `<tool_call>` markers; also the fallback for templates without tool support."""

    name = "hermes"
    tool_start = "<tool_call>"
    tool_end = "</tool_call>"

    def call_opening(self, name: str | None) -> str:
        if name is None:
            return '\n{"name": "'
        return "\n" + json.dumps({"name": name, "arguments": {}}, ensure_ascii=False)[:-3]

    def call_reader(self, validator: ArgumentValidator, index: int, make_id: Callable[[], str]) -> CallReader | None:
        return JsonCallReader(validator, index, make_id)

    def parse_calls(self, body: str, validator: ArgumentValidator) -> ParsedCalls:
        data = json.loads(body.strip(), strict=False)  # raw newlines inside strings are common
        items = data if isinstance(data, list) else [data]
        calls: list[tuple[str, Any]] = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):
                # some models write the arguments as a JSON string
                args = json.loads(args) if args.strip() else {}
            calls.append((item["name"], args))
        return calls or None

    def format_call(self, call: ToolCall) -> str:
        payload = json.dumps({"name": call.name, "arguments": dict(call.arguments)}, ensure_ascii=False)
        return f"{self.tool_start}\n{payload}\n{self.tool_end}"
