"""The browser tier: headless Chromium from Debian's package, driven by Playwright (which downloads nothing).

The server runs the real default model with the dashboard over a temporary SQLite file and a local fake hub.
Screenshots of every page go to build/test-artifacts/browser/ (MLX_DSPARK_ARTIFACTS overrides the folder).
Without /usr/bin/chromium the tier is skipped, unless MLX_DSPARK_REQUIRE_BROWSER=1 (dev.sh sets it) makes
that a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import load_settings
from mlx_dspark.entrypoints.http.app import create_app
from tests.fakes.hub import FakeHub, serve
from tests.integration.http.conftest import _serve
from tests.integration.web.conftest import dashboard_flags, fake_hub

CHROMIUM = Path(os.environ.get("MLX_DSPARK_CHROMIUM", "/usr/bin/chromium"))
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(
    os.environ.get("MLX_DSPARK_ARTIFACTS") or Path(__file__).resolve().parents[2] / "build" / "test-artifacts"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/browser/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.browser)
            item.add_marker(pytest.mark.slow)


@attrs.define
class App:
    base_url: str
    hub: FakeHub
    engine: Any  # the server's EngineThread (tests hold it so requests start in one batch)


@pytest.fixture(scope="module")  # torn down after the browser tier, not at the end of the suite
def chromium() -> Iterator[Any]:
    if not CHROMIUM.exists():
        if os.environ.get("MLX_DSPARK_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{CHROMIUM} is missing: ./dev.sh installs Debian's chromium package")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium, or run ./dev.sh test)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")  # torn down after the browser tier, not at the end of the suite
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    tmp = tmp_path_factory.mktemp("browser")
    bootstrap.runtime().prepare()
    with serve(fake_hub()) as hub:
        flags = {"model": "default", "mode": "baseline", "max_draft": "4", **dashboard_flags(tmp, hub)}
        settings = load_settings(flags, environ={})
        services = bootstrap.build(settings)
        server = create_app(bootstrap.build_server(services, settings))
        for base, _ in _serve(server):
            yield App(base_url=base, hub=hub, engine=server.state.ctx.engine)


@pytest.fixture
def page(chromium: Any, app: App, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh page; console errors and uncaught exceptions fail the test."""
    context = chromium.new_context(viewport={"width": 1400, "height": 860}, base_url=app.base_url)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.set_default_timeout(600_000)  # generous: a shared CI core can be slow; nothing here is timed
    try:
        yield pg
        assert errors == [], f"browser errors: {errors}"
    finally:
        context.close()


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = ARTIFACTS / f"browser-{name}.png"
    page.screenshot(path=str(out), full_page=True)
    return out
