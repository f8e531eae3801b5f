"""Ordinary events are logged as such: a client that hangs up, and an overloaded server, log no error and no
traceback; each request still has its one canonical line saying how it ended."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.integration.http.conftest import CapturedLogs, LiveServer

GO = [{"role": "user", "content": "go"}]
TURNS = {
    "/v1/chat/completions": {"model": "local-model", "max_tokens": 3000, "messages": GO},
    "/v1/responses": {"model": "local-model", "max_output_tokens": 3000, "input": "go"},
    "/v1/messages": {"model": "local-model", "max_tokens": 3000, "messages": GO},
}


def _open(live: LiveServer, path: str, body: dict[str, Any]) -> socket.socket:
    """A request sent on a raw socket, so the test can hang up whenever it likes."""
    url = urlsplit(live.base_url)
    sock = socket.create_connection((url.hostname, url.port))
    raw = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {live.api_key}\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    sock.sendall(head.encode() + raw)
    return sock


def _wait(predicate: Any, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def jobs(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every job the HTTP layer submits to the engine, to see when a disconnect has cancelled one."""
    engine = live.app.state.ctx.engine
    submitted: list[Any] = []

    def spying(submit: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            job = submit(*args, **kwargs)
            submitted.append(job)
            return job

        return spy

    monkeypatch.setattr(engine, "submit", spying(engine.submit))
    monkeypatch.setattr(engine, "submit_decode", spying(engine.submit_decode))
    yield submitted


def _quiet(logs: CapturedLogs, overloaded: bool = False) -> None:
    """No line at error level, no traceback and no 5xx in the whole log (but the 529s of `overloaded`)."""
    lines = logs.lines()
    assert not [e for e in lines if e.get("level") in ("error", "critical")], logs.text[-3000:]
    assert not [e for e in lines if "exception" in e or "exc_info" in e], logs.text[-3000:]
    assert "Traceback" not in logs.text
    allowed = {529} if overloaded else set()
    assert not [e for e in logs.requests() if e["status"] >= 500 and e["status"] not in allowed], logs.requests()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", list(TURNS))
def test_a_client_that_hangs_up_mid_turn_is_a_cancelled_request_not_a_500(
    live: LiveServer, logs: CapturedLogs, jobs: list[Any], path: str, stream: bool
) -> None:
    target = live.loader.target
    live.script(lambda prompt: "z" * 5000)
    gate = threading.Event()
    target.reached_gate.clear()
    target.gate = gate
    try:
        sock = _open(live, path, {**TURNS[path], "stream": stream})
        assert target.reached_gate.wait(20)  # the turn is generating, held at the gate
        if stream:
            assert sock.recv(1)  # the stream has begun
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        _wait(lambda: jobs and jobs[-1].cancelled, "the server did not cancel the turn of a client that hung up")
    finally:
        target.gate = None
        gate.set()
    line = logs.wait_for(path=path, outcome="cancelled")
    assert line["stream"] is stream and line["prompt_tokens"] > 0
    _quiet(logs)
    assert target.emitted[-1] < 3000  # stopped long before its budget


def test_an_anthropic_529_logs_a_warning_without_a_traceback(
    live: LiveServer, logs: CapturedLogs, jobs: list[Any]
) -> None:
    """Overload is expected under load: its line says so, at warning level, with the canonical request line."""
    target = live.loader.target
    engine = live.app.state.ctx.engine
    live.script(lambda prompt: "z" * 5000)
    gate = threading.Event()
    target.reached_gate.clear()
    target.gate = gate
    held = []
    try:
        held.append(_open(live, "/v1/messages", TURNS["/v1/messages"]))
        assert target.reached_gate.wait(20)
        held += [_open(live, "/v1/messages", TURNS["/v1/messages"]) for _ in range(2)]
        _wait(lambda: engine.queue_depth == 2, "two requests did not queue")  # max_queue=2 on this server
        headers = {"authorization": f"Bearer {live.api_key}"}
        refused = httpx.post(live.base_url + "/v1/messages", json=TURNS["/v1/messages"], headers=headers, timeout=30)
        assert refused.status_code == 529 and refused.json()["error"]["type"] == "overloaded_error"
    finally:
        target.gate = None
        gate.set()
        for sock in held:
            sock.close()
    line = logs.wait_for(path="/v1/messages", status=529)
    assert line["outcome"] == "rejected" and line["error_type"] == "Overloaded"
    assert [e for e in logs.lines() if e.get("event") == "http.overloaded" and e.get("level") == "warning"]
    logs.wait_for(path="/v1/messages", outcome="cancelled")  # the held ones, hung up on
    _quiet(logs, overloaded=True)
