"""An engine failure as a client sees it: the in-flight request ends with the dialect's own retryable error,
/health reports the restart and its cause, /metrics counts it, and the next request is served."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from mlx_dspark.application.engine import Engine
from tests.integration.http.conftest import LiveServer, make_server


@pytest.fixture
def crashing(monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    """A live server whose serving loop fails once, in the middle of the first generation request."""
    original = Engine.step
    failed = []

    def step(self: Engine) -> None:
        if not failed:
            failed.append(True)
            raise RuntimeError("injected serving-loop failure")
        original(self)

    monkeypatch.setattr(Engine, "step", step)
    yield from make_server()


def test_a_failure_is_a_retryable_dialect_error_and_health_and_metrics_show_it(crashing: LiveServer) -> None:
    base = crashing.base_url
    health = httpx.get(f"{base}/health", timeout=10).json()
    assert health["restarts"] == 0 and "last_restart" not in health
    body = {"model": "local-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{base}/v1/messages", json=body, timeout=30)
    assert r.status_code == 529, r.text  # Anthropic's overloaded: clients retry it
    error = r.json()
    assert error["type"] == "error" and "restarted" in error["error"]["message"]
    health = httpx.get(f"{base}/health", timeout=10).json()
    assert health["status"] == "ok" and health["restarts"] == 1
    assert "injected serving-loop failure" in health["last_restart"]["cause"]
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert "mlx_dspark_engine_restarts_total 1.0" in metrics
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)  # served again
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
