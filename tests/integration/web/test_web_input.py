"""Malformed dashboard requests are a 4xx that names the field, never a 500, and a refused turn saves nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.integration.web.conftest import WebServer


def _post(url: str, body: Any) -> httpx.Response:
    """POST `body` as Python's json writes it: inf and nan as `Infinity` and `NaN`, which its parser accepts."""
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30)


def _session(web: WebServer) -> str:
    sid: str = httpx.post(web.base_url + "/ui/api/sessions", json={}).json()["id"]
    return sid


def _messages(web: WebServer, sid: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = httpx.get(f"{web.base_url}/ui/api/sessions/{sid}").json()["messages"]
    return messages


@pytest.mark.parametrize("settings", ["abc", [1, 2], 3, True])
def test_session_settings_that_are_not_an_object_are_a_400(web: WebServer, settings: Any) -> None:
    r = httpx.post(web.base_url + "/ui/api/sessions", json={"settings": settings})
    assert r.status_code == 400, r.text
    assert r.json()["param"] == "settings" and "object" in r.json()["error"]


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"max_tokens": float("inf")}, "max_tokens"),  # JSON `Infinity`, which Python's json reads as a float
        ({"seed": float("inf")}, "seed"),
        ({"max_tokens": float("nan")}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": [3]}, "max_tokens"),
        ({"top_k": "many"}, "top_k"),
        ({"top_k": 10**12}, "top_k"),
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"stop": 5}, "stop"),
        ({"stop": ["x", 1]}, "stop"),
        ({"mode": "bogus"}, "mode"),
        ({"mode": 3}, "mode"),
        ({"system": ["a"]}, "system"),
        ([1], "options"),
        ("abc", "options"),
    ],
)
def test_bad_chat_options_are_a_400_naming_the_field_and_save_nothing(web: WebServer, options: Any, param: str) -> None:
    sid = _session(web)
    r = _post(f"{web.base_url}/ui/api/sessions/{sid}/chat", {"content": "hi", "options": options})
    assert r.status_code == 400, r.text
    assert r.json()["param"] == param and param in r.json()["error"]
    assert _messages(web, sid) == []  # validated before the user's message is saved


def test_chat_content_must_be_text(web: WebServer) -> None:
    sid = _session(web)
    r = httpx.post(f"{web.base_url}/ui/api/sessions/{sid}/chat", json={"content": ["hi"]})
    assert r.status_code == 400 and r.json()["param"] == "content"
    assert _messages(web, sid) == []


@pytest.mark.parametrize("title", ["t" * 100_000, "t" * 201, 5, ["a"]])
def test_a_session_title_is_bounded_text(web: WebServer, title: Any) -> None:
    r = httpx.post(web.base_url + "/ui/api/sessions", json={"title": title})
    assert r.status_code == 400 and r.json()["param"] == "title", r.text
    assert len(r.text) < 1000  # the refusal does not echo the title back whole
    sid = _session(web)
    r = httpx.patch(f"{web.base_url}/ui/api/sessions/{sid}", json={"title": title})
    assert r.status_code == 400 and r.json()["param"] == "title", r.text
    assert httpx.get(f"{web.base_url}/ui/api/sessions/{sid}").json()["title"] == "New chat"


def test_a_title_at_the_bound_is_kept_whole(web: WebServer) -> None:
    title = "t" * 200
    sid = httpx.post(web.base_url + "/ui/api/sessions", json={"title": title}).json()["id"]
    assert httpx.get(f"{web.base_url}/ui/api/sessions/{sid}").json()["title"] == title


@pytest.mark.parametrize("bandwidth_mib", [10**9, 4097, 0])
def test_the_roofline_copy_size_is_bounded(web: WebServer, bandwidth_mib: int) -> None:
    r = httpx.post(web.base_url + "/ui/api/roofline", json={"modes": ["lookup"], "bandwidth_mib": bandwidth_mib})
    assert r.status_code == 400 and r.json()["param"] == "bandwidth_mib", r.text


@pytest.mark.parametrize("last_id", ["9" * 5000, "1" * 30, "-1", "x"])
def test_a_huge_or_odd_last_event_id_is_answered_not_a_500(web: WebServer, last_id: str) -> None:
    headers = {"Last-Event-ID": last_id}
    with httpx.stream("GET", web.base_url + "/ui/api/telemetry/stream?replay=0", headers=headers, timeout=30) as r:
        assert r.status_code in (200, 400), r.read()
        if r.status_code == 200:
            assert any(line.startswith("data: ") for line in r.iter_lines())
        else:
            assert "Last-Event-ID" in r.read().decode()
