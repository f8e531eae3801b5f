"""The real agents against the real default model (SmolLM2-135M, an 8,192-token window), via the launchers.

Each agent either gets an answer or, where its own first prompt does not fit the window, exactly the
overflow error it recognises (and reports as such). Never a 5xx, never a hang: answers are capped with
`--max-output-tokens`, so they end by the token limit and must still be streams the agent accepts.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import load_settings
from mlx_dspark.entrypoints.http.app import create_app
from tests.agents.conftest import (
    CLAUDE_OVERFLOW,
    AgentRun,
    RecordingApp,
    agents_bin,
    free_port,
    pi_final_message,
    pi_says_overflow,
    run_launcher,
)
from tests.integration.http.conftest import _serve

pytestmark = pytest.mark.slow
WINDOW = 8192
ANSWER_TOKENS = 16  # bounded time; answers end by the token limit
RUN_TIMEOUT_S = 600  # a safety net on a loaded machine; a clean 2-core CI machine needs far less


@pytest.fixture(scope="module")
def real_server() -> Iterator[tuple[int, RecordingApp]]:
    agents_bin()
    bootstrap.runtime().prepare()
    # Codex sends no max_output_tokens: the server's own cap keeps every answer short.
    flags = {"model": "default", "mode": "baseline", "max_tokens_cap": ANSWER_TOKENS}
    settings = load_settings(flags, environ={})
    recorder = RecordingApp(create_app(bootstrap.build_server(bootstrap.build(settings), settings)))
    for base, _ in _serve(recorder):
        yield int(base.rsplit(":", 1)[1]), recorder


def _launch(client: str, port: int, tmp_path: Path, agent_args: list[str], extra: tuple[str, ...] = ()) -> AgentRun:
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    launcher = ["--port", str(port), "--max-output-tokens", str(ANSWER_TOKENS), *extra]
    return run_launcher(
        client, launcher, agent_args, workspace=workspace, home=tmp_path / "home", timeout=RUN_TIMEOUT_S
    )


def test_launcher_announces_the_real_window(real_server: tuple[int, RecordingApp], tmp_path: Path) -> None:
    port, _ = real_server
    run = _launch("pi", port, tmp_path, ["--version"])
    assert f"context window of {WINDOW} tokens" in run.stderr


def test_claude_code_gets_the_overflow_error_it_recognises(
    real_server: tuple[int, RecordingApp], tmp_path: Path
) -> None:
    port, recorder = real_server
    since = len(recorder.requests)
    run = _launch("claude", port, tmp_path, ["-p", "Say hi.", "--output-format", "json", "--max-turns", "1"])
    out = json.loads(run.stdout)
    assert out["is_error"] and out["result"].startswith("Prompt is too long"), out
    # Told the real window, it may stop before sending; whatever it sent got the exact overflow message.
    for r in recorder.requests[since:]:
        assert r.status == 400 and CLAUDE_OVERFLOW.search(r.error.decode()), (r.path, r.status, r.error)


def test_codex_answers_or_reports_the_window(real_server: tuple[int, RecordingApp], tmp_path: Path) -> None:
    port, recorder = real_server
    since = len(recorder.requests)
    last = tmp_path / "last.txt"
    run = _launch("codex", port, tmp_path, ["exec", "--skip-git-repo-check", "-o", str(last), "Say hi."])
    sent = recorder.requests[since:]
    assert sent and all(r.status in (200, 400) for r in sent), [(r.path, r.status) for r in sent]
    if all(r.status == 200 for r in sent):  # its ~4.5k-token prompt fits the 8k window
        assert run.returncode == 0, run.stderr
        assert last.read_text().strip()
    else:
        assert all(json.loads(r.error)["error"]["code"] == "context_length_exceeded" for r in sent if r.status == 400)
        assert run.returncode != 0
        assert "ran out of room in the model's context window" in run.stderr, run.stderr


def test_pi_answers_within_the_token_limit(real_server: tuple[int, RecordingApp], tmp_path: Path) -> None:
    # One API here: the three APIs' wire behaviour is covered on the scripted model; a ~1.5k-token prefill
    # on a 2-core CPU is what this costs.
    api = "openai-completions"
    port, recorder = real_server
    since = len(recorder.requests)
    run = _launch("pi", port, tmp_path, ["-p", "Say hi.", "--no-session", "--mode", "json"], extra=("--api", api))
    sent = recorder.requests[since:]
    assert sent and all(r.status == 200 for r in sent), ([(r.path, r.status, r.error) for r in sent], run.stderr)
    assert run.returncode == 0, run.stderr
    message = pi_final_message(run.stdout)
    assert message["stopReason"] in ("stop", "length"), message
    assert message["usage"]["output"] <= ANSWER_TOKENS
    assert "".join(p.get("text", "") for p in message["content"] if p.get("type") == "text").strip()


def test_launcher_starts_a_server_that_logs_to_a_file(tmp_path: Path) -> None:
    """`mlx-dspark pi` with no server running: it starts one with our flags, tells Pi the window that
    server enforces, keeps its log out of the terminal, and stops it afterwards. A small --context-window
    makes Pi's first prompt overflow, so this costs a model load and no prefill."""
    agents_bin()
    port = free_port()
    log = tmp_path / "server.log"
    launcher = ["--model", "default", "--mode", "baseline", "--port", str(port), "--server-log", str(log)]
    run = run_launcher(
        "pi",
        [*launcher, "--context-window", "1024"],
        ["-p", "Say hi.", "--no-session", "--mode", "json"],
        workspace=tmp_path,
        home=tmp_path / "home",
        timeout=RUN_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr
    assert f"log: {log}" in run.stderr and "context window of 1024 tokens" in run.stderr
    message = pi_final_message(run.stdout)
    assert pi_says_overflow(message, 1024), message
    logged = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert any(rec.get("path") == "/v1/chat/completions" for rec in logged), logged  # the request's log line
    assert '"event"' not in run.stdout + run.stderr  # the server's log stays out of the terminal
    with socket.socket() as s:  # the server it started is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0
