"""The real agents against the real default model (SmolLM2-135M, an 8,192-token window), via the launchers.

Each agent either gets an answer or, where its own first prompt does not fit the window, exactly the
overflow error it recognises (and reports as such). Never a 5xx, never a hang: answers are capped with
`--max-output-tokens`, so they end by the token limit and must still be streams the agent accepts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import load_settings
from mlx_dspark.entrypoints.http.app import create_app
from tests.agents.conftest import RecordingApp, agents_bin, run_launcher
from tests.integration.http.conftest import _serve

pytestmark = pytest.mark.slow
WINDOW = 8192
ANSWER_TOKENS = 16  # bounded time; answers end by the token limit
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def real_server() -> Iterator[tuple[int, RecordingApp]]:
    agents_bin()
    bootstrap.prepare_runtime()
    # Codex sends no max_output_tokens: the server's own cap keeps every answer short.
    flags = {"model": "default", "mode": "baseline", "max_tokens_cap": ANSWER_TOKENS}
    settings = load_settings(flags, environ={})
    recorder = RecordingApp(create_app(bootstrap.build(settings), settings))  # type: ignore[arg-type]
    for base, _ in _serve(recorder):
        yield int(base.rsplit(":", 1)[1]), recorder


def _statuses(recorder: RecordingApp, since: int) -> list[tuple[str, int]]:
    return [(r.path, r.status) for r in recorder.requests[since:]]


def _launch(client: str, port: int, tmp_path: Path, agent_args: list[str], extra: list[str] = ()):  # type: ignore[no-untyped-def]
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
    statuses = _statuses(recorder, since)
    assert statuses and all(s < 500 for _, s in statuses), statuses
    out = json.loads(run.stdout)
    assert out["is_error"], out
    assert "prompt is too long" in out["result"].lower(), out
    assert any(p.endswith("/messages") and s == 400 for p, s in statuses)


def test_codex_answers_or_reports_the_window(real_server: tuple[int, RecordingApp], tmp_path: Path) -> None:
    port, recorder = real_server
    since = len(recorder.requests)
    last = tmp_path / "last.txt"
    run = _launch("codex", port, tmp_path, ["exec", "--skip-git-repo-check", "-o", str(last), "Say hi."])
    statuses = _statuses(recorder, since)
    assert statuses and all(s < 500 for _, s in statuses), statuses
    if all(s == 200 for _, s in statuses):
        assert run.returncode == 0, run.stderr
        assert last.read_text().strip()
    else:
        assert run.returncode != 0
        assert "context window" in (run.stderr + run.stdout).lower(), run.stderr


@pytest.mark.parametrize("api", ["openai-completions", "openai-responses", "anthropic-messages"])
def test_pi_answers_within_the_token_limit(api: str, real_server: tuple[int, RecordingApp], tmp_path: Path) -> None:
    port, recorder = real_server
    since = len(recorder.requests)
    run = _launch("pi", port, tmp_path, ["-p", "Say hi.", "--no-session"], extra=["--api", api])
    statuses = _statuses(recorder, since)
    assert statuses and all(s == 200 for _, s in statuses), (statuses, run.stderr)
    assert run.returncode == 0, run.stderr + run.stdout
    assert run.stdout.strip()
