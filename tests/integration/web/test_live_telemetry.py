"""The live telemetry stream carries prefill progress, prefix-cache hits and the batch width, and /metrics
counts them: a long prompt and a cached second turn on the scripted model; two concurrent plain requests
on a batching engine over a tiny MLX model."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.decoder import PROGRESS_EVERY
from mlx_dspark.entrypoints.http.app import create_app
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.hub import serve
from tests.fakes.scripted import ScriptedLoader
from tests.integration.http.conftest import _serve
from tests.integration.web.conftest import WebServer, dashboard_flags, engine_held, fake_hub
from tests.integration.web.test_web_api import post_stream, sse

Event = dict[str, Any]


class Watch:
    """Reads the telemetry stream in a thread from now on until `until` holds for an event."""

    def __init__(self, base_url: str, until: Callable[[Event], bool]) -> None:
        self.events: list[Event] = []
        self._until = until
        self._open = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(base_url,), daemon=True)
        self._thread.start()
        assert self._open.wait(10)  # the hello frame: subscribed

    def _read(self, base_url: str) -> None:
        with httpx.stream("GET", base_url + "/ui/api/telemetry/stream?replay=0", timeout=60) as r:
            for event in sse(r):
                self._open.set()
                if event["type"] == "hello":
                    continue
                self.events.append(event)
                if self._until(event):
                    return

    def done(self) -> list[Event]:
        self._thread.join(60)
        assert not self._thread.is_alive(), "the awaited telemetry event never came"
        return self.events

    def of(self, kind: str, request_id: str | None = None) -> list[Event]:
        return [e for e in self.events if e["type"] == kind and request_id in (None, e.get("request_id"))]


def metrics(base_url: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(base_url + "/metrics").text)}


def sample(families: dict[str, Any], name: str, **labels: str) -> float:
    return sum(s.value for s in families[name].samples if all(s.labels.get(k) == v for k, v in labels.items()))


def chat(base_url: str, content: str, max_tokens: int) -> httpx.Response:
    body = {"model": "local-model", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_a_long_prompt_streams_its_prefill_progress(web: WebServer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 70  # one token per character: > 3000 tokens
    watch = Watch(web.base_url, lambda e: e["type"] == "finished" and e["prompt_tokens"] > 3000)
    usage = chat(web.base_url, prompt, 4).json()["usage"]
    watch.done()
    finished = watch.of("finished")[-1]
    rid, total = finished["request_id"], usage["prompt_tokens"]
    assert finished["prompt_tokens"] == total > 3 * PROGRESS_EVERY
    progress = [e for e in watch.of("prefill", rid) if not e["first_token"]]
    reused = progress[0]["reused"]
    # One event per 1024 prompt tokens past what was reused, the last one reporting the whole prompt.
    expected = [*range(reused + PROGRESS_EVERY, total, PROGRESS_EVERY), total]
    assert [e["done"] for e in progress] == expected
    assert all(e["total"] == total for e in progress)
    first = [e for e in watch.of("prefill", rid) if e["first_token"]]
    assert len(first) == 1 and first[0]["done"] == total
    (cache,) = watch.of("cache", rid)
    assert cache["prompt_tokens"] == total and cache["cached"] == reused and cache["prefill"] == total - reused
    # The events arrive in the order the request lived them.
    kinds = [e["type"] for e in watch.events if e.get("request_id") == rid]
    assert kinds.index("cache") < kinds.index("prefill") < kinds.index("finished")


def test_a_cached_second_turn_reports_its_hit_and_where_it_came_from(web: WebServer) -> None:
    sid = httpx.post(web.base_url + "/ui/api/sessions", json={"title": ""}).json()["id"]
    path = f"/ui/api/sessions/{sid}/chat"
    post_stream(web.base_url, path, {"content": "Tell me a story about a cat.", "options": {"max_tokens": 12}})
    before = metrics(web.base_url)
    watch = Watch(web.base_url, lambda e: e["type"] == "finished")
    events = post_stream(web.base_url, path, {"content": "And then?", "options": {"max_tokens": 12}})
    watch.done()
    stats = next(e for e in events if e["type"] == "done")["stats"]
    (cache,) = watch.of("cache")
    finished = watch.of("finished", cache["request_id"])[0]
    assert cache["cached"] > 0 and cache["cached"] == stats["cached_prompt_tokens"] == finished["cached_prompt_tokens"]
    assert cache["source"] in ("live", "memory") and finished["cache_source"] == cache["source"]
    assert cache["prefill"] == cache["prompt_tokens"] - cache["cached"] > 0  # only the new turn is prefilled
    after = metrics(web.base_url)
    name = "mlx_dspark_prefix_cache_lookups"
    assert sample(after, name, source=cache["source"]) == sample(before, name, source=cache["source"]) + 1
    assert sample(after, "mlx_dspark_cache_hits") == sample(before, "mlx_dspark_cache_hits") + 1


def test_a_first_request_is_a_miss_in_the_stream_and_in_metrics(web: WebServer) -> None:
    before = metrics(web.base_url)
    watch = Watch(web.base_url, lambda e: e["type"] == "finished")
    chat(web.base_url, "Zebra quartz vexing jumbo.", 4)
    watch.done()
    (cache,) = watch.of("cache")
    # The chat template's opening may still be live from the last request: only that much is reused.
    assert cache["prefill"] > 0 and cache["cached"] < cache["prompt_tokens"]
    source = cache["source"]
    assert (source == "none") == (cache["cached"] == 0)
    after = metrics(web.base_url)
    assert sample(after, "mlx_dspark_prefix_cache_lookups", source=source) == (
        sample(before, "mlx_dspark_prefix_cache_lookups", source=source) + 1
    )


# ---- batching: a tiny MLX model behind the real server ------------------------------------------------


class TinyMlxLoader(ScriptedLoader):
    """The ModelLoader port over a tiny float32 llama whose vocabulary is the fake tokenizer's (no drafters)."""

    def __init__(self) -> None:
        from mlx_dspark.adapters.mlx.target import MlxTargetModel
        from mlx_dspark.domain.model import LoadedModel
        from tests.fakes.tiny_models import tiny_model
        from tests.fakes.tokenizer import FakeTokenizer

        tokenizer = FakeTokenizer()
        model = tiny_model("llama", seed=0, vocab_size=tokenizer.vocab_size)
        self.model = LoadedModel(
            name="local-model",
            identity="tiny-llama",
            target=MlxTargetModel(model, prefill_chunk=16),
            tokenizer=tokenizer,
            context_window=4096,
            family="qwen3",
            handle=model,  # the mlx-lm module, as the HF loader hands it out
        )
        self.tokenizer = tokenizer
        self.loads = 0


