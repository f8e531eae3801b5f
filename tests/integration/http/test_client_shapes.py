"""Our own requests in the shapes Claude Code, Codex and Pi send (no client text copied), always run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.http.conftest import LiveServer, make_server
from tests.integration.http.replay import agent, replay

SCHEMA_2020 = "https://json-schema.org/draft/2020-12/schema"
BASH = {
    "name": "Bash",
    "description": "Runs a command.",
    "input_schema": {
        "$schema": SCHEMA_2020,
        "type": "object",
        "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
        "required": ["command"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    for live in make_server(context_window=200_000):
        live.script(agent)
        yield live


def claude_like(second_turn: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<reminder>be careful</reminder>"},
                {"type": "text", "text": "run echo hi"},
            ],
        },
        {
            "role": "system",
            "content": [{"type": "text", "text": "Environment: a test box.", "cache_control": {"type": "ephemeral"}}],
        },
    ]
    if second_turn:
        messages[1] = {"role": "system", "content": "Environment: a test box."}
        messages += [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_abc", "name": "Bash", "input": {"command": "echo hi"}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "tool_use_id": "toolu_abc",
                        "type": "tool_result",
                        "content": "hi",
                        "is_error": False,
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ]
    return {
        "model": "local-model",
        "messages": messages,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=0.0.0; cch=abcde;"},
            {"type": "text", "text": "You are a test agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [
            BASH,
            {
                "name": "Placeholder",
                "description": "never call",
                "input_schema": {"type": "object"},
                "defer_loading": True,
            },
            {"type": "web_search_20250305", "name": "web_search"},
        ],
        "metadata": {"user_id": '{"device_id":"d"}'},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


def codex_like(second_turn: bool) -> dict[str, Any]:
    items: list[dict[str, Any]] = [
        {
            "type": "message",
            "id": "msg_1",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are a coding agent."}],
        },
        {
            "type": "message",
            "id": "msg_2",
            "role": "developer",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {
            "type": "message",
            "id": "msg_3",
            "role": "user",
            "content": [{"type": "input_text", "text": "<env>cwd=/tmp</env>"}],
        },
        {"type": "message", "id": "msg_4", "role": "user", "content": [{"type": "input_text", "text": "run echo hi"}]},
    ]
    if second_turn:
        items += [
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "thinking"}],
                "encrypted_content": "opaque",
            },
            {
                "type": "function_call",
                "status": "completed",
                "id": "fc_1",
                "name": "exec_command",
                "arguments": '{"cmd": "echo hi"}',
                "call_id": "call_1",
            },
            {
                "type": "function_call_output",
                "id": "fco_1",
                "call_id": "call_1",
                "output": "Exit code: 0\nOutput:\nhi\n",
            },
            {
                "type": "custom_tool_call",
                "id": "ctc_1",
                "status": "completed",
                "call_id": "call_2",
                "name": "apply_patch",
                "input": "*** Begin Patch\n*** End Patch\n",
            },
            {"type": "custom_tool_call_output", "id": "ctco_1", "call_id": "call_2", "output": "Done."},
        ]
    exec_params = {
        "type": "object",
        "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
        "required": ["cmd"],
        "additionalProperties": False,
    }
    return {
        "model": "local-model",
        "stream": True,
        "input": items,
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "description": "Run a command",
                "strict": False,
                "parameters": exec_params,
            },
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "Edit files",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
            },
            {
                "type": "namespace",
                "name": "agents",
                "description": "sub-agents",
                "tools": [
                    {
                        "type": "function",
                        "name": "spawn_agent",
                        "description": "spawn",
                        "strict": False,
                        "parameters": {"type": "object", "properties": {}},
                    }
                ],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"turn_id": "t1"},
    }


def pi_chat_like(second_turn: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are pi-like."},
        {"role": "user", "content": [{"type": "text", "text": "run echo hi"}]},
    ]
    if second_turn:
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command":"echo hi"}'},
                    }
                ],
            },
            {"role": "tool", "content": "hi\n", "tool_call_id": "call_9"},
        ]
    params = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    return {
        "model": "local-model",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "store": False,
        "max_completion_tokens": 4096,
        "tools": [
            {
                "type": "function",
                "function": {"name": "bash", "description": "Run bash", "parameters": params, "strict": False},
            }
        ],
    }


def pi_responses_like(second_turn: bool) -> dict[str, Any]:
    items: list[dict[str, Any]] = [
        {"role": "system", "content": "You are pi-like."},
        {"role": "user", "content": [{"type": "input_text", "text": "run echo hi"}]},
    ]
    if second_turn:
        items += [
            {
                "type": "function_call",
                "id": "fc_x",
                "call_id": "call_x",
                "name": "bash",
                "arguments": '{"command":"echo hi"}',
            },
            {"type": "function_call_output", "call_id": "call_x", "output": "hi\n"},
        ]
    params = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    return {
        "model": "local-model",
        "input": items,
        "stream": True,
        "prompt_cache_key": "s",
        "store": False,
        "max_output_tokens": 4096,
        "tools": [
            {"type": "function", "name": "bash", "description": "Run bash", "parameters": params, "strict": False}
        ],
    }


def pi_anthropic_like(second_turn: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "run echo hi", "cache_control": {"type": "ephemeral"}}]}
    ]
    if second_turn:
        messages += [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_p", "name": "bash", "input": {"command": "echo hi"}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_p", "content": "hi\n", "is_error": False}],
            },
        ]
    tool = {
        "name": "bash",
        "description": "Run bash",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        "eager_input_streaming": True,
    }
    return {
        "model": "local-model",
        "messages": messages,
        "max_tokens": 4096,
        "stream": True,
        "system": [{"type": "text", "text": "You are pi-like.", "cache_control": {"type": "ephemeral"}}],
        "tools": [tool],
    }


CASES = [
    ("/v1/messages", claude_like),
    ("/v1/responses", codex_like),
    ("/v1/chat/completions", pi_chat_like),
    ("/v1/responses", pi_responses_like),
    ("/v1/messages", pi_anthropic_like),
]


@pytest.mark.parametrize(("path", "build"), CASES, ids=[c[1].__name__ for c in CASES])
def test_first_turn_calls_the_tool_and_second_turn_answers(server: LiveServer, path: str, build: Any) -> None:
    assert replay(server.base_url, path, build(False)) in ("tool_use", "tool_calls")
    assert replay(server.base_url, path, build(True)) in ("end_turn", "stop", "completed")


def test_claude_specifics_are_translated(server: LiveServer) -> None:
    replay(server.base_url, "/v1/messages", claude_like(True))
    prompt = server.loader.target.prompts[-1]
    assert "x-anthropic-billing-header" not in prompt  # per-request block dropped
    assert "Placeholder" not in prompt and "web_search" not in prompt  # deferred and server tools not offered
    assert "<system>\nEnvironment: a test box.\n</system>" in prompt  # mid-conversation system folded
    assert prompt.endswith("<think>\n")  # adaptive thinking = on


def test_codex_specifics_are_translated(server: LiveServer) -> None:
    replay(server.base_url, "/v1/responses", codex_like(True))
    prompt = server.loader.target.prompts[-1]
    assert "You are a coding agent." in prompt.split("<|im_end|>")[0]  # developer = system
    assert '"name": "spawn_agent"' in prompt and '"name": "apply_patch"' in prompt  # namespace unwrapped, custom kept
    assert "start: /.+/" in prompt  # the freeform grammar reaches the model


def test_freeform_and_namespaced_calls_come_back_as_codex_items(server: LiveServer) -> None:
    import json

    import httpx

    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    calls = [{"name": "apply_patch", "arguments": {"input": patch}}, {"name": "spawn_agent", "arguments": {}}]
    server.script(lambda prompt: "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls))
    try:
        body = {**codex_like(False), "stream": False}
        out = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30).json()["output"]
    finally:
        server.script(agent)
    assert out[0]["type"] == "custom_tool_call" and out[0]["input"] == patch and out[0]["call_id"].startswith("call_")
    assert out[1]["type"] == "function_call" and out[1]["namespace"] == "agents"
