"""Replaying client-shaped requests through the official SDK stream helpers, plus a scripted 'agent' model."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import openai

SHELLS = {"Bash": "command", "bash": "command", "shell": "command", "exec_command": "cmd"}
OFFERED = re.compile(r'"name": "([A-Za-z0-9_.\-]+)"')


def agent(prompt: str) -> str:
    """Call the offered shell tool on the first turn; answer in text once a tool result is in the prompt."""
    if "<tool_response>" in prompt:
        return "Tool result received."
    offered = set(OFFERED.findall(prompt))
    for name, key in SHELLS.items():
        if name in offered:
            call = {"name": name, "arguments": {key: "echo hi"}}
            return "Running it.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    return "Hi."


def replay(base_url: str, path: str, body: dict[str, Any], api_key: str = "x") -> str:
    """Send `body` through the matching SDK stream helper; returns the finish reason the client saw."""
    body = dict(body)
    body.pop("stream", None)
    if path.endswith("/messages"):
        client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)
        known = {k: body.pop(k) for k in ("model", "max_tokens", "messages")}
        with client.messages.stream(**known, extra_body=body) as stream:
            final = stream.get_final_message()
        for block in final.content:
            if block.type == "tool_use":
                assert isinstance(block.input, dict) and block.id
            if block.type == "thinking":
                assert block.signature
        assert final.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
        return str(final.stop_reason)
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)
    if path.endswith("/responses"):
        known = {k: body.pop(k) for k in ("model", "input")}
        with oai.responses.stream(**known, extra_body=body) as rstream:
            kinds = [e.type for e in rstream]
            response = rstream.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        for item in response.output:
            if item.type == "function_call":
                json.loads(item.arguments)
        assert response.usage is not None
        calls = [o for o in response.output if o.type in ("function_call", "custom_tool_call")]
        return "tool_calls" if calls else str(response.status)
    known = {k: body.pop(k) for k in ("model", "messages")}
    with oai.chat.completions.stream(**known, extra_body=body) as cstream:
        completion = cstream.get_final_completion()
    reason = completion.choices[0].finish_reason
    assert reason in ("stop", "length", "tool_calls")
    return str(reason)
