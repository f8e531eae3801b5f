"""Admission by size over HTTP: a body over the limit is refused before it is read, and a prompt whose size alone
proves it cannot fit is refused before anything renders or tokenizes it (in the dialect's own words)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from mlx_dspark.application.settings import DEFAULT_MAX_BODY_BYTES
from tests.fakes.tokenizer import FakeTokenizer
from tests.integration.http.conftest import LiveServer, make_server


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    yield from make_server(context_window=4096)  # the default body limit


@pytest.fixture
def encoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of every text the tokenizer encodes while the test runs."""
    seen: list[int] = []
    original = FakeTokenizer.encode

    def encode(self: FakeTokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
        seen.append(len(text))
        return original(self, text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(FakeTokenizer, "encode", encode)
    return seen


def _post(server: LiveServer, path: str, body: dict[str, object]) -> httpx.Response:
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    return httpx.post(server.base_url + path, content=json.dumps(body).encode(), timeout=60, headers=headers)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_prompt_too_big_to_fit_is_refused_before_it_is_tokenized(
    server: LiveServer, encoded: list[int], path: str
) -> None:
    huge = {"model": "local-model", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 5_000_000}]}
    r = _post(server, path, huge)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "192307 tokens" in message  # the proven floor, in the dialect's wording that clients parse
    assert not encoded or max(encoded) < 1_000_000
    many = {"model": "local-model", "max_tokens": 4, "messages": [{"role": "user", "content": "0123456789"}] * 150_000}
    r = _post(server, path, many)
    assert r.status_code == 400 and "150000 tokens" in r.json()["error"]["message"]
    assert sum(encoded) < 1_000_000  # neither was rendered and tokenized
    ok = _post(server, path, {"model": "local-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200


def test_a_body_over_the_default_limit_is_413_in_the_dialect(server: LiveServer) -> None:
    text = "x" * DEFAULT_MAX_BODY_BYTES
    body = {"model": "local-model", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    r = _post(server, "/v1/messages", body)
    assert r.status_code == 413 and r.json()["type"] == "error"
