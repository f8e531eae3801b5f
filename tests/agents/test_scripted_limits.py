"""The agents at the edges of the window and the token budget, on a scripted model (fast, every run).

- A prompt over the window gets exactly the overflow error each agent recognises: Claude Code reports
  "Prompt is too long", Codex its context-window error, Pi's own overflow check (run from its installed
  package) returns true for the error it got, on each of its three APIs. Never a 5xx.
- A reply cut by the token limit is still a stream the agent accepts: Codex and Pi end with the text so far,
  Claude Code reads `max_tokens`, asks to continue, and then reports its own output-limit message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_dspark.application.launchers import Target, claude_plan
from mlx_dspark.entrypoints.cli.launch import materialize
from tests.agents.conftest import (
    CLAUDE_OVERFLOW,
    ScriptedServer,
    agents_bin,
    isolated_env,
    pi_final_message,
    pi_says_overflow,
    run_isolated,
    run_launcher,
    serve_scripted,
)

SMALL_WINDOW = 2000  # characters = tokens here; every agent's first prompt is longer
PI_APIS = ("openai-completions", "openai-responses", "anthropic-messages")
LONG_REPLY = "one two three four five six seven eight nine ten " * 20
CUT_AT = 12


@pytest.fixture(autouse=True, scope="module")
def _agents() -> None:
    agents_bin()


@pytest.fixture(scope="module")
def small_server() -> Iterator[ScriptedServer]:
    yield from serve_scripted(SMALL_WINDOW)


@pytest.fixture(scope="module")
def capped_server() -> Iterator[ScriptedServer]:
    # Codex sends no max_output_tokens; the server's cap ends every reply by the token limit.
    yield from serve_scripted(400_000, max_tokens_cap=CUT_AT)


def _no_5xx(server: ScriptedServer) -> list[tuple[str, int, bytes]]:
    seen = [(r.path, r.status, r.error) for r in server.recorder.requests]
    assert all(status < 500 for _, status, _ in seen), seen
    return seen


def test_claude_code_reports_prompt_too_long(small_server: ScriptedServer, tmp_path: Path) -> None:
    small_server.script(lambda prompt: "unreachable")
    args = ["-p", "Say hi.", "--output-format", "json", "--max-turns", "1"]
    # Through the launcher Claude Code knows the real window and stops before sending.
    run = run_launcher("claude", ["--port", str(small_server.port)], args, workspace=tmp_path, home=tmp_path / "h1")
    out = json.loads(run.stdout)
    assert out["is_error"] and out["result"] == "Prompt is too long", out
    # Configured by hand it assumes a huge window: the server's 400 must be the message it parses.
    target = Target(base_url=small_server.base_url, model="local-model", context_window=1_000_000)
    plan = claude_plan(target, args, isolated_env(tmp_path / "h2"))
    argv, env = materialize(plan, str(tmp_path))
    run = run_isolated(argv, workspace=tmp_path, home=tmp_path / "h2", env=env)
    out = json.loads(run.stdout)
    seen = _no_5xx(small_server)
    messages = [(status, error.decode()) for path, status, error in seen if path.endswith("/messages")]
    assert messages and all(status == 400 and CLAUDE_OVERFLOW.search(error) for status, error in messages), seen
    sent = CLAUDE_OVERFLOW.search(messages[-1][1])
    assert sent is not None
    # It parsed our numbers: its own report quotes the prompt's token count.
    assert out["is_error"] and out["result"].startswith("Prompt is too long"), out
    assert f"~{sent.group(1)} tokens" in out["result"], out["result"]


def test_codex_reports_the_context_window(small_server: ScriptedServer, tmp_path: Path) -> None:
    small_server.script(lambda prompt: "unreachable")
    run = run_launcher(
        "codex",
        ["--port", str(small_server.port)],
        ["exec", "--skip-git-repo-check", "Say hi."],
        workspace=tmp_path,
        home=tmp_path / "home",
    )
    assert run.returncode != 0
    assert "ran out of room in the model's context window" in run.stderr, run.stderr
    seen = _no_5xx(small_server)
    assert seen and all(
        status == 400 and json.loads(error)["error"]["code"] == "context_length_exceeded" for _, status, error in seen
    )


@pytest.mark.parametrize("api", PI_APIS)
def test_pi_recognises_the_overflow(api: str, small_server: ScriptedServer, tmp_path: Path) -> None:
    small_server.script(lambda prompt: "unreachable")
    run = run_launcher(
        "pi",
        ["--port", str(small_server.port), "--api", api],
        ["-p", "Say hi.", "--no-session", "--mode", "json"],
        workspace=tmp_path,
        home=tmp_path / "home",
    )
    message = pi_final_message(run.stdout)
    assert message["stopReason"] == "error", message
    assert pi_says_overflow(message, SMALL_WINDOW), message["errorMessage"]
    seen = _no_5xx(small_server)
    assert seen and all(status == 400 for _, status, _ in seen)


def test_claude_code_accepts_a_reply_cut_by_the_limit(capped_server: ScriptedServer, tmp_path: Path) -> None:
    capped_server.script(lambda prompt: LONG_REPLY)
    run = run_launcher(
        "claude",
        ["--port", str(capped_server.port), "--max-output-tokens", str(CUT_AT)],
        ["-p", "Count.", "--output-format", "json", "--max-turns", "1"],
        workspace=tmp_path,
        home=tmp_path / "home",
    )
    out = json.loads(run.stdout)
    # It read stop_reason max_tokens from the stream (asking to continue, then giving up), not a broken stream.
    assert f"exceeded the {CUT_AT} output token maximum" in out["result"], out
    seen = _no_5xx(capped_server)
    assert seen and all(status == 200 for _, status, _ in seen)
    continued = [r.body for r in capped_server.recorder.requests[1:]]
    assert all(LONG_REPLY[:CUT_AT] in json.dumps(body["messages"]) for body in continued)


def test_codex_accepts_a_reply_cut_by_the_limit(capped_server: ScriptedServer, tmp_path: Path) -> None:
    capped_server.script(lambda prompt: LONG_REPLY)
    last = tmp_path / "last.txt"
    run = run_launcher(
        "codex",
        ["--port", str(capped_server.port)],
        ["exec", "--skip-git-repo-check", "-o", str(last), "Count."],
        workspace=tmp_path,
        home=tmp_path / "home",
    )
    assert run.returncode == 0, run.stderr
    assert last.read_text().strip() == LONG_REPLY[:CUT_AT].strip()
    assert all(status == 200 for _, status, _ in _no_5xx(capped_server))


@pytest.mark.parametrize("api", PI_APIS)
def test_pi_accepts_a_reply_cut_by_the_limit(api: str, capped_server: ScriptedServer, tmp_path: Path) -> None:
    capped_server.script(lambda prompt: LONG_REPLY)
    run = run_launcher(
        "pi",
        ["--port", str(capped_server.port), "--api", api, "--max-output-tokens", str(CUT_AT)],
        ["-p", "Count.", "--no-session", "--mode", "json"],
        workspace=tmp_path,
        home=tmp_path / "home",
    )
    assert run.returncode == 0, run.stderr
    message = pi_final_message(run.stdout)
    assert message["stopReason"] == "length", message
    text = "".join(part.get("text", "") for part in message["content"] if part.get("type") == "text")
    assert text == LONG_REPLY[:CUT_AT]
    assert all(status == 200 for _, status, _ in _no_5xx(capped_server))
