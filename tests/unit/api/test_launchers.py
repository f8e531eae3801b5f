"""Launchers: pure plans, --print-env/--print-config, and a run against a live server with fake clients
that record what they were given; the user's own config files stay untouched."""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_dspark.application.launchers import Target, claude_plan, codex_plan, pi_plan
from mlx_dspark.entrypoints.cli import launch
from tests.integration.http.conftest import LiveServer, make_server

TARGET = Target(base_url="http://127.0.0.1:9999", model="local-model", context_window=65536, max_output_tokens=4096)


def test_claude_plan_scopes_everything_to_the_child() -> None:
    parent = {"PATH": "/bin", "ANTHROPIC_API_KEY": "sk-user", "CLAUDE_CODE_USE_BEDROCK": "1", "HOME": "/home/u"}
    plan = claude_plan(TARGET, ["-p", "hi"], parent)
    assert plan.argv == ("claude", "-p", "hi")
    env = plan.env
    assert "ANTHROPIC_API_KEY" not in env and "CLAUDE_CODE_USE_BEDROCK" not in env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9999" and env["ANTHROPIC_AUTH_TOKEN"]
    for tier in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    ):
        assert env[tier] == "local-model"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0" and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "65536" and int(env["API_TIMEOUT_MS"]) >= 600000
    assert env["PATH"] == "/bin" and parent["ANTHROPIC_API_KEY"] == "sk-user"  # the parent is not modified
    assert set(plan.removed_env) == {"ANTHROPIC_API_KEY", "CLAUDE_CODE_USE_BEDROCK"}


def test_codex_plan_uses_overrides_and_a_temp_catalog() -> None:
    plan = codex_plan(TARGET, ["exec", "hi"], {})
    joined = " ".join(plan.argv)
    assert 'model_providers.mlx-dspark.wire_api="responses"' in joined
    assert 'model_providers.mlx-dspark.base_url="http://127.0.0.1:9999/v1"' in joined
    assert 'model_catalog_json="{tmp}/catalog.json"' in joined and plan.argv[-2:] == ("exec", "hi")
    assert json.loads(plan.files["catalog.json"])["models"][0]["context_window"] == 65536


def test_pi_plan_writes_models_json_in_a_temp_agent_dir() -> None:
    plan = pi_plan(TARGET, ["-p", "hi"], {}, api="anthropic-messages")
    provider = json.loads(plan.files["agent/models.json"])["providers"]["mlx-dspark"]
    assert provider["baseUrl"] == "http://127.0.0.1:9999" and provider["api"] == "anthropic-messages"
    assert provider["models"][0]["contextWindow"] == 65536
    assert plan.env["PI_CODING_AGENT_DIR"] == "{tmp}/agent"
    assert pi_plan(TARGET, [], {}).files["agent/models.json"].count("127.0.0.1:9999/v1") == 1


def test_print_env_and_print_config(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-user")
    assert launch.main("claude", ["--model", "local-model", "--port", "9999", "--print-env"]) == 0
    out = capsys.readouterr().out
    assert "unset ANTHROPIC_API_KEY" in out and "export ANTHROPIC_BASE_URL=http://127.0.0.1:9999" in out
    assert launch.main("codex", ["--model", "local-model", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "# file {tmp}/catalog.json" in out and 'wire_api="responses"' in out
    assert launch.main("pi", ["--model", "local-model", "--print-config"]) == 0
    assert '"api": "openai-completions"' in capsys.readouterr().out


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    yield from make_server()


RECORDER = """#!/bin/sh
{{ echo "argv=$*"; env; if [ -n "$PI_CODING_AGENT_DIR" ]; then cat "$PI_CODING_AGENT_DIR/models.json"; fi; }} > {out}
"""


@pytest.mark.parametrize("client", ["claude", "codex", "pi"])
def test_run_against_a_live_server_leaves_user_config_alone(
    client: str, live: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    user_files = {
        home / ".claude" / "settings.json": '{"model": "opus"}',
        home / ".codex" / "config.toml": 'model = "gpt-5"\n',
        home / ".pi" / "agent" / "models.json": '{"providers": {}}',
    }
    for path, content in user_files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "record.txt"
    program = bin_dir / client
    program.write_text(RECORDER.format(out=record))
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-user")
    port = live.base_url.rsplit(":", 1)[1]
    assert launch.main(client, ["--port", port, "--", "-p", "hi"]) == 0  # reuses the running server
    seen = record.read_text()
    assert "argv=" in seen and seen.splitlines()[0].endswith("-p hi")
    if client == "claude":
        assert f"ANTHROPIC_BASE_URL={live.base_url}" in seen and "ANTHROPIC_API_KEY=" not in seen
        assert "ANTHROPIC_MODEL=local-model" in seen  # the id the running server reports
    elif client == "codex":
        assert "wire_api" in seen and "MLX_DSPARK_API_KEY=" in seen
    else:
        assert f'"baseUrl": "{live.base_url}/v1"' in seen
    for path, content in user_files.items():
        assert path.read_text() == content
    assert os.environ["ANTHROPIC_API_KEY"] == "sk-user"


def test_every_model_flag_reaches_the_server_it_starts() -> None:
    argv = [
        "--model", "some/model", "--mode", "dspark", "--drafter", "d/r", "--drafter-bits", "4", "--max-draft", "3",
        "--confidence-threshold", "0.25", "--trust-remote-code", "--cache-dir", "/c", "--log-level", "debug",
        "--api-key", "k", "--context-window", "4096", "--port", "9123", "--max-output-tokens", "512",
    ]  # fmt: skip
    cmd = launch.serve_command(launch.parser("claude").parse_args(argv))
    assert cmd[cmd.index("serve") :] == [
        "serve", "--host", "127.0.0.1", "--port", "9123", "--model", "some/model", "--mode", "dspark",
        "--drafter", "d/r", "--drafter-bits", "4", "--max-draft", "3", "--confidence-threshold", "0.25",
        "--trust-remote-code", "--cache-dir", "/c", "--log-level", "debug", "--api-key", "k",
        "--context-window", "4096", "--max-tokens-cap", "512",
    ]  # fmt: skip
    # and `serve` takes each of them
    from mlx_dspark.entrypoints.cli import serve

    serve.parser().parse_args(cmd[cmd.index("serve") + 1 :])
    assert launch.model_flags(launch.parser("pi").parse_args([])) == []


def test_a_model_that_fails_to_load_fails_fast_with_the_servers_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "server.log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--model", str(tmp_path / "no-such-model"), "--mode", "baseline", "--port", str(port)]
    with pytest.raises(SystemExit) as exc:
        launch.main("codex", [*argv, "--server-log", str(log), "--", "exec", "hi"])
    message = str(exc.value)
    assert "could not start" in message and "no-such-model" in message and str(log) in message
    assert f"log: {log}" in capsys.readouterr().err
    assert log.stat().st_size > 0  # the server wrote there, not to our terminal
    with socket.socket() as s:  # and it was stopped
        assert s.connect_ex(("127.0.0.1", port)) != 0