def tiny_mlx_server(tmp: Path) -> Iterator[tuple[str, Any]]:
    """A batching server over the tiny MLX model: (base URL, engine)."""
    with serve(fake_hub()) as hub:
        flags = {"mode": "baseline", "max_batch": "4", **dashboard_flags(tmp, hub)}
        settings = load_settings(flags, environ={})
        services = bootstrap.build(
            settings,
            loader=TinyMlxLoader(),
            telemetry=RecordingTelemetrySink(),
            clock=FakeClock(),
            calibration=object(),
        )
        app = create_app(bootstrap.build_server(services, settings))
        for base, _ in _serve(app):
            yield base, app.state.ctx.engine


@pytest.fixture(scope="module")
def batching(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    yield from tiny_mlx_server(tmp_path_factory.mktemp("batching"))


def test_two_concurrent_requests_show_a_batch_of_two(batching: tuple[str, Any]) -> None:
    base, engine = batching
    before = metrics(base)
    finished: list[Event] = []

    def until(e: Event) -> bool:
        if e["type"] == "finished":
            finished.append(e)
        return len(finished) == 2

    watch = Watch(base, until)
    results: list[httpx.Response] = []
    prompts = ["Count the stars above.", "Name every river you know of, please."]
    threads = [threading.Thread(target=lambda p=p: results.append(chat(base, p, 12))) for p in prompts]
    with engine_held(engine) as release:
        for t in threads:
            t.start()
        release(2)
    for t in threads:
        t.join(120)
    watch.done()
    assert len(results) == 2
    widths = [e["width"] for e in watch.of("batch")]
    assert 2 in widths and max(widths) == 2
    rounds = watch.of("round")
    assert any(r["batch"] == 2 for r in rounds) and all(1 <= r["batch"] <= 2 for r in rounds)
    after = metrics(base)
    steps = sample(after, "mlx_dspark_batch_steps", width="2") - sample(before, "mlx_dspark_batch_steps", width="2")
    assert steps > 0 and sample(after, "mlx_dspark_batch_width_max") == 2


def test_the_gauge_and_metrics_answer_while_an_exclusive_job_holds_the_engine(tmp_path: Path) -> None:
    import mlx.core as mx

    from mlx_dspark.adapters.mlx.memory import MlxMachineProbe

    # A fresh server, so no gauge read came before the hold: the model's bytes were measured when it was served.
    for base, engine in tiny_mlx_server(tmp_path):
        expected = MlxMachineProbe().model_bytes(engine.generator.model.handle)
        with engine_held(engine):
            for _ in range(400):  # the hold is running (taken off the queue)
                if engine.queue_depth == 0:
                    break
                time.sleep(0.025)
            first = httpx.get(base + "/ui/api/status", timeout=10).json()
            ballast = mx.ones((16 << 20,), dtype=mx.float32)  # 64 MiB more in use, the engine still held
            mx.eval(ballast)
            second = httpx.get(base + "/ui/api/status", timeout=10).json()
            during = metrics(base)
            assert engine.queue_depth == 0  # the reads queued nothing for the engine
        del ballast
        assert expected > 0 and first["model_bytes"] == second["model_bytes"] == expected
        assert second["memory"]["active"] >= first["memory"]["active"] + (64 << 20)  # live, not frozen
        assert sample(during, "mlx_dspark_model_memory_bytes") == expected
        assert sample(during, "mlx_dspark_memory_bytes", kind="active") >= second["memory"]["active"]
        assert sample(during, "mlx_dspark_up") == 1.0
