"""Every field of every dialect refuses a value of the wrong JSON type: a 400 in the dialect's envelope that
names the field, never a 5xx and never a silent 200 (a string read as an array of its characters, an array
read as an empty object).

The variants come from the wire types (wire_types.py): each field a well-formed body holds, nested ones
included, and each absent optional field, set to each JSON shape its type refuses. Hypothesis then does the
same on bodies drawn from the wire types (wire_strategies.py), one wrong field on top of whatever they hold.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_dspark.adapters.api.anthropic_messages import wire as anthropic_wire
from mlx_dspark.adapters.api.openai_chat import wire as chat_wire
from mlx_dspark.adapters.api.openai_responses import wire as responses_wire
from tests.fuzz.test_http_fuzz import check_answer, examples
from tests.fuzz.wire_strategies import MODEL, WireStrategies
from tests.fuzz.wire_types import WireTypes, variants, with_value, wrong_values
from tests.integration.http import scripts
from tests.integration.http.conftest import make_server

CHAT = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "Be brief.", "name": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ],
    "tools": [scripts.SHELL_TOOL_OPENAI],
    "stream": False,
    "stream_options": {"include_usage": True},
    "max_tokens": 8,
    "stop": ["zz"],
    "temperature": 0,
    "top_p": 1,
    "seed": 1,
    "chat_template_kwargs": {"enable_thinking": False},
}
RESPONSES = {
    "model": MODEL,
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thought"}]},
    ],
    "tools": [scripts.SHELL_TOOL_RESPONSES],
    "reasoning": {"effort": "low"},
    "max_output_tokens": 8,
    "temperature": 0,
    "include": [],
}
MESSAGES = {
    "model": MODEL,
    "max_tokens": 8,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "shell", "input": {"command": "ls"}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}]}],
        },
    ],
    "tools": [scripts.SHELL_TOOL_ANTHROPIC],
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "disabled"},
    "stop_sequences": ["zz"],
    "temperature": 0,
}
COUNT = {k: v for k, v in MESSAGES.items() if k in {f.name for f in attrs.fields(anthropic_wire.CountTokensRequest)}}

ROUTES: dict[str, tuple[dict[str, Any], type, WireTypes]] = {
    "/v1/chat/completions": (CHAT, chat_wire.ChatCompletionRequest, WireTypes(chat_wire)),
    "/v1/responses": (RESPONSES, responses_wire.ResponsesRequest, WireTypes(responses_wire)),
    "/v1/messages": (MESSAGES, anthropic_wire.MessagesRequest, WireTypes(anthropic_wire)),
    "/v1/messages/count_tokens": (COUNT, anthropic_wire.CountTokensRequest, WireTypes(anthropic_wire)),
}
CASES = [(path, name, body) for path, (base, cls, wire) in ROUTES.items() for name, body in variants(base, cls, wire)]


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    for server in make_server(context_window=4096):
        server.script(scripts.text)
        with httpx.Client(base_url=server.base_url, timeout=30) as c:
            yield c


def _post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def _refused(path: str, r: httpx.Response, field: str) -> None:
    check_answer(path, r, streamed=False)  # no 5xx, the dialect's envelope
    assert r.status_code == 400, (field, r.status_code, r.text[:300])
    body = r.json()
    message = body["error"]["message"]
    assert field in message, (field, message)


def test_the_variants_cover_every_kind_of_field() -> None:
    names = {name.split("=")[0] for _, name, _ in CASES}
    for where in ("stop_sequences", "stream_options", "reasoning", "tools", "tools.0", "messages.1.content.0.text"):
        assert any(n == where for n in names), where
    assert len(CASES) > 300


@pytest.mark.parametrize("path", list(ROUTES))
def test_each_base_body_is_answered(client: httpx.Client, path: str) -> None:
    r = _post(client, path, ROUTES[path][0])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("path", "name", "body"), CASES, ids=[f"{p}:{n}" for p, n, _ in CASES])
def test_a_field_of_the_wrong_json_type_is_a_400_naming_it(
    client: httpx.Client, path: str, name: str, body: dict[str, Any]
) -> None:
    where = name.split("=", maxsplit=1)[0].split(".")
    field = next(p for p in reversed(where) if not p.isdigit())
    _refused(path, _post(client, path, body), field)


def _drawn(path: str, data: st.DataObject) -> tuple[dict[str, Any], str, Any]:
    """A body drawn from the wire types, one of its class's fields and a value of the wrong type for it."""
    _, cls, wire = ROUTES[path]
    hints = wire.hints(cls)
    body = data.draw(WireStrategies(wire.module).of_class(cls), label="body")
    field = data.draw(
        st.sampled_from([f.name for f in attrs.fields(cls) if wrong_values(hints[f.name])]), label="field"
    )
    return body, field, data.draw(st.sampled_from(wrong_values(hints[field])), label="value")


@pytest.mark.parametrize("path", list(ROUTES))
@examples(100)
@given(data=st.data())
def test_a_drawn_body_with_one_wrong_typed_field_is_a_400(client: httpx.Client, path: str, data: st.DataObject) -> None:
    body, field, bad = _drawn(path, data)
    _refused(path, _post(client, path, with_value(body, (field,), bad)), field)
