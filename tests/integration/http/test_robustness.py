"""Malformed input, auth, CORS, keep-alives and cancellation: clear 4xx answers and an engine that survives."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.http.conftest import CapturedLogs, LiveServer, make_server

ROUTES = {
    "/v1/chat/completions": "openai",
    "/v1/responses": "openai",
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
}


def _post(live: LiveServer, path: str, body: object | bytes, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"authorization": f"Bearer {live.api_key}", "content-type": "application/json", **headers}
    return httpx.post(live.base_url + path, content=content, headers=hdrs, timeout=30)


def _error_message(path: str, r: httpx.Response) -> str:
    body = r.json()
    if ROUTES[path] == "anthropic":
        assert body["type"] == "error" and body["error"]["type"]
        return str(body["error"]["message"])
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return str(body["error"]["message"])


def _engine_alive(live: LiveServer) -> None:
    r = _post(live, "/v1/chat/completions", {"model": "local-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b'{"model": "local-model", "messages": [', "not valid JSON"),
        (b"", "empty"),
        (b"[1, 2]", "must be a JSON object"),
        ({"model": 7, "messages": [], "input": "x", "max_tokens": 5}, "expected a string"),
        ({"model": "local-model", "messages": "nope", "input": 3, "max_tokens": "5"}, "invalid request"),
    ],
)
def test_malformed_bodies_get_clear_400(live: LiveServer, path: str, body: object, fragment: str) -> None:
    r = _post(live, path, body)  # type: ignore[arg-type]
    assert r.status_code == 400
    assert fragment in _error_message(path, r)


def test_unknown_roles_and_blocks(live: LiveServer) -> None:
    cases = [
        (
            "/v1/chat/completions",
            {"model": "local-model", "messages": [{"role": "wizard", "content": "x"}]},
            "unknown role",
        ),
        ("/v1/responses", {"model": "local-model", "input": [{"role": "wizard", "content": "x"}]}, "unknown role"),
        ("/v1/responses", {"model": "local-model", "input": [{"type": "item_reference", "id": "x"}]}, "not supported"),
        (
            "/v1/messages",
            {"model": "local-model", "max_tokens": 5, "messages": [{"role": "wizard", "content": "x"}]},
            "unknown role",
        ),
        (
            "/v1/messages",
            {
                "model": "local-model",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "hologram"}]}],
            },
            "unknown content block type 'hologram'",
        ),
        (
            "/v1/messages",
            {
                "model": "local-model",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "text-only",
        ),
        (
            "/v1/chat/completions",
            {"model": "local-model", "messages": [{"role": "user", "content": "x"}], "temperature": -1},
            "temperature",
        ),
    ]
    for path, body, fragment in cases:
        r = _post(live, path, body)
        assert r.status_code == 400, (path, r.text)
        assert fragment in _error_message(path, r), r.text
    _engine_alive(live)


def test_huge_body_is_413_and_engine_survives(live: LiveServer) -> None:
    big = {"model": "local-model", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * (300 * 1024)}]}
    r = _post(live, "/v1/messages", big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = _post(live, "/v1/chat/completions", big)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    _engine_alive(live)


def test_auth_and_query_strings_and_paths_without_v1(live: LiveServer) -> None:
    body = {"model": "local-model", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(live.base_url + "/v1/messages?beta=true", json=body, headers={"x-api-key": live.api_key or ""})
    assert r.status_code == 200
    r = httpx.post(live.base_url + "/messages?beta=true", json=body, headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(live.base_url + "/chat/completions", json={"model": "local-model", "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(live.base_url + "/health").json()["status"] == "ok"  # no key needed
    r = httpx.options(
        live.base_url + "/v1/messages",
        headers={"origin": "https://evil.example", "access-control-request-method": "POST"},
    )
    assert "access-control-allow-origin" not in r.headers  # no CORS unless --cors-origin


@pytest.fixture(scope="module")
def cors() -> Iterator[LiveServer]:
    yield from make_server(cors_origins=["http://localhost:3000"])


def test_cors_only_for_configured_origin(cors: LiveServer) -> None:
    preflight = {"access-control-request-method": "POST"}
    r = httpx.options(cors.base_url + "/v1/messages", headers={"origin": "http://localhost:3000", **preflight})
    assert r.headers.get("access-control-allow-origin") == "http://localhost:3000"
    r = httpx.options(cors.base_url + "/v1/messages", headers={"origin": "https://evil.example", **preflight})
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"


def test_keepalive_during_a_slow_prefill_and_cancellation_on_disconnect(live: LiveServer, logs: CapturedLogs) -> None:
    target = live.loader.target
    live.script(lambda prompt: "z" * 2000)
    gate = threading.Event()
    target.gate = gate
    target.reached_gate.clear()
    body = {"model": "local-model", "max_tokens": 3000, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    headers = {"x-api-key": live.api_key or ""}
    events: list[str] = []
    with httpx.stream("POST", live.base_url + "/v1/messages", json=body, headers=headers, timeout=30) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("event: "):
                events.append(line[7:])
            if events.count("ping") >= 3:  # message_start's ping plus keep-alives while the engine is held
                break
    # the client is gone; the engine is still held at the gate
    assert events[0] == "message_start" and target.reached_gate.is_set()
    line = logs.wait_for(path="/v1/messages", outcome="cancelled")  # the server notices the disconnect
    assert line["status"] == 200 and line["stream"] is True and line["prompt_tokens"] > 0
    target.gate = None
    gate.set()
    _engine_alive(live)  # queued behind the cancelled job: proves it ended
    assert target.emitted[-2] < 100  # stopped long before its 2000 tokens


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "logprobs"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1.0}, "presence_penalty"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
    ],
)
def test_unimplemented_sampling_options_are_refused_not_ignored(live: LiveServer, extra: dict, param: str) -> None:
    body = {"model": "local-model", "messages": [{"role": "user", "content": "hi"}], **extra}
    r = _post(live, "/v1/chat/completions", body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    # Zero penalties are what many SDKs send by default: accepted.
    ok = {"model": "local-model", "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 0}
    assert _post(live, "/v1/chat/completions", ok).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "keepalive", "last"),
    [
        ("/v1/messages", {"max_tokens": 5}, "event: ping", "event: message_stop"),
        ("/v1/chat/completions", {"max_tokens": 5}, ": keep-alive", "data: [DONE]"),
        ("/v1/responses", {"max_output_tokens": 5}, "event: response.in_progress", "event: response.completed"),
    ],
)
def test_keepalives_reach_a_request_that_waits_in_the_queue(live: LiveServer, path, body, keepalive, last) -> None:
    """A streaming request queued behind a held one gets its stream started and keep-alives, then its answer."""
    target = live.loader.target
    live.script(lambda prompt: "ok")
    gate = threading.Event()
    target.gate = gate
    target.reached_gate.clear()
    headers = {"x-api-key": live.api_key or ""}
    hold = {"model": "local-model", "max_tokens": 50, "stream": False, "messages": [{"role": "user", "content": "a"}]}
    holder = threading.Thread(target=lambda: _post(live, "/v1/chat/completions", hold), daemon=True)
    holder.start()
    assert target.reached_gate.wait(10)  # the engine is busy with the first request
    queued = {"model": "local-model", "stream": True, **body}
    if path == "/v1/responses":
        queued["input"] = "b"
    else:
        queued["messages"] = [{"role": "user", "content": "b"}]
    lines: list[str] = []
    try:
        with httpx.stream("POST", live.base_url + path, json=queued, headers=headers, timeout=30) as r:
            assert r.status_code == 200
            stream = r.iter_lines()
            for line in stream:
                lines.append(line)
                if sum(1 for x in lines if x.startswith(keepalive)) >= 3:
                    break
            assert not gate.is_set() and target.emitted[-1] <= 1  # still queued behind the held request
            target.gate = None
            gate.set()
            lines.extend(stream)
    finally:
        target.gate = None
        gate.set()
        holder.join(10)
    assert last in lines  # the queued request was answered in full once the engine got to it
    assert '"k"' in "\n".join(lines)
