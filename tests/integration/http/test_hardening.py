"""A web page cannot drive the server, bad bodies are 4xx, logs keep secrets out, the queue is bounded."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from mlx_dspark.adapters.api.common import MAX_JSON_DEPTH
from tests.integration.http import scripts
from tests.integration.http.conftest import CapturedLogs, LiveServer, capture_logs, make_server, restore_logging

BODIES = {
    "/v1/chat/completions": {"model": "local-model", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "local-model", "input": "hi"},
    "/v1/messages": {"model": "local-model", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "local-model", "messages": [{"role": "user", "content": "hi"}]},
}
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")


def _send(live: LiveServer, path: str, body: object | bytes, *, method: str = "POST", **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"authorization": f"Bearer {live.api_key}", "content-type": "application/json", **headers}
    hdrs = {k: v for k, v in hdrs.items() if v != ""}
    return httpx.request(method, live.base_url + path, content=content, headers=hdrs, timeout=30)


def _error(path: str, r: httpx.Response) -> dict[str, object]:
    """The error object, checked against the dialect's envelope."""
    body = r.json()
    if path in ANTHROPIC:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error: dict[str, object] = body["error"]
    return error


def _works(live: LiveServer, path: str = "/v1/chat/completions", **headers: str) -> None:
    r = _send(live, path, BODIES[path], **headers)
    assert r.status_code == 200, r.text


# ---- a web page cannot drive the server -----------------------------------------------------------------


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize(
    "content_type", ["", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_post_that_is_not_json_is_415(live: LiveServer, path: str, content_type: str) -> None:
    r = _send(live, path, BODIES[path], **{"content-type": content_type})
    assert r.status_code == 415
    error = _error(path, r)
    assert error["type"] == "invalid_request_error" and "application/json" in str(error["message"])


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_with_parameters_or_any_case_is_accepted(live: LiveServer, content_type: str) -> None:
    _works(live, **{"content-type": content_type})


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://127.0.0.1:1"])
def test_a_foreign_origin_is_403(live: LiveServer, path: str, origin: str) -> None:
    r = _send(live, path, BODIES[path], origin=origin)
    assert r.status_code == 403
    error = _error(path, r)
    assert error["type"] == "permission_error" and "--cors-origin" in str(error["message"])
    r = httpx.get(live.base_url + "/v1/models", headers={"origin": origin, "authorization": f"Bearer {live.api_key}"})
    assert r.status_code == 403  # reads too: a page must not even probe


def test_the_servers_own_pages_may_call_it(live: LiveServer) -> None:
    """Same origin (a dashboard served here): Origin names this host:port."""
    for path in BODIES:
        _works(live, path, origin=live.base_url)


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "attacker.127.0.0.1.nip.io"])
def test_a_foreign_host_name_is_refused_dns_rebinding(live: LiveServer, path: str, host: str) -> None:
    r = _send(live, path, BODIES[path], host=host)
    assert r.status_code == 400
    assert "DNS rebinding" in str(_error(path, r)["message"])
    # Even with a matching Origin, as a rebound page would send.
    r = _send(live, path, BODIES[path], host=host, origin=f"http://{host}")
    assert r.status_code in (400, 403)
    assert httpx.get(live.base_url + "/health", headers={"host": host}).status_code == 400


@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST:8080", "127.0.0.1", "[::1]:8080", "10.1.2.3", "app.localhost"]
)
def test_ip_literals_and_localhost_names_pass(live: LiveServer, host: str) -> None:
    _works(live, host=host)
    _works(live, "/v1/messages", host=host, origin=f"http://{host}")  # same origin under that name


@pytest.fixture(scope="module")
def configured() -> Iterator[LiveServer]:
    yield from make_server(cors_origins=["http://localhost:3000"], allowed_hosts=["gpu-box.lan"])


def test_cors_origin_and_allowed_host_open_exactly_what_they_name(configured: LiveServer) -> None:
    _works(configured, origin="http://localhost:3000")
    r = httpx.options(
        configured.base_url + "/v1/chat/completions",
        headers={"origin": "http://localhost:3000", "access-control-request-method": "POST"},
    )
    assert r.headers.get("access-control-allow-origin") == "http://localhost:3000"
    for origin in ("http://localhost:3001", "https://localhost:3000", "http://x.example"):
        r = _send(configured, "/v1/chat/completions", BODIES["/v1/chat/completions"], origin=origin)
        assert r.status_code == 403, origin
    _works(configured, host="gpu-box.lan:8080")
    assert (
        _send(configured, "/v1/chat/completions", BODIES["/v1/chat/completions"], host="other.lan").status_code == 400
    )


