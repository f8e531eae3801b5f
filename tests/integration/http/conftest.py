"""A real server on 127.0.0.1 (free port) over a scripted fake model, shared by the HTTP tests."""

from __future__ import annotations

import io
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
import structlog
import uvicorn

from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import TelemetrySettings, load_settings
from mlx_dspark.entrypoints.http.app import create_app
from mlx_dspark.entrypoints.log_config import configure_logging
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.scripted import ScriptedLoader
from tests.integration.http import scripts

API_KEY = "test-key"


@attrs.define
class LiveServer:
    base_url: str
    loader: ScriptedLoader
    api_key: str | None
    app: Any

    def script(self, responder: object) -> None:
        self.loader.target.responder = responder  # type: ignore[assignment]


def _serve(app: object, *, wait_s: float = 300.0, **flags: object) -> Iterator[tuple[str, uvicorn.Server]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms Nagle stalls on keep-alive
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while True:  # wait (bounded) for the server and the engine: a real model loads slowly on a shared 2-core CI
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not become healthy")
        time.sleep(0.025)
    try:
        yield base, server
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def make_server(
    *,
    api_key: str | None = None,
    cors_origins: list[str] | None = None,
    context_window: int = 4096,
    **server_flags: object,
) -> Iterator[LiveServer]:
    """A live server over the scripted model; `server_flags` are settings fields (e.g. keepalive_s)."""
    loader = ScriptedLoader(scripts.text, name="local-model", context_window=context_window)
    flags = {"mode": "baseline", "api_key": api_key, "cors_origins": cors_origins, **server_flags}
    settings = load_settings({k: v for k, v in flags.items() if v is not None}, environ={})
    services = bootstrap.build(
        settings, loader=loader, telemetry=RecordingTelemetrySink(), clock=FakeClock(), calibration=object()
    )
    app = create_app(bootstrap.build_server(services, settings))
    for base, _ in _serve(app):
        yield LiveServer(base_url=base, loader=loader, api_key=api_key, app=app)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    yield from make_server(api_key=API_KEY, keepalive_s=0.05, max_body_bytes=256 * 1024, max_queue=2)


@pytest.fixture(autouse=True)
def _reset_script(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "live" in request.fixturenames:
        srv: LiveServer = request.getfixturevalue("live")
        srv.loader.target.responder = scripts.text
        srv.loader.target.gate = None


class CapturedLogs:
    """Log lines written through the production logging setup, into a buffer instead of stderr."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()

    @property
    def text(self) -> str:
        return self.buffer.getvalue()

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.text.splitlines():
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                out.append(value)
        return out

    def requests(self, **match: object) -> list[dict[str, Any]]:
        """The canonical `request.finished` lines whose fields equal `match`."""
        return [
            e
            for e in self.lines()
            if e.get("event") == "request.finished" and all(e.get(k) == v for k, v in match.items())
        ]

    def wait_for(self, timeout: float = 20, **match: object) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.requests(**match)
            if found:
                return found[-1]
            time.sleep(0.02)
        raise AssertionError(f"no request.finished line with {match} in:\n{self.text[-3000:]}")


def capture_logs(json_logs: bool = True) -> CapturedLogs:
    """Configure logging as the CLI does (debug level), then send its lines to a buffer."""
    captured = CapturedLogs()
    configure_logging(TelemetrySettings(log_level="debug", json_logs=json_logs))
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=captured.buffer))
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(captured.buffer)
    structlog.get_logger("mlx_dspark.http").info("logs.probe")
    assert "logs.probe" in captured.text, "a logger was cached before the test configured logging"
    return captured


def restore_logging() -> None:
    structlog.reset_defaults()
    logging.getLogger().handlers = []


@pytest.fixture
def logs() -> Iterator[CapturedLogs]:
    """Production logging (JSON) into a buffer for one test; structlog's defaults come back afterwards."""
    try:
        yield capture_logs()
    finally:
        restore_logging()
