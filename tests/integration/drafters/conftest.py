"""Shared fixtures: tiny targets per family (built once per session) and a target-adapter factory."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.drafters import helpers


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def family_target(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, helpers.tiny_target(request.param, seed=1 if request.param == "llama" else 2)


@pytest.fixture(scope="session")
def qwen3_target() -> Any:
    return helpers.tiny_target("qwen3", seed=2)
