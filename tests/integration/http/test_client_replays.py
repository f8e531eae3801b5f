"""The real first-turn and tool-result requests of Claude Code, Codex and Pi (captured in ../shared), replayed.

Each must be accepted and answered with a stream its client's SDK accepts. The captures are read at test
time and never copied into the repository; the folder's absence skips this tier.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.http.conftest import LiveServer, make_server
from tests.integration.http.replay import agent, replay

FIXTURES = Path(__file__).resolve().parents[4] / "shared" / "fixtures" / "clients"


def _captures() -> list[Path]:
    if not FIXTURES.is_dir():
        return []
    out = []
    for path in sorted(FIXTURES.rglob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("method") == "POST" and isinstance(data.get("body"), dict):
            out.append(path)
    return out


CAPTURES = _captures()
pytestmark = pytest.mark.skipif(
    not CAPTURES, reason=f"client captures not found at {FIXTURES} (the shared/ folder is not checked out here)"
)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    for live in make_server(context_window=1_000_000):
        live.script(agent)
        yield live


@pytest.mark.parametrize(
    "capture", CAPTURES, ids=lambda p: str(p.relative_to(FIXTURES)) if FIXTURES in p.parents else str(p)
)
def test_capture_is_answered_with_a_stream_the_client_accepts(server: LiveServer, capture: Path) -> None:
    data = json.loads(capture.read_text())
    reason = replay(server.base_url, data["path"], data["body"])
    has_result = "tool-result" in capture.name or "request-2" in capture.name
    if has_result:
        assert reason in ("end_turn", "stop", "completed")
    elif "tool-roundtrip" in capture.name and "apply-patch" not in capture.name:
        assert reason in ("tool_use", "tool_calls")
