"""A real server on 127.0.0.1 (free port) over a scripted fake model, shared by the HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
import uvicorn

from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import load_settings
from mlx_dspark.entrypoints.http.app import create_app
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


def _serve(app: object, **flags: object) -> Iterator[tuple[str, uvicorn.Server]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(400):  # wait (bounded) for the server and the engine
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.025)
    else:
        raise RuntimeError("the test server did not become healthy")
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
    **app_kwargs: object,
) -> Iterator[LiveServer]:
    loader = ScriptedLoader(scripts.text, name="local-model", context_window=context_window)
    flags = {"mode": "baseline", "api_key": api_key, "cors_origins": cors_origins}
    settings = load_settings({k: v for k, v in flags.items() if v is not None}, environ={})
    services = bootstrap.build(
        settings, loader=loader, telemetry=RecordingTelemetrySink(), clock=FakeClock(), calibration=object()
    )
    app = create_app(services, settings, **app_kwargs)  # type: ignore[arg-type]
    for base, _ in _serve(app):
        yield LiveServer(base_url=base, loader=loader, api_key=api_key, app=app)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    yield from make_server(api_key=API_KEY, keepalive_s=0.05, max_body_bytes=256 * 1024)


@pytest.fixture(autouse=True)
def _reset_script(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "live" in request.fixturenames:
        srv: LiveServer = request.getfixturevalue("live")
        srv.loader.target.responder = scripts.text
        srv.loader.target.gate = None
