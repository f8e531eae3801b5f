"""The real coding agents (npm, pinned by dev.sh) against the real server, run headless through our launchers.

`./dev.sh test` installs Node, Claude Code, Codex and Pi into a cache and exports MLX_DSPARK_AGENTS (their
bin folder); then a missing binary fails the tier. Without it the default cache is tried, and the tier is
skipped with the reason (dev.sh prints a loud banner when npm is unreachable).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import attrs
import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import load_settings
from mlx_dspark.entrypoints.http.app import create_app
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.scripted import ScriptedLoader
from tests.fakes.tokenizer import FakeTokenizer
from tests.integration.http.conftest import _serve

AGENTS = ("claude", "codex", "pi")
RUN_TIMEOUT_S = 180  # a hang fails the test instead of the suite
DEFAULT_BIN = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-dspark" / "agents" / "bin"

# ChatML with no tool support, the shape of the default model's (SmolLM2) template: the family layer
# picks the Hermes text fallback for it, exactly as it does for the real default model.
CHATML_NO_TOOLS = """
{%- for m in messages -%}
{%- if loop.first and m.role != 'system' -%}
<|im_start|>system
You are a small helpful assistant.<|im_end|>
{% endif -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

ASGIApp = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agents_bin() -> Path:
    """The folder holding node, claude, codex and pi; skips (or fails, under dev.sh) when absent."""
    required = os.environ.get("MLX_DSPARK_AGENTS")
    folder = Path(required) if required else DEFAULT_BIN
    missing = [name for name in ("node", *AGENTS) if not (folder / name).exists()]
    if missing and required:
        pytest.fail(f"dev.sh installed the agents into {folder}, but {', '.join(missing)} is missing")
    if missing:
        why = os.environ.get("MLX_DSPARK_AGENTS_SKIP") or "not installed (`./dev.sh agents` installs them)"
        pytest.skip(f"real-agent tier: {why}")
    return folder


@attrs.define
class Recorded:
    path: str
    body: Any
    status: int = 0  # the response status, once sent
    error: bytes = b""  # the body of an error response


class RecordingApp:
    """ASGI wrapper that keeps every POST body the server received, in order, with its response status."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests: list[Recorded] = []

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        record = Recorded(path=scope["path"], body=None)
        self.requests.append(record)

        async def recording_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    try:
                        record.body = json.loads(b"".join(chunks))
                    except ValueError:
                        record.body = None
            return message

        async def recording_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body" and record.status >= 400:
                record.error += message.get("body", b"")
            await send(message)

        await self.app(scope, recording_receive, recording_send)


@attrs.define
class ScriptedServer:
    base_url: str
    port: int
    loader: ScriptedLoader
    recorder: RecordingApp

    def script(self, responder: Callable[[str], str]) -> None:
        self.loader.target.responder = responder
        self.recorder.requests.clear()


def serve_scripted(context_window: int, **flags: object) -> Iterator[ScriptedServer]:
    """The real app (real uvicorn, loopback) over a scripted model of the default model's family."""
    loader = ScriptedLoader(
        name="local-model", context_window=context_window, tokenizer=FakeTokenizer(CHATML_NO_TOOLS), family="llama"
    )
    settings = load_settings({"mode": "baseline", **flags}, environ={})
    services = bootstrap.build(
        settings, loader=loader, telemetry=RecordingTelemetrySink(), clock=FakeClock(), calibration=object()
    )
    recorder = RecordingApp(create_app(bootstrap.build_server(services, settings)))  # type: ignore[arg-type]
    for base, _ in _serve(recorder):
        yield ScriptedServer(base_url=base, port=int(base.rsplit(":", 1)[1]), loader=loader, recorder=recorder)


@pytest.fixture(scope="session")
def scripted_server() -> Iterator[ScriptedServer]:
    # One token per character: Claude Code's first prompt is ~50k characters.
    yield from serve_scripted(400_000)


@attrs.frozen
class AgentRun:
    returncode: int
    stdout: str
    stderr: str


def run_launcher(
    client: str,
    launcher_args: list[str],
    agent_args: list[str],
    *,
    workspace: Path,
    home: Path,
    timeout: float = RUN_TIMEOUT_S,
) -> AgentRun:
    """`mlx-dspark CLIENT LAUNCHER_ARGS -- AGENT_ARGS` in `workspace`, with a fresh HOME and stdin closed."""
    cmd = [sys.executable, "-m", "mlx_dspark.entrypoints", client, *launcher_args, "--", *agent_args]
    return run_isolated(cmd, workspace=workspace, home=home, timeout=timeout)


def isolated_env(home: Path) -> dict[str, str]:
    """A minimal environment: the agents' bin folder first on PATH, a fresh HOME, no colours."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.pathsep.join([str(agents_bin()), str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
        "HOME": str(home),
        "TERM": "dumb",
        "LANG": "C.UTF-8",
        "NO_COLOR": "1",
    }


def run_isolated(
    cmd: list[str], *, workspace: Path, home: Path, env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT_S
) -> AgentRun:
    """Run `cmd` in its own process group (a hang kills the group and fails the test)."""
    env = env or isolated_env(home)
    proc = subprocess.Popen(
        cmd,
        cwd=workspace,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # on a hang the whole group goes: the launcher, the agent, its tools
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[:4]} did not finish in {timeout:.0f} s\nstdout: {out}\nstderr: {err}")
    return AgentRun(proc.returncode, out, err)


OFFERED = re.compile(r'"name": "([A-Za-z0-9_.\-]+)"')
CLAUDE_OVERFLOW = re.compile(r"prompt is too long: (\d+) tokens > \d+ maximum")  # the message Claude Code parses
TOOLS_BLOCK = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)


def offered_tools(prompt: str) -> set[str]:
    """Tool names the Hermes fallback listed in the system prompt (inside <tools>…</tools>)."""
    return {name for block in TOOLS_BLOCK.findall(prompt) for name in OFFERED.findall(block)}


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """One tool call the way the default model's family writes it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def pi_final_message(stdout: str) -> dict[str, Any]:
    """The last assistant message of a `pi --mode json` run."""
    messages = [
        event["message"]
        for event in map(json.loads, filter(None, stdout.splitlines()))
        if event.get("type") == "message_end" and event.get("message", {}).get("role") == "assistant"
    ]
    assert messages, stdout[-2000:]
    return messages[-1]


def pi_says_overflow(message: dict[str, Any], window: int) -> bool:
    """Pi's own isContextOverflow (pi-ai, the version Pi pins) on the message it reported."""
    pi = Path(os.path.realpath(agents_bin() / "pi"))
    modules = next(p for p in pi.parents if p.name == "node_modules")
    module = modules / "@earendil-works" / "pi-ai" / "dist" / "utils" / "overflow.js"
    script = (
        "const m = await import(process.argv[1]);"
        "const msg = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "process.stdout.write(String(m.isContextOverflow(msg, Number(process.argv[2]))));"
    )
    node = [str(agents_bin() / "node"), "--input-type=commonjs", "-e", f"(async () => {{ {script} }})()"]
    done = subprocess.run(
        [*node, str(module), str(window)],
        input=json.dumps(message),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip() == "true"
