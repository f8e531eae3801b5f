"""Property-based fuzzing of the real server: generated requests for all three dialects, zero 5xx.

Bodies come from the wire types (wire_strategies.py); the server is the real app on a real socket, over the
scripted fake model through bootstrap, replying with text, tool calls, thinking or botched calls. Every
answer must be a 2xx or a 4xx in the dialect's envelope; a stream must end the dialect's way and never carry
a server error. Afterwards the engine still answers.

Examples are capped so the tier stays near two minutes on CI and runs the same examples every time; set
MLX_DSPARK_FUZZ_EXAMPLES (a multiplier, e.g. 10) and MLX_DSPARK_FUZZ_RANDOM=1 to search further locally.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_dspark.adapters.api.anthropic_messages import wire as anthropic_wire
from mlx_dspark.adapters.api.openai_chat import wire as chat_wire
from mlx_dspark.adapters.api.openai_responses import wire as responses_wire
from tests.fuzz.wire_strategies import MODEL, WireStrategies, junk, mostly
from tests.integration.http import scripts
from tests.integration.http.conftest import LiveServer, make_server

SCALE = float(os.environ.get("MLX_DSPARK_FUZZ_EXAMPLES", "1"))
FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=os.environ.get("MLX_DSPARK_FUZZ_RANDOM") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def examples(n: int) -> settings:
    return settings(FUZZ, max_examples=max(1, int(n * SCALE)))


RESPONDERS: list[Callable[[str], str]] = [
    scripts.text,
    scripts.tool,
    scripts.parallel,
    scripts.botched,
    scripts.thinking,
    scripts.stop_words,
    lambda prompt: "",
    lambda prompt: "<tool_call>\n{not json\n</tool_call>",
    lambda prompt: "<think>\nnever closed",
]

chat = WireStrategies(chat_wire)
responses = WireStrategies(responses_wire)
anthropic = WireStrategies(anthropic_wire)
TOOLS = {
    "/v1/chat/completions": scripts.SHELL_TOOL_OPENAI,
    "/v1/responses": scripts.SHELL_TOOL_RESPONSES,
    "/v1/messages": scripts.SHELL_TOOL_ANTHROPIC,
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    yield from make_server(context_window=4096, keepalive_s=0.5)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c


def _frames(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE frame (lines end at \\n only, as SSE says: not at U+0085 or U+2028)."""
    out = []
    for block in text.split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            out.append((event, "\n".join(data)))
    return out


def check_answer(path: str, r: httpx.Response, streamed: bool) -> None:
    """No 5xx; errors in the dialect's envelope; streams end as the dialect ends them, with no server error."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    anthropic_path = path.startswith("/v1/messages")
    if r.status_code != 200:
        body = r.json()
        if anthropic_path:
            assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], body
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
        return
    if not streamed or path.endswith("count_tokens"):
        r.json()
        return
    frames = _frames(r.text)
    assert frames, r.text[:300]
    if path == "/v1/chat/completions":
        assert frames[-1][1] == "[DONE]", frames[-3:]
        for _, data in frames[:-1]:
            chunk = json.loads(data)
            assert chunk.get("error", {}).get("type") != "server_error", chunk
    elif path == "/v1/responses":
        last = json.loads(frames[-1][1])
        assert last["type"] in ("response.completed", "response.failed", "response.incomplete"), last
        if last["type"] == "response.failed":
            assert last["response"]["error"]["code"] != "server_error", last
        seq = [json.loads(d)["sequence_number"] for _, d in frames]
        assert seq == list(range(len(seq)))
    else:
        names = [e for e, _ in frames]
        assert names[0] == "message_start" and names[-1] in ("message_stop", "error"), names
        if names[-1] == "error":
            assert json.loads(frames[-1][1])["error"]["type"] not in ("api_error",), frames[-1]


def _post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def _with_tools(path: str) -> st.SearchStrategy[Any]:
    """Mostly the scripted model's own shell tool, so tool-call replies parse against a real schema."""
    return mostly(st.one_of(st.just([TOOLS[path]]), st.none()), st.lists(junk, max_size=2))


def _run(server: LiveServer, client: httpx.Client, path: str, body: Any, responder: Callable[[str], str]) -> None:
    server.script(responder)
    r = _post(client, path, body)
    streamed = isinstance(body, dict) and body.get("stream") is True
    check_answer(path, r, streamed)


GENERATION_BODIES = {
    "/v1/chat/completions": chat.body(chat_wire.ChatCompletionRequest, tools=_with_tools("/v1/chat/completions")),
    "/v1/responses": responses.body(responses_wire.ResponsesRequest, tools=_with_tools("/v1/responses")),
    "/v1/messages": anthropic.body(anthropic_wire.MessagesRequest, tools=_with_tools("/v1/messages")),
}


@pytest.mark.parametrize("path", list(GENERATION_BODIES))
@examples(700)
@given(data=st.data(), responder=st.sampled_from(RESPONDERS))
def test_generation_routes(
    server: LiveServer, client: httpx.Client, path: str, data: st.DataObject, responder: Any
) -> None:
    """Each dialect's generation route, on bodies drawn from its wire types."""
    _run(server, client, path, data.draw(GENERATION_BODIES[path], label="body"), responder)


@examples(300)
@given(body=anthropic.body(anthropic_wire.CountTokensRequest))
def test_anthropic_count_tokens(server: LiveServer, client: httpx.Client, body: Any) -> None:
    _run(server, client, "/v1/messages/count_tokens", body, scripts.text)


PATHS = ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/completions"]
raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
    junk.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 3000).map(lambda n: b"[" * n),
    st.sampled_from(
        [
            b'{"model": "local-model", "messages": [{"role": "user", "content": "\\ud800"}]}',
            b'{"model": "local-model", "input": "\\udfff", "stream": true}',
            b'{"model": "local-model", "max_tokens": 1e400, "messages": []}',
            b'{"model": "local-model", "temperature": NaN, "messages": [{"role":"user","content":"x"}]}',
        ]
    ),
)


@examples(400)
@given(path=st.sampled_from(PATHS), raw=raw_bodies)
def test_raw_bytes(server: LiveServer, client: httpx.Client, path: str, raw: bytes) -> None:
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    check_answer(path, r, streamed=b'"stream": true' in raw)


header_values = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    st.sampled_from(["", "null", "http://127.0.0.1", "application/json", "localhost:1"]),
)


@examples(300)
@given(
    path=st.sampled_from([*PATHS, "/health", "/v1/models", "/"]),
    method=st.sampled_from(["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS"]),
    headers=st.dictionaries(
        st.sampled_from(["host", "origin", "content-type", "authorization", "x-api-key"]), header_values, max_size=4
    ),
)
def test_headers_and_methods(
    server: LiveServer, client: httpx.Client, path: str, method: str, headers: dict[str, str]
) -> None:
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    try:
        r = client.request(method, path, content=json.dumps(body).encode(), headers=headers)
    except httpx.LocalProtocolError:
        return  # httpx itself refuses the header value; nothing reached the server
    assert r.status_code < 500, (r.status_code, r.text[:300])


def test_the_engine_is_alive_after_the_fuzzing(server: LiveServer, client: httpx.Client) -> None:
    server.script(scripts.text)
    assert client.get("/health").json()["status"] == "ok"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    r = _post(client, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == scripts.text("")
