"""Cached prompt tokens in every dialect's usage, through the real server: a conversation's second turn
reports its reused prefix, also after a short side request in between (the conversation keeps its entry)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.http.conftest import LiveServer

SYSTEM = "You are a meticulous assistant who answers in full sentences. " * 6


def post(live: LiveServer, path: str, body: dict) -> dict:
    hdrs = {"authorization": f"Bearer {live.api_key}", "content-type": "application/json"}
    r = httpx.post(live.base_url + path, content=json.dumps(body).encode(), headers=hdrs, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def chat(live, messages):
    body = post(live, "/v1/chat/completions", {"model": "local-model", "messages": messages, "max_tokens": 8})
    usage = body["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return body["choices"][0]["message"]["content"], usage["prompt_tokens"], cached


def anthropic(live, messages):
    body = post(live, "/v1/messages", {"model": "local-model", "system": SYSTEM, "messages": messages, "max_tokens": 8})
    usage = body["usage"]
    text = "".join(b.get("text", "") for b in body["content"])
    return text, usage["input_tokens"] + usage["cache_read_input_tokens"], usage["cache_read_input_tokens"]


def responses(live, messages):
    body = post(live, "/v1/responses", {"model": "local-model", "instructions": SYSTEM, "input": messages,
                                        "max_output_tokens": 8})
    usage = body["usage"]
    text = "".join(c.get("text", "") for item in body["output"] for c in item.get("content", []) or [])
    return text, usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("dialect", [chat, anthropic, responses])
def test_the_second_turn_reports_cached_tokens_even_after_a_side_request(live: LiveServer, dialect) -> None:
    system = [{"role": "system", "content": SYSTEM}] if dialect is chat else []
    turn1 = [*system, {"role": "user", "content": f"Tell me about {dialect.__name__} caching."}]
    reply, prompt1, _ = dialect(live, turn1)
    # A side request between the turns (a title request, say) with a different prompt.
    chat(live, [{"role": "user", "content": "Title: xyz"}])
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    _, prompt2, cached2 = dialect(live, turn2)
    assert prompt2 > prompt1
    # All of turn 1's prompt but its generation prompt (re-rendered: no empty think block in the history).
    assert cached2 >= prompt1 - 32, (prompt1, cached2)
    assert cached2 < prompt2
