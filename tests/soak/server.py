"""The soak tier's server side: a real server over the tiny MLX model, a failure injected into its serving loop,
its log lines and scheduler ticks as it writes them, and the process's memory and threads."""

from __future__ import annotations

import gc
import io
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import TelemetrySettings, load_settings
from mlx_dspark.domain.events import BatchStepped, TelemetryEvent
from mlx_dspark.entrypoints.http.app import create_app
from mlx_dspark.entrypoints.log_config import configure_logging
from tests.integration.http.conftest import _serve
from tests.soak.loader import NAME, TinyMlxLoader

ENGINE_THREADS = "mlx-dspark-"  # the engine's thread, and any per-row thread a scheduler may start
# The CPU kernels' worker pool: one per process, as many workers as cores, started by the first long prefill of any
# server or test in the process; it belongs to no engine and no request.
KERNEL_POOL = "mlx-dspark-attention"


def _serving_step() -> tuple[type, str]:
    """The serving loop's one step of decoding: the step engine's `step`, or the batch scheduler's `_tick`."""
    try:
        from mlx_dspark.application.engine.step import Engine  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        from mlx_dspark.application.batching import BatchScheduler  # type: ignore[import-not-found,unused-ignore]

        return BatchScheduler, "_tick"
    return Engine, "step"


class Bomb:
    """Makes one step of the serving loop raise while armed: the `at`-th armed step with two or more rows (again
    after `rearm`).

    Attributes:
        fired: how many steps it failed.
        fired_at: the monotonic time it last did.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int) -> None:
        self.at = at
        self.armed = False
        self.steps = 0
        self.fired = 0
        self.fired_at: float | None = None
        owner, name = _serving_step()
        original = getattr(owner, name)

        def step(engine: Any) -> Any:
            if self.armed and engine.active >= 2:
                self.steps += 1
                if self.steps == self.at:
                    self.fired += 1
                    self.fired_at = time.monotonic()
                    raise RuntimeError(f"injected failure at step {self.steps}")
            return original(engine)

        monkeypatch.setattr(owner, name, step)

    def rearm(self) -> None:
        """Fail the `at`-th armed step from now too."""
        self.steps = 0


class TickSink:
    """Telemetry that keeps only the scheduler's ticks, as (rows decoding, rows prefilling), in order."""

    def __init__(self) -> None:
        self.ticks: list[tuple[int, int]] = []

    def emit(self, request_id: str, event: TelemetryEvent) -> None:
        if isinstance(event, BatchStepped) and event.width + event.prefilling > 0:
            self.ticks.append((event.width, event.prefilling))

    def longest_prefill_beside_decoding(self) -> int:
        """The longest run of consecutive ticks in which a row prefilled a chunk while others decoded."""
        best = run = 0
        for width, prefilling in self.ticks:
            run = run + 1 if width >= 1 and prefilling >= 1 else 0
            best = max(best, run)
        return best


class ServerLog:
    """The production log format (JSON lines, info level, no locals in tracebacks), written into a buffer."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()
        configure_logging(TelemetrySettings(log_level="info", json_logs=True))
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=self.buffer))
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(self.buffer)

    def close(self) -> None:
        structlog.reset_defaults()
        logging.getLogger().handlers = []

    def requests(self) -> list[dict[str, Any]]:
        """Every canonical `request.finished` line."""
        out = []
        for line in self.buffer.getvalue().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("event") == "request.finished":
                out.append(entry)
        return out


def serve(
    mode: str, root: Path, sink: TickSink, *, prefix_cache_bytes: int, max_batch: int, max_draft: str = "auto"
) -> Iterator[str]:
    """A live server in `mode` over the tiny model (its base URL), shut down when the iteration ends."""
    settings = load_settings(
        {
            "mode": mode,
            "model": NAME,
            "cache_dir": str(root),  # this mode's calibration, measured once on this machine
            "prefix_cache_bytes": str(prefix_cache_bytes),
            "keepalive_s": 0.25,  # streams queued behind others start early and send keep-alives
            "max_batch": max_batch,
            "max_draft": max_draft,
        },
        environ={},
    )
    services = bootstrap.build(settings, loader=TinyMlxLoader(), telemetry=sink)
    for base, _ in _serve(create_app(bootstrap.build_server(services, settings))):
        yield base


def rss_bytes() -> int:
    """This process's resident memory (the server runs in it), after a garbage collection."""
    gc.collect()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def engine_threads(since: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """The names of the engine's live threads, sorted, leaving out those in `since` (threads that were running
    before the server under test started: other tests' engines share the process when the whole suite runs)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith(ENGINE_THREADS) and not t.name.startswith(KERNEL_POOL) and t.is_alive() and t not in since
    )


def drained(
    base: str, threads: list[str], timeout: float = 60.0, since: frozenset[threading.Thread] = frozenset()
) -> dict[str, Any]:
    """The engine's status once nothing waits and only `threads` of the engine's are left, or as it is after
    `timeout` seconds (a server that never drains fails the caller's checks on it)."""
    deadline = time.monotonic() + timeout
    while True:
        status: dict[str, Any] = httpx.get(f"{base}/ui/api/status", timeout=10).json()
        if (status["queue_depth"] == 0 and engine_threads(since) == threads) or time.monotonic() > deadline:
            return status
        time.sleep(0.05)