# ---- malformed bodies and unknown routes ----------------------------------------------------------------


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json.loads
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
        b'{"model": "local-model", "messages": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
    ],
    ids=["arrays-100k", "objects-5k", "just-past-the-limit"],
)
def test_deeply_nested_bodies_are_400_in_the_dialects_envelope(live: LiveServer, path: str, raw: bytes) -> None:
    r = _send(live, path, raw)
    assert r.status_code == 400, r.text
    assert "nested deeper" in str(_error(path, r)["message"])


@pytest.mark.parametrize("path", list(BODIES))
def test_an_unpaired_surrogate_escape_is_400_a_pair_is_text(live: LiveServer, path: str) -> None:
    """Valid JSON but not text: a real tokenizer raises TypeError on it (was a 500)."""
    body = json.dumps(BODIES[path])
    lone = body.replace('"hi"', '"hi \\ud800"').encode()
    r = _send(live, path, lone)
    assert r.status_code == 400 and "surrogate" in str(_error(path, r)["message"])
    pair = body.replace('"hi"', '"hi \\ud83d\\ude00"').encode()  # an emoji, escaped
    assert _send(live, path, pair).status_code == 200


def test_nesting_within_the_limit_goes_all_the_way_through(live: LiveServer) -> None:
    """A deep (but allowed) tool schema is rendered by the template and answered, not a 500."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range((MAX_JSON_DEPTH - 6) // 2):  # each wrap is two levels; the body adds five
        schema = {"type": "object", "properties": {"x": schema}}
    tool = {"type": "function", "function": {"name": "deep", "description": "d", "parameters": schema}}
    body = {**BODIES["/v1/chat/completions"], "tools": [tool]}
    r = _send(live, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("method", "path", "anthropic"),
    [
        ("POST", "/v1/completions", False),
        ("GET", "/v1/nope", False),
        ("POST", "/v1/embeddings", False),
        ("GET", "/favicon.ico", False),
        ("POST", "/v1/messages/batches", True),
    ],
)
def test_unknown_routes_are_404_in_an_error_envelope(live: LiveServer, method: str, path: str, anthropic: bool) -> None:
    r = _send(live, path, {"model": "local-model", "prompt": "hi"}, method=method)
    assert r.status_code == 404
    body = r.json()
    if anthropic:
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    else:
        assert body["error"]["type"] == "not_found_error" and set(body["error"]) == {"message", "type", "param", "code"}


def test_wrong_method_is_405_in_the_envelope(live: LiveServer) -> None:
    r = httpx.get(live.base_url + "/v1/chat/completions", headers={"authorization": f"Bearer {live.api_key}"})
    assert r.status_code == 405 and "message" in r.json()["error"]


# ---- logs -------------------------------------------------------------------------------------------------

PLANTED_KEY = "sk-planted-4f1c2d9e"
PLANTED_BODY = "planted-body-7b3e61a0"


def _boom(prompt: str) -> str:
    raise RuntimeError("the scripted model broke")


@pytest.fixture(scope="module")
def keyed() -> Iterator[LiveServer]:
    yield from make_server(api_key=PLANTED_KEY, keepalive_s=0.05)


@pytest.mark.parametrize("json_logs", [True, False], ids=["json", "console"])
def test_a_500_logs_its_traceback_but_no_key_and_no_body(keyed: LiveServer, json_logs: bool) -> None:
    logs = capture_logs(json_logs=json_logs)
    try:
        keyed.script(_boom)
        for path, body in BODIES.items():
            if path.endswith("count_tokens"):
                continue
            for stream in (False, True):
                planted = {**body, "stream": stream}
                key = "messages" if "messages" in body else "input"
                planted[key] = [{"role": "user", "content": f"say {PLANTED_BODY} please"}]
                r = _send(keyed, path, planted)
                text = r.text
                assert (r.status_code == 500) if not stream else (r.status_code == 200 and "error" in text)
                assert "internal server error" in text and "broke" not in text  # no internals to the client
        text = logs.text
        assert "RuntimeError" in text and "_boom" in text  # the traceback is there …
        assert PLANTED_KEY not in text and PLANTED_BODY not in text  # … without locals: no key, no body
        if json_logs:  # and each failed request has its one canonical line, saying how it failed
            failed = logs.requests(outcome="failed", error_type="RuntimeError")
            assert sorted((e["stream"], e["status"]) for e in failed) == [(False, 500)] * 3 + [(True, 200)] * 3
            assert all("error" not in e for e in failed)  # a 5xx's message is not ours to log
    finally:
        keyed.script(scripts.text)
        restore_logging()


# ---- one canonical line per request --------------------------------------------------------------------


def test_one_canonical_line_per_request_with_the_turns_numbers(live: LiveServer, logs: CapturedLogs) -> None:
    live.script(scripts.stop_words)
    for path, body in BODIES.items():
        for stream in (False, True):
            if path.endswith("count_tokens") and stream:
                continue
            r = _send(live, path, {**body, "stream": stream} if not path.endswith("count_tokens") else body)
            assert r.status_code == 200
    reply_tokens = len(live.loader.tokenizer.encode(scripts.stop_words(""), add_special_tokens=False))
    lines = logs.requests()
    assert len(lines) == 7  # 3 dialects x (whole, streamed) + count_tokens: one line each
    assert all(e["status"] == 200 and e["outcome"] == "completed" for e in lines)
    assert {e["dialect"] for e in lines} == {"openai_chat", "openai_responses", "anthropic"}
    turns = [e for e in lines if not e["path"].endswith("count_tokens")]
    for e in turns:
        assert e["mode"] == "baseline" and e["model"] == "local-model" and isinstance(e["stream"], bool)
        assert e["prompt_tokens"] > 0 and 0 <= e["cached_prompt_tokens"] <= e["prompt_tokens"]
        assert e["completion_tokens"] == reply_tokens and e["finish_reason"] == "stop"
        assert e["source"] == "baseline"
        assert e["rounds"] == reply_tokens  # plain decoding: one token per round after prefill's, then EOS
        assert e["drafted"] == 0 and e["acceptance"] is None and e["cap_histogram"] == {"0": e["rounds"]}
        assert e["prefill_ms"] > 0 and e["decode_ms"] > 0
    count = next(e for e in lines if e["path"].endswith("count_tokens"))
    assert count["prompt_tokens"] > 0
    # No second line from the engine with its own words for the finish.
    assert not [e for e in logs.lines() if e.get("event") == "request.finished" and "dialect" not in e]


def test_a_refused_request_logs_one_line_with_the_error_type(live: LiveServer, logs: CapturedLogs) -> None:
    _send(live, "/v1/messages", {"model": "other", "max_tokens": 5, "messages": []})
    _send(live, "/v1/chat/completions", b"{", **{"content-type": "text/plain"})
    _send(live, "/v1/completions", {})
    lines = logs.requests()
    assert [(e["dialect"], e["status"], e["outcome"]) for e in lines] == [
        ("anthropic", 404, "rejected"),
        ("openai_chat", 415, "rejected"),
        ("openai_chat", 404, "rejected"),
    ]
    assert lines[0]["error_type"] == "ModelUnavailable" and "not served" in lines[0]["error"]


# ---- the engine's queue and thread --------------------------------------------------------------------


def _hold(live: LiveServer) -> threading.Event:
    target = live.loader.target
    live.script(lambda prompt: "z" * 2000)
    gate = threading.Event()
    target.reached_gate.clear()
    target.gate = gate
    return gate


def _wait(predicate: object, timeout: float = 20) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_past_the_queue_bound_each_dialect_says_overloaded(live: LiveServer) -> None:
    """max_queue=2 here: one request runs, two wait, the next is refused until the engine catches up."""
    engine = live.app.state.ctx.engine
    gate = _hold(live)
    body = {**BODIES["/v1/chat/completions"], "max_tokens": 3000}
    results: list[httpx.Response] = []
    senders = [
        threading.Thread(target=lambda: results.append(_send(live, "/v1/chat/completions", body))) for _ in "abc"
    ]
    try:
        senders[0].start()
        _wait(live.loader.target.reached_gate.is_set)  # the first one runs (held at the gate)
        for t in senders[1:]:
            t.start()
        _wait(lambda: engine.queue_depth == 2)
        r = _send(live, "/v1/chat/completions", BODIES["/v1/chat/completions"])
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert _error("/v1/chat/completions", r)["code"] == "rate_limit_exceeded"
        r = _send(live, "/v1/responses", BODIES["/v1/responses"])
        assert r.status_code == 429 and _error("/v1/responses", r)["code"] == "rate_limit_exceeded"
        for path in ANTHROPIC:
            r = _send(live, path, BODIES[path])
            assert r.status_code == 529 and _error(path, r)["type"] == "overloaded_error"
    finally:
        live.loader.target.gate = None
        gate.set()
        for t in senders:
            t.join(30)
    assert [r.status_code for r in results] == [200, 200, 200]
    live.script(scripts.text)
    _works(live)


def test_count_tokens_runs_on_the_engine_thread_between_two_tokens(live: LiveServer) -> None:
    engine = live.app.state.ctx.engine
    tok = live.loader.tokenizer
    target = live.loader.target
    seen: list[tuple[str, int]] = []
    encode = tok.encode

    def spy(text: str, add_special_tokens: bool = True) -> list[int]:
        seen.append((threading.current_thread().name, target.emitted[-1] if target.emitted else -1))
        return encode(text, add_special_tokens=add_special_tokens)

    gate = _hold(live)
    stream_body = {**BODIES["/v1/messages"], "max_tokens": 3000, "stream": True}
    streamer = threading.Thread(target=lambda: _send(live, "/v1/messages", stream_body))
    counted: list[httpx.Response] = []
    counter = threading.Thread(
        target=lambda: counted.append(_send(live, "/v1/messages/count_tokens", BODIES["/v1/messages/count_tokens"]))
    )
    try:
        streamer.start()
        _wait(target.reached_gate.is_set)
        tok.encode = spy  # type: ignore[method-assign]
        counter.start()
        _wait(lambda: engine.queue_depth == 1)  # queued on the engine, not run on the event loop
        assert not seen
    finally:
        target.gate = None
        gate.set()
        counter.join(30)
        streamer.join(30)
        tok.encode = encode  # type: ignore[method-assign]
        live.script(scripts.text)
    assert counted[0].status_code == 200 and counted[0].json()["input_tokens"] > 0
    threads = {name for name, _ in seen}
    assert threads == {"mlx-dspark-engine"}
    assert seen[0][1] < 2000  # counted mid-generation: it did not wait for the 2000-token reply


@pytest.mark.parametrize("host", ["::", ":", "a:", "x:y:z", "[::1", "h:99999999999"])
def test_a_malformed_host_header_is_never_a_500(live: LiveServer, host: str) -> None:
    """Found by the fuzz tier: building the request URL from such a Host raised inside the error handler."""
    for path in ("/v1/chat/completions", "/v1/nope"):
        r = _send(live, path, BODIES["/v1/chat/completions"], host=host)
        assert r.status_code < 500, (host, r.text)


# ---- a caller's strings reach logs and errors bounded -----------------------------------------------------

FORGED = '\n{"event": "forged", "level": "error"}\x1b]0;pwned\x07'  # a new line, and a terminal's title


@pytest.fixture(scope="module")
def roomy() -> Iterator[LiveServer]:
    yield from make_server(max_body_bytes=8 << 20)  # a megabyte model name fits in the body


def _huge_fields(path: str) -> Iterator[tuple[str, dict[str, object], dict[str, str], int]]:
    """(what, body, headers, status) of requests whose fields are huge or hold control characters."""
    huge = FORGED + "m" * 1_000_000
    yield "model", {**BODIES[path], "model": huge}, {}, 404
    if "messages" in BODIES[path]:
        yield "role", {**BODIES[path], "messages": [{"role": FORGED + "r" * 100_000, "content": "hi"}]}, {}, 400
    else:
        yield "role", {**BODIES[path], "input": [{"role": FORGED + "r" * 100_000, "content": "hi"}]}, {}, 400
    if path == "/v1/chat/completions":
        choice = {"type": "function", "function": {"name": FORGED + "t" * 100_000}}
        yield "tool_choice", {**BODIES[path], "tools": [scripts.SHELL_TOOL_OPENAI], "tool_choice": choice}, {}, 400
    yield "host", BODIES[path], {"host": "evil" * 2000 + ".example"}, 400
    yield "origin", BODIES[path], {"origin": "http://" + "o" * 8000}, 403
    yield "content-type", BODIES[path], {"content-type": "text/" + "p" * 8000}, 415


@pytest.mark.parametrize("json_logs", [True, False], ids=["json", "console"])
def test_a_callers_huge_or_forged_fields_are_bounded_in_errors_and_logs(roomy: LiveServer, json_logs: bool) -> None:
    logs = capture_logs(json_logs=json_logs)
    try:
        for path in BODIES:
            for what, body, headers, status in _huge_fields(path):
                r = _send(roomy, path, body, **headers)
                assert r.status_code == status, (path, what, r.text[:300])
                message = str(_error(path, r)["message"])
                assert len(message) < 1000 and "characters" in message, (path, what, message[:300])
                assert "\x1b" not in message and "\x07" not in message and "\n" not in message
        text = logs.text
        assert "\x1b]0;pwned" not in text and "\x07" not in text and "forged" in text  # there, but escaped
        assert not [line for line in text.splitlines() if line.startswith('{"event": "forged"')]
        assert max(len(line) for line in text.splitlines()) < 5000
        if json_logs:
            lines = logs.requests()
            assert len(lines) == sum(len(list(_huge_fields(p))) for p in BODIES)  # each refusal has its line
            assert all(len(str(e.get("model"))) < 300 and len(str(e.get("error", ""))) < 300 for e in lines)
            assert any("1,000,0" in str(e["model"]) for e in lines)  # cut, saying how long it was
    finally:
        restore_logging()


def test_a_body_with_many_broken_items_gets_a_bounded_error(live: LiveServer) -> None:
    body = {**BODIES["/v1/chat/completions"], "messages": [{"role": 1}] * 5000}
    r = _send(live, "/v1/chat/completions", body)
    assert r.status_code == 400
    message = str(_error("/v1/chat/completions", r)["message"])
    assert "messages[0].role" in message and "more" in message and len(message) < 2000


# ---- the root needs the key -------------------------------------------------------------------------------


def test_the_root_needs_the_key_but_for_a_browser_login_and_a_bare_head(live: LiveServer) -> None:
    base, key = live.base_url + "/", live.api_key or ""
    for headers in ({}, {"accept": "*/*"}, {"accept": "application/json"}, {"x-api-key": "wrong"}):
        r = httpx.get(base, headers=headers)
        assert r.status_code == 401, headers
        assert _error("/", r)["type"] == "authentication_error"
    for headers in ({"authorization": f"Bearer {key}"}, {"x-api-key": key}):
        r = httpx.get(base, headers=headers)
        assert r.status_code == 200 and r.json()["status"] == "ok"
    page = httpx.get(base, headers={"accept": "text/html"})  # a browser gets the dashboard's login page
    assert page.status_code == 401 and "API key required" in page.text
    from mlx_dspark.entrypoints.http.web.auth import COOKIE

    page = httpx.get(base, headers={"accept": "text/html"}, cookies={COOKIE: key})
    assert page.status_code == 200 and 'data-page="chat"' in page.text
    # Claude Code's connectivity preflight: a HEAD with no key, which must not read as "endpoint down"
    head = httpx.head(base)
    assert head.status_code == 200 and head.content == b""


# ---- /metrics counts streamed answers -------------------------------------------------------------------


def _streams(live: LiveServer, outcome: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(live.base_url + "/metrics", headers={"authorization": f"Bearer {live.api_key}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families["mlx_dspark_http_streams"].samples if s.labels.get("outcome") == outcome)


def test_streamed_answers_are_counted_by_outcome_in_metrics(live: LiveServer) -> None:
    before = _streams(live, "completed")
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        r = _send(live, path, {**BODIES[path], "stream": True})
        assert r.status_code == 200 and r.text
        assert _send(live, path, BODIES[path]).status_code == 200  # a whole answer is not a stream
    assert _streams(live, "completed") == before + 3


def test_a_library_warning_is_logged_once(capsys: pytest.CaptureFixture[str]) -> None:
    """huggingface-hub prints through a stderr handler of its own and propagates too: every download retry was
    written twice, once unstructured. After the CLI's logging setup it is one structured line."""
    import logging

    import huggingface_hub.utils.logging  # noqa: F401 - installs its own handler

    from tests.integration.http.conftest import capture_logs, restore_logging

    logs = capture_logs()
    try:
        logging.getLogger("huggingface_hub.utils._http").warning("retrying in 1s [Retry 1/5]")
        assert logs.text.count("retrying in 1s") == 1
        assert "retrying in 1s" not in capsys.readouterr().err
        assert logging.getLogger("huggingface_hub").handlers == []
    finally:
        restore_logging()
