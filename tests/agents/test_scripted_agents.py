"""Claude Code, Codex and Pi (Pi on each of its three APIs), run headless by `mlx-dspark claude|codex|pi`
against the real server over a scripted model of the default model's family.

The model asks, in Hermes syntax, for the agent's own file-writing tool; the agent really writes the file
in a temporary workspace, sends the result back, and prints the scripted final answer.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.agents.conftest import (
    Recorded,
    ScriptedServer,
    agents_bin,
    hermes_call,
    offered_tools,
    run_launcher,
)

FILENAME = "hello.txt"
CONTENT = "written by the scripted model\n"
FINAL = "Done: the file hello.txt holds the requested line."
RESULT_MARK = "<tool_response>"


@pytest.fixture(autouse=True, scope="module")
def _agents() -> None:
    agents_bin()


def file_writer(workspace: Path) -> Callable[[str], str]:
    """First turn: call the offered write tool; once a tool result is in the prompt: the final answer."""

    def respond(prompt: str) -> str:
        if RESULT_MARK in prompt:
            return FINAL
        tools = offered_tools(prompt)
        if "Write" in tools:  # Claude Code
            return "Writing it.\n" + hermes_call("Write", {"file_path": str(workspace / FILENAME), "content": CONTENT})
        if "write" in tools:  # Pi
            return "Writing it.\n" + hermes_call("write", {"path": FILENAME, "content": CONTENT})
        if "exec_command" in tools:  # Codex
            cmd = f"printf %s {shlex.quote(CONTENT)} > {FILENAME}"
            return "Writing it.\n" + hermes_call("exec_command", {"cmd": cmd})
        return FINAL  # a request without tools (a title or summary): plain text

    return respond


def _dialect_turns(req: Recorded) -> tuple[list[tuple[str, dict[str, Any], str]], dict[str, str]]:
    """(calls replayed by the client as (id, arguments, name), tool results by call id) in one request."""
    calls: list[tuple[str, dict[str, Any], str]] = []
    results: dict[str, str] = {}
    body = req.body
    if req.path.endswith("/messages"):
        for m in body["messages"]:
            for block in m["content"] if isinstance(m["content"], list) else []:
                if block.get("type") == "tool_use":
                    calls.append((block["id"], block["input"], block["name"]))
                elif block.get("type") == "tool_result":
                    content = block["content"]
                    if isinstance(content, list):
                        content = "".join(b.get("text", "") for b in content)
                    results[block["tool_use_id"]] = content
    elif req.path.endswith("/chat/completions"):
        for m in body["messages"]:
            for c in m.get("tool_calls") or []:
                calls.append((c["id"], json.loads(c["function"]["arguments"]), c["function"]["name"]))
            if m["role"] == "tool":
                results[m["tool_call_id"]] = m["content"] if isinstance(m["content"], str) else json.dumps(m["content"])
    else:
        for item in body["input"] if isinstance(body["input"], list) else []:
            if item.get("type") == "function_call":
                calls.append((item["call_id"], json.loads(item["arguments"]), item["name"]))
            elif item.get("type") == "function_call_output":
                out = item["output"]
                results[item["call_id"]] = out if isinstance(out, str) else json.dumps(out)
    return calls, results


def assert_round_trip(server: ScriptedServer, path_suffix: str, tool: str, expected_args: dict[str, Any]) -> str:
    """The first request offered tools; a later one replays our call and carries its result. Returns it."""
    turns = [r for r in server.recorder.requests if r.path.endswith(path_suffix) and r.body and r.body.get("tools")]
    assert len(turns) >= 2, f"expected a tool-result request, got {[r.path for r in server.recorder.requests]}"
    first_calls, first_results = _dialect_turns(turns[0])
    assert not first_calls and not first_results
    calls, results = _dialect_turns(turns[1])
    assert [(name, args) for _, args, name in calls] == [(tool, expected_args)]
    call_id = calls[0][0]
    assert call_id in results, f"no tool result for {call_id}: {results}"
    return results[call_id]


def test_claude_code_writes_the_file_and_answers(scripted_server: ScriptedServer, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    scripted_server.script(file_writer(workspace))
    run = run_launcher(
        "claude",
        ["--port", str(scripted_server.port)],
        ["-p", "Write hello.txt.", "--output-format", "json", "--allowedTools", "Write", "--max-turns", "4"],
        workspace=workspace,
        home=tmp_path / "home",
    )
    assert run.returncode == 0, run.stderr + run.stdout
    out = json.loads(run.stdout)
    assert out["result"] == FINAL and not out["is_error"]
    assert (workspace / FILENAME).read_text() == CONTENT
    result = assert_round_trip(
        scripted_server, "/messages", "Write", {"file_path": str(workspace / FILENAME), "content": CONTENT}
    )
    assert FILENAME in result


def test_codex_runs_the_command_and_answers(scripted_server: ScriptedServer, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    scripted_server.script(file_writer(workspace))
    last = tmp_path / "last-message.txt"
    run = run_launcher(
        "codex",
        ["--port", str(scripted_server.port)],
        ["exec", "--skip-git-repo-check", "--sandbox", "workspace-write", "-o", str(last), "Write hello.txt."],
        workspace=workspace,
        home=tmp_path / "home",
    )
    assert run.returncode == 0, run.stderr + run.stdout
    assert last.read_text().strip() == FINAL and FINAL in run.stdout
    assert (workspace / FILENAME).read_text() == CONTENT
    cmd = f"printf %s {shlex.quote(CONTENT)} > {FILENAME}"
    result = assert_round_trip(scripted_server, "/responses", "exec_command", {"cmd": cmd})
    assert "exited with code 0" in result


PI_APIS = {
    "openai-completions": "/chat/completions",
    "openai-responses": "/responses",
    "anthropic-messages": "/messages",
}


@pytest.mark.parametrize("api", list(PI_APIS))
def test_pi_writes_the_file_and_answers(api: str, scripted_server: ScriptedServer, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    scripted_server.script(file_writer(workspace))
    run = run_launcher(
        "pi",
        ["--port", str(scripted_server.port), "--api", api],
        ["-p", "Write hello.txt.", "--no-session"],
        workspace=workspace,
        home=tmp_path / "home",
    )
    assert run.returncode == 0, run.stderr + run.stdout
    assert run.stdout.strip() == FINAL
    assert (workspace / FILENAME).read_text() == CONTENT
    result = assert_round_trip(scripted_server, PI_APIS[api], "write", {"path": FILENAME, "content": CONTENT})
    assert FILENAME in result
