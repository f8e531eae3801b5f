"""A real dashboard server on 127.0.0.1 over the scripted fake model (lookup drafts allowed), a fake hub and
a temporary SQLite file; shared by the dashboard API tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.ports import DraftSource
from mlx_dspark.entrypoints.http.app import create_app
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.configs import LLAMA8B
from tests.fakes.hub import FakeHub, FakeRepo, safetensors_bytes, serve
from tests.fakes.scripted import ScriptedLoader
from tests.integration.http.conftest import _serve

REPLY = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat."


def llama8b_tensors() -> dict[str, tuple[str, list[int]]]:
    t: dict[str, tuple[str, list[int]]] = {
        "embed": ("BF16", [128256, 4096]),
        "lm_head": ("BF16", [128256, 4096]),
    }
    for i in range(32):
        t[f"l{i}.attn"] = ("BF16", [4096, 6144])  # q, k, v, o = 4096×(4096+1024+1024) + 4096×4096
        t[f"l{i}.o"] = ("BF16", [4096, 4096])
        t[f"l{i}.mlp"] = ("BF16", [3, 4096, 14336])
    return t


class DraftingLoader(ScriptedLoader):
    """The scripted model with n-gram lookup drafts, so races and telemetry have speculative rounds."""

    def load_drafter(self, kind: str, spec: str | None, model: object, *, bits: int | None) -> DraftSource:
        if kind == "lookup":
            return LookupDraftSource(block=4)
        return super().load_drafter(kind, spec, model, bits=bits)  # type: ignore[arg-type]

    def available_drafters(self, model: object) -> Sequence[str]:
        return ["lookup"]


def fit_weight_bytes() -> int:
    from mlx_dspark.domain.fit import weight_bytes

    return weight_bytes(llama8b_tensors())


@attrs.define
class WebServer:
    base_url: str
    hub: FakeHub
    recorder: RecordingTelemetrySink
    db: Path
    hf_cache: Path
    api_key: str | None


def fake_hub() -> FakeHub:
    hub = FakeHub()
    hub.add(
        FakeRepo(
            repo_id="fake-org/llama-8b-shaped",
            files={
                "config.json": json.dumps(LLAMA8B).encode(),
                "model.safetensors": safetensors_bytes(llama8b_tensors(), with_data=False),
            },
            listed_sizes={"model.safetensors": fit_weight_bytes()},
        )
    )
    return hub


def dashboard_flags(tmp: Path, hub: FakeHub) -> dict[str, str]:
    """Settings that keep the dashboard's sessions, caches and hub inside `tmp` and the fake hub."""
    return {
        "cache_dir": str(tmp / "cache"),
        "session_db": str(tmp / "sessions.sqlite3"),
        "hub_endpoint": hub.url,
        "hub_cache_dir": str(tmp / "hf"),
        "lm_studio_dirs": str(tmp / "lm-studio"),  # absent: no LM Studio models
    }


@contextlib.contextmanager
def engine_held(engine: Any) -> Iterator[Callable[[int], None]]:
    """Hold `engine` with an exclusive job that waits; the yielded `release(n)` lets it go once `n` jobs wait
    behind it, so they start together (in one batch, on a batching engine). The status gauge and /metrics
    queue nothing for the engine, so they can be read while it is held."""
    gate = threading.Event()

    def hold(_: Any) -> Iterator[None]:
        gate.wait(120)
        yield None

    loop = asyncio.new_event_loop()  # never run: the hold's one item is not read

    def release(waiting: int) -> None:
        for _ in range(4800):
            if engine.queue_depth >= waiting:
                break
            time.sleep(0.025)
        assert engine.queue_depth >= waiting, f"{engine.queue_depth} jobs wait, not {waiting}"
        gate.set()

    try:
        engine.submit(hold, loop, exclusive=True)
        yield release
    finally:
        gate.set()
        loop.close()


def make_web_server(
    tmp: Path, *, api_key: str | None = None, hub: FakeHub | None = None, reply: str = REPLY
) -> Iterator[WebServer]:
    hub = hub or fake_hub()
    with serve(hub):
        loader = DraftingLoader(lambda _prompt: reply, name="local-model", context_window=1 << 16)
        hf_cache = tmp / "hf"
        flags = {"mode": "baseline", "max_draft": "4", "api_key": api_key, **dashboard_flags(tmp, hub)}
        settings = load_settings({k: v for k, v in flags.items() if v is not None}, environ={})
        recorder = RecordingTelemetrySink()
        services = bootstrap.build(settings, loader=loader, telemetry=recorder, clock=FakeClock(), calibration=object())
        app = create_app(bootstrap.build_server(services, settings))
        for base, _ in _serve(app):
            yield WebServer(base, hub, recorder, tmp / "sessions.sqlite3", hf_cache, api_key)


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebServer]:
    yield from make_web_server(tmp_path_factory.mktemp("web"))
