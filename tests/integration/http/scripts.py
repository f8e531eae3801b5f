"""Scripted replies for the HTTP tests: what the fake model 'says' given the rendered prompt."""

from __future__ import annotations

import json
import re

RESULT = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def text(prompt: str) -> str:
    return "Hello from the scripted model."


def _call(name: str, args: dict[str, object]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def tool(prompt: str) -> str:
    """Ask for a shell command; once a result is in the history, quote it."""
    results = RESULT.findall(prompt)
    if results:
        return f"Tool result received: {results[-1].strip()}"
    return "I will run it.\n" + _call("shell", {"command": "echo hi"})


def parallel(prompt: str) -> str:
    return _call("shell", {"command": "echo one"}) + "\n" + _call("shell", {"command": "echo two"})


def botched(prompt: str) -> str:
    return _call("shell", {"cmd": 3})  # fails the schema: comes back as text


def thinking(prompt: str) -> str:
    body = "Let me think about this.\n</think>\n\nThe answer is 4."
    return body if prompt.endswith("<think>\n") else "<think>\n" + body


def long(prompt: str) -> str:
    return "word " * 400


def stop_words(prompt: str) -> str:
    return "one two STOP three four"


SHELL_TOOL_OPENAI = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
SHELL_TOOL_ANTHROPIC = {
    "name": "shell",
    "description": "Run a shell command",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
SHELL_TOOL_RESPONSES = {"type": "function", **SHELL_TOOL_OPENAI["function"]}  # type: ignore[dict-item]
