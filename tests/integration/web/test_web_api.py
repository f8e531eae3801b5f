"""The dashboard's HTTP API on a real server over the scripted model: sessions, chat, race, telemetry, metrics."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_dspark.domain.events import RoundFinished
from tests.integration.web.conftest import REPLY, WebServer, make_web_server


def sse(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[6:])


def post_stream(base: str, path: str, body: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    with httpx.stream("POST", base + path, json=body, timeout=60, **kw) as r:
        assert r.status_code == 200, r.read()
        return list(sse(r))


def test_pages_render_with_the_header_gauge(web: WebServer) -> None:
    for page in ("chat", "models", "telemetry", "roofline", "race"):
        r = httpx.get(f"{web.base_url}/ui/{page}")
        assert r.status_code == 200 and 'id="gauge"' in r.text and f'data-page="{page}"' in r.text
    assert 'data-page="chat"' in httpx.get(f"{web.base_url}/ui").text
    assert httpx.get(f"{web.base_url}/ui/nope").status_code == 404
    home = httpx.get(web.base_url + "/", headers={"Accept": "text/html"})
    assert 'data-page="chat"' in home.text
    # SDKs probing the base URL still get JSON
    assert httpx.get(web.base_url + "/").json()["status"] == "ok"
    assert httpx.get(web.base_url + "/static/vendor/chart.js-4.6.1/chart.umd.min.js").status_code == 200


def test_a_chat_turn_streams_and_both_messages_are_saved(web: WebServer) -> None:
    session = httpx.post(web.base_url + "/ui/api/sessions", json={"title": ""}).json()
    options = {"max_tokens": 40, "mode": "lookup", "system": "Be brief."}
    events = post_stream(
        web.base_url, f"/ui/api/sessions/{session['id']}/chat", {"content": "Say it.", "options": options}
    )
    text = "".join(e["text"] for e in events if e["type"] == "text")
    assert text and REPLY.startswith(text)
    done = [e for e in events if e["type"] == "done"]
    assert len(done) == 1
    stats = done[0]["stats"]
    assert stats["mode"] == "lookup" and stats["completion_tokens"] > 0 and stats["rounds"] > 0
    assert stats["mean_accepted"] > 1.0  # the repeated sentence is drafted by lookup and accepted
    saved = httpx.get(f"{web.base_url}/ui/api/sessions/{session['id']}").json()
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert saved["messages"][1]["content"] == text and saved["messages"][1]["stats"]["mode"] == "lookup"
    assert saved["title"] == "Say it." and saved["settings"]["system"] == "Be brief."
    # a second turn sees the history and reuses the cached prompt prefix
    events = post_stream(
        web.base_url, f"/ui/api/sessions/{session['id']}/chat", {"content": "Again.", "options": options}
    )
    assert next(e for e in events if e["type"] == "done")["stats"]["cached_prompt_tokens"] > 0


def test_sessions_are_listed_renamed_exported_and_deleted(web: WebServer) -> None:
    sid = httpx.post(web.base_url + "/ui/api/sessions", json={"title": "Draft"}).json()["id"]
    post_stream(web.base_url, f"/ui/api/sessions/{sid}/chat", {"content": "Hello there", "options": {"max_tokens": 8}})
    assert httpx.patch(f"{web.base_url}/ui/api/sessions/{sid}", json={"title": "Renamed"}).status_code == 200
    listed = {s["id"]: s for s in httpx.get(web.base_url + "/ui/api/sessions").json()}
    assert listed[sid]["title"] == "Renamed" and listed[sid]["messages"] == 2
    md = httpx.get(f"{web.base_url}/ui/api/sessions/{sid}/export?format=md")
    assert md.headers["content-type"].startswith("text/markdown")
    assert md.text.startswith("# Renamed") and "## User" in md.text and "Hello there" in md.text
    exported = httpx.get(f"{web.base_url}/ui/api/sessions/{sid}/export?format=json").json()
    assert exported["session"]["title"] == "Renamed" and len(exported["messages"]) == 2
    assert httpx.delete(f"{web.base_url}/ui/api/sessions/{sid}").status_code == 200
    assert httpx.get(f"{web.base_url}/ui/api/sessions/{sid}").status_code == 404
    assert httpx.delete(f"{web.base_url}/ui/api/sessions/{sid}").status_code == 404


def test_bad_chat_input_is_a_clear_400(web: WebServer) -> None:
    sid = httpx.post(web.base_url + "/ui/api/sessions", json={}).json()["id"]
    r = httpx.post(f"{web.base_url}/ui/api/sessions/{sid}/chat", json={"content": "hi", "options": {"temperature": -1}})
    assert r.status_code == 400 and "temperature" in r.json()["error"]
    r = httpx.post(f"{web.base_url}/ui/api/sessions/{sid}/chat", json={"content": "  "})
    assert r.status_code == 400 and "empty" in r.json()["error"]
    assert httpx.post(f"{web.base_url}/ui/api/sessions/nope/chat", json={"content": "x"}).status_code == 404


def test_race_checks_token_ids_and_reports_identical(web: WebServer) -> None:
    events = post_stream(web.base_url, "/ui/api/race", {"prompt": "Go.", "modes": ["lookup"], "max_tokens": 30})
    lanes = {e["mode"] for e in events if e["type"] == "text"}
    assert lanes == {"baseline", "lookup"}
    done = {e["mode"]: e for e in events if e["type"] == "lane_done"}
    assert done["lookup"]["accepted"] > 0 and done["baseline"]["drafted"] == 0
    verdict = events[-1]
    assert verdict["type"] == "verdict" and verdict["identical"] is True
    (lane,) = verdict["lanes"]
    # The scripted target has no batched rows: the lanes ran one after another, and the stream said why.
    assert events[0] == {"type": "layout", "side_by_side": False,
                         "reason": "the target's caches have no batched form for speculative decoding",
                         "text": "lanes run one after another: the target's caches have no batched form for "
                                 "speculative decoding"}  # fmt: skip
    # The speedup is the ratio of the lanes' solo medians, two runs each by default.
    timing = {e["mode"]: e for e in events if e["type"] == "timing"}
    assert [len(t["samples"]) for t in timing.values()] == [2, 2]
    speedup = timing["lookup"]["median"] / timing["baseline"]["median"]
    assert lane["speedup"] == speedup and lane["summary"].startswith(f"lookup {speedup:.2f}x plain, identical")
    assert {k: lane[k] for k in ("identical", "divergence", "expected", "got", "context")} == {
        "identical": True, "divergence": None, "expected": None, "got": None, "context": ""}  # fmt: skip
    assert all(d["seconds"] > 0 for d in done.values())
    events = post_stream(
        web.base_url, "/ui/api/race", {"prompt": "Go.", "modes": ["lookup"], "max_tokens": 6, "repeats": 3}
    )
    assert [len(e["samples"]) for e in events if e["type"] == "timing"] == [3, 3]


def test_race_refuses_an_unavailable_mode_in_the_stream(web: WebServer) -> None:
    events = post_stream(web.base_url, "/ui/api/race", {"prompt": "Go.", "modes": ["dflash"], "max_tokens": 4})
    assert events[-1]["type"] == "error" and "dflash" in events[-1]["message"]


@pytest.mark.parametrize("path", ["/ui/api/race", "/ui/api/roofline"])
@pytest.mark.parametrize(
    "bad",
    [{"max_tokens": "many"}, {"max_tokens": 0}, {"max_tokens": True}, {"modes": 3}, {"modes": [1]}, {"repeats": 6}],
)
def test_race_and_roofline_refuse_malformed_fields_with_a_400(web: WebServer, path: str, bad: dict[str, Any]) -> None:
    r = httpx.post(web.base_url + path, json={"prompt": "Go.", "modes": ["lookup"], **bad}, timeout=30)
    assert r.status_code == 400 and "must be" in r.json()["error"]


def test_telemetry_stream_carries_rounds_of_a_request(web: WebServer) -> None:
    got: list[dict[str, Any]] = []
    ready = threading.Event()

    def listen() -> None:
        with httpx.stream("GET", web.base_url + "/ui/api/telemetry/stream?replay=0", timeout=30) as r:
            for event in sse(r):
                got.append(event)
                ready.set()
                if event["type"] == "finished":
                    return

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    assert ready.wait(10)  # the hello frame
    post_stream(web.base_url, "/ui/api/race", {"prompt": "Telemetry.", "modes": ["lookup"], "max_tokens": 12})
    thread.join(30)
    kinds = [e["type"] for e in got]
    assert kinds[0] == "hello" and "request" in kinds and "prefill" in kinds and "finished" in kinds
    rounds = [e for e in got if e["type"] == "round"]
    assert rounds and all({"drafted", "accepted", "cap", "source", "positions", "batch"} <= set(r) for r in rounds)
    assert all(len(r["positions"]) <= r["drafted"] and sum(r["positions"]) == r["accepted"] for r in rounds)
    # the wrapped sink (structlog in production) still received every event
    assert any(isinstance(e, RoundFinished) for _, e in web.recorder.events)


def test_metrics_parse_as_prometheus_text_and_count_requests(web: WebServer) -> None:
    def families() -> dict[str, Any]:
        text = httpx.get(web.base_url + "/metrics").text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def value(fams: dict[str, Any], name: str, **labels: str) -> float:
        return sum(s.value for s in fams[name].samples if all(s.labels.get(k) == v for k, v in labels.items()))

    # The exposition format's own content type, its charset once (it was repeated).
    assert httpx.get(web.base_url + "/metrics").headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    before = families()
    # One timing run: the lanes run one after another here, so each lane's race run is its only request.
    post_stream(
        web.base_url, "/ui/api/race", {"prompt": "Metrics.", "modes": ["lookup"], "max_tokens": 30, "repeats": 1}
    )
    after = families()
    assert value(after, "mlx_dspark_requests") - value(before, "mlx_dspark_requests") == 2  # two lanes
    assert value(after, "mlx_dspark_generated_tokens") - value(before, "mlx_dspark_generated_tokens") == 60
    assert value(after, "mlx_dspark_accepted_tokens") > value(before, "mlx_dspark_accepted_tokens")
    assert value(after, "mlx_dspark_cache_hits") > value(
        before, "mlx_dspark_cache_hits"
    )  # lane 2 reuses lane 1's prompt
    for name in ("mlx_dspark_queue_depth", "mlx_dspark_memory_bytes", "mlx_dspark_acceptance_ratio", "mlx_dspark_up"):
        assert name in after
    assert value(after, "mlx_dspark_up") == 1.0
    assert 0 < value(after, "mlx_dspark_acceptance_ratio") <= 1
    # Histograms of time to first token, request latency and tokens per round (two lanes, every round counted).
    for name in ("mlx_dspark_ttft_seconds", "mlx_dspark_request_seconds", "mlx_dspark_tokens_per_round"):
        fam = after[name]
        assert fam.type == "histogram"
        buckets = [s.value for s in fam.samples if s.name == name + "_bucket"]
        count = next(s.value for s in fam.samples if s.name == name + "_count")
        assert buckets == sorted(buckets) and buckets[-1] == count  # cumulative, +Inf holds them all

    def observed(fams: dict[str, Any], name: str) -> float:
        return next(s.value for s in fams[name].samples if s.name == name + "_count")

    names = ("mlx_dspark_ttft_seconds", "mlx_dspark_request_seconds", "mlx_dspark_tokens_per_round")
    counts = [observed(after, n) - observed(before, n) for n in names]
    assert counts == [2, 2, value(after, "mlx_dspark_rounds") - value(before, "mlx_dspark_rounds")]


def test_status_reports_the_gauge_numbers(web: WebServer) -> None:
    s = httpx.get(web.base_url + "/ui/api/status").json()
    assert s["ready"] and s["model"] == "local-model" and s["mode"] == "baseline"
    assert s["queue_depth"] == 0 and "active" in s["memory"] and s["drafters"] == ["lookup"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebServer]:
    yield from make_web_server(tmp_path_factory.mktemp("keyed"), api_key="sekrit")


def test_the_api_key_guards_pages_api_and_metrics(keyed: WebServer) -> None:
    base = keyed.base_url
    page = httpx.get(base + "/ui/chat")
    assert page.status_code == 401 and "API key required" in page.text
    assert httpx.get(base + "/ui/api/sessions").status_code == 401
    assert httpx.get(base + "/metrics").status_code == 401
    assert httpx.get(base + "/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert httpx.post(base + "/ui/api/login", json={"key": "wrong"}).status_code == 401
    with httpx.Client(base_url=base) as client:
        r = client.post("/ui/api/login", json={"key": "sekrit"})
        assert r.status_code == 200 and "httponly" in r.headers["set-cookie"].lower()
        assert "samesite=strict" in r.headers["set-cookie"].lower()
        assert client.get("/ui/api/sessions").status_code == 200
        assert 'data-page="chat"' in client.get("/ui/chat").text


def test_sessions_survive_a_server_restart(tmp_path: Path) -> None:
    for server in make_web_server(tmp_path):
        sid = httpx.post(server.base_url + "/ui/api/sessions", json={"title": "Keep"}).json()["id"]
        post_stream(
            server.base_url, f"/ui/api/sessions/{sid}/chat", {"content": "Remember", "options": {"max_tokens": 6}}
        )
    for server in make_web_server(tmp_path):
        saved = httpx.get(f"{server.base_url}/ui/api/sessions/{sid}").json()
        assert saved["title"] == "Keep" and next(m["content"] for m in saved["messages"]) == "Remember"


def test_top_prints_the_gauge_of_a_running_server(web: WebServer, capsys: pytest.CaptureFixture[str]) -> None:
    from mlx_dspark.entrypoints.cli import top

    post_stream(web.base_url, "/ui/api/race", {"prompt": "Top.", "modes": ["lookup"], "max_tokens": 30})
    assert top.main(["--url", web.base_url, "--once"]) == 0
    out = capsys.readouterr().out
    assert "local-model" in out and "mode baseline" in out and "[ready]" in out
    assert "tok/s" in out and "last request" in out and "acceptance" in out and "%" in out
    # The race measured plain decoding alone: the server says so, and top's scale marks and names it.
    plain = httpx.get(web.base_url + "/ui/api/status").json()["plain_tok_s"]
    assert plain > 0 and f"│ plain decoding {plain:.1f}" in out and "scale   0-" in out
    assert top.main(["--url", "http://127.0.0.1:9", "--once"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_top_finds_the_running_server_on_any_port(
    web: WebServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`serve` registers itself; `top` without --url watches the newest live one (it assumed :8080)."""
    import subprocess
    import sys

    from mlx_dspark.adapters.storage.server_registry import ServerRegistry
    from mlx_dspark.entrypoints.cli import top

    monkeypatch.delenv("MLX_DSPARK_PORT", raising=False)
    monkeypatch.setenv("MLX_DSPARK_CACHE_DIR", str(tmp_path))
    registry = ServerRegistry(tmp_path)
    assert top.server_url(None) == ("http://127.0.0.1:8080", None)  # nothing registered: the serve default
    code = "import os; print(os.getpid())"
    gone = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    dead = registry.folder / f"{gone.stdout.strip()}.json"
    registry.folder.mkdir(parents=True)
    dead.write_text(json.dumps({"url": "http://127.0.0.1:1", "pid": int(gone.stdout), "started": 9e9}))
    entry = registry.register(web.base_url, "local-model")
    assert top.server_url(None) == (web.base_url, None)  # the dead process's file is skipped
    assert not dead.exists() and entry.exists()
    assert top.main(["--once"]) == 0 and "local-model" in capsys.readouterr().out
    registry.unregister(entry)
    assert registry.live() == []


def test_top_honours_the_api_key(keyed: WebServer, capsys: pytest.CaptureFixture[str]) -> None:
    from mlx_dspark.entrypoints.cli import top

    assert top.main(["--url", keyed.base_url, "--once"]) == 1
    assert "api-key" in capsys.readouterr().err
    assert top.main(["--url", keyed.base_url, "--once", "--api-key", "sekrit"]) == 0


def test_the_fit_estimate_of_a_hub_repo_matches_hand_computed_bytes(web: WebServer) -> None:
    from tests.integration.web.conftest import fit_weight_bytes

    r = httpx.get(web.base_url + "/ui/api/models/fit", params={"repo": "fake-org/llama-8b-shaped"}).json()
    weights = fit_weight_bytes()
    assert r["weights"] == weights == 16_059_990_016 and r["download_bytes"] >= weights
    overhead = 512 * (1 << 20) + int(0.05 * weights)
    assert [(row["context"], row["kv_cache"], row["total"]) for row in r["rows"]] == [
        (4096, 512 * (1 << 20), weights + 512 * (1 << 20) + overhead),
        (8192, 1 << 30, weights + (1 << 30) + overhead),
    ]
    usable = r["usable"]["bytes"]
    for row in r["rows"]:
        expected = "green" if row["total"] <= 0.8 * usable else "yellow" if row["total"] <= usable else "red"
        assert row["verdict"] == expected
    missing = httpx.get(web.base_url + "/ui/api/models/fit", params={"repo": "fake-org/nothing"})
    assert missing.status_code == 404 and "not found" in missing.json()["error"]


def test_download_list_and_delete_a_model_through_the_api(tmp_path: Path) -> None:
    import time

    from tests.fakes.hub import FakeRepo, safetensors_bytes
    from tests.integration.web.conftest import fake_hub

    hub = fake_hub()
    config = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 8}
    files = {
        "config.json": json.dumps(config).encode(),
        "model.safetensors": safetensors_bytes({"w": ("F16", [64, 64])}),
    }
    hub.add(FakeRepo(repo_id="fake-org/small", files=files))
    for server in make_web_server(tmp_path, hub=hub):
        job = httpx.post(server.base_url + "/ui/api/models/download", json={"repo_id": "fake-org/small"}).json()
        for _ in range(200):
            state = {d["id"]: d for d in httpx.get(server.base_url + "/ui/api/models/downloads").json()}[job["id"]]
            if state["status"] in ("done", "failed"):
                break
            time.sleep(0.05)
        assert state["status"] == "done" and state["done"] == state["total"] == sum(len(b) for b in files.values())
        local = {m["name"]: m for m in httpx.get(server.base_url + "/ui/api/models/local").json()}
        assert local["fake-org/small"]["source"] == "huggingface cache"
        bad = httpx.post(server.base_url + "/ui/api/models/delete", json={"path": "/etc"})
        assert bad.status_code == 400
        ok = httpx.post(server.base_url + "/ui/api/models/delete", json={"path": local["fake-org/small"]["path"]})
        assert ok.status_code == 200
        assert "fake-org/small" not in {m["name"] for m in httpx.get(server.base_url + "/ui/api/models/local").json()}
        assert not (server.hf_cache / "models--fake-org--small").exists()
        bad_id = httpx.post(server.base_url + "/ui/api/models/download", json={"repo_id": "no-slash"})
        assert bad_id.status_code == 400


def test_switching_the_served_mode_goes_through_the_engine(tmp_path: Path) -> None:
    for server in make_web_server(tmp_path):
        r = httpx.post(
            server.base_url + "/ui/api/models/load", json={"model": "local-model", "mode": "lookup"}, timeout=60
        )
        assert r.status_code == 200 and r.json() == {"ok": True, "model": "local-model", "mode": "lookup"}
        status = httpx.get(server.base_url + "/ui/api/status").json()
        assert status["mode"] == "lookup"
        # the API now decodes with lookup drafts too (same engine, same generator)
        body = {"model": "local-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 30}
        assert httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        rounds = [e for _, e in server.recorder.events if isinstance(e, RoundFinished)]
        assert rounds[-1].source == "lookup" or any(e.source == "lookup" for e in rounds)
        bad = httpx.post(
            server.base_url + "/ui/api/models/load", json={"model": "local-model", "mode": "dflash"}, timeout=60
        )
        assert bad.status_code >= 400 and "dflash" in bad.json()["error"]
        assert httpx.get(server.base_url + "/ui/api/status").json()["mode"] == "lookup"  # a failed switch keeps it
        # Loading a model without choosing a mode keeps the served mode (it used to fall back to baseline).
        again = httpx.post(server.base_url + "/ui/api/models/load", json={"model": "local-model"}, timeout=60)
        assert again.status_code == 200 and again.json()["mode"] == "lookup"
        assert httpx.get(server.base_url + "/ui/api/status").json()["mode"] == "lookup"


def test_a_reply_cut_off_by_the_client_is_saved_as_far_as_it_went(tmp_path: Path) -> None:
    """The hang-up cancels the turn, and what was streamed is saved with outcome "cancelled".

    The reply and its stats are one row written in one transaction, so a saved reply is final: the test waits
    (bounded) for it to exist. A stream that missed the hang-up ran to the end of the job and saved the whole
    reply as completed, without an outcome (test_stream_cancellation.py pins why).
    """
    long_reply = " ".join(f"word{i}" for i in range(20000))
    for server in make_web_server(tmp_path, reply=long_reply):
        sid = httpx.post(server.base_url + "/ui/api/sessions", json={}).json()["id"]
        body = {"content": "Talk a lot.", "options": {"max_tokens": 30000}}
        with httpx.stream("POST", f"{server.base_url}/ui/api/sessions/{sid}/chat", json=body, timeout=60) as r:
            first = next(sse(r))
        assert first["type"] == "text"  # the client hangs up after the first delta
        import time

        deadline = time.monotonic() + 120  # the whole 30,000-token job takes ~10 s here: generous under load
        while len(messages := httpx.get(f"{server.base_url}/ui/api/sessions/{sid}").json()["messages"]) < 2:
            assert time.monotonic() < deadline, "the cut reply was never saved"
            time.sleep(0.05)
        user, reply = messages
        assert user["content"] == "Talk a lot."
        assert reply["stats"].get("outcome") == "cancelled", reply["stats"]
        assert long_reply.startswith(reply["content"]) and 0 < len(reply["content"]) < len(long_reply)
        assert httpx.get(server.base_url + "/ui/api/status").json()["queue_depth"] == 0


def test_an_idle_telemetry_stream_ends_and_resumes_after_the_last_event_id(web: WebServer) -> None:
    post_stream(web.base_url, "/ui/api/race", {"prompt": "Resume.", "modes": ["lookup"], "max_tokens": 6})
    with httpx.stream("GET", web.base_url + "/ui/api/telemetry/stream?replay=2000", timeout=30) as r:
        lines = list(r.iter_lines())  # ends by itself once idle
    ids = [int(line[4:]) for line in lines if line.startswith("id: ")]
    assert "retry: 1000" in lines and len(ids) > 4 and ids == sorted(ids)
    resume = ids[-3]
    headers = {"Last-Event-ID": str(resume)}
    with httpx.stream("GET", web.base_url + "/ui/api/telemetry/stream", headers=headers, timeout=30) as r:
        again = [int(line[4:]) for line in r.iter_lines() if line.startswith("id: ")]
    assert again == [i for i in ids if i > resume]  # exactly the events after the last one seen


def test_a_chat_page_turn_logs_the_one_canonical_line(tmp_path: Path) -> None:
    from tests.integration.http.conftest import capture_logs, restore_logging

    logs = capture_logs()
    try:
        for server in make_web_server(tmp_path):
            sid = httpx.post(server.base_url + "/ui/api/sessions", json={}).json()["id"]
            secret = "a private question nobody logs"
            post_stream(
                server.base_url, f"/ui/api/sessions/{sid}/chat", {"content": secret, "options": {"max_tokens": 8}}
            )
            line = logs.wait_for(dialect="ui")
            assert line["status"] == 200 and line["outcome"] == "completed" and line["stream"] is True
            assert line["completion_tokens"] == 8 and line["finish_reason"] == "length" and line["rounds"] > 0
            assert len(logs.requests(dialect="ui")) == 1 and secret not in logs.text
    finally:
        restore_logging()


def test_a_session_rewinds_to_a_user_message_for_regenerate_and_edit(web: WebServer) -> None:
    sid = httpx.post(web.base_url + "/ui/api/sessions", json={}).json()["id"]
    for text in ("First question.", "Second question."):
        post_stream(web.base_url, f"/ui/api/sessions/{sid}/chat", {"content": text, "options": {"max_tokens": 6}})
    messages = httpx.get(f"{web.base_url}/ui/api/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    rewind = f"{web.base_url}/ui/api/sessions/{sid}/rewind"
    # An assistant message, a foreign id or a malformed one is refused; nothing is dropped.
    assert httpx.post(rewind, json={"message_id": messages[1]["id"]}).status_code == 400
    assert httpx.post(rewind, json={"message_id": 10**9}).status_code == 400
    assert httpx.post(rewind, json={"message_id": "3"}).status_code == 400
    assert httpx.post(f"{web.base_url}/ui/api/sessions/nope/rewind", json={"message_id": 1}).status_code == 404
    assert len(httpx.get(f"{web.base_url}/ui/api/sessions/{sid}").json()["messages"]) == 4
    # Regenerate the last reply: drop from its question on, ask again; the history is the first turn plus it.
    r = httpx.post(rewind, json={"message_id": messages[2]["id"]})
    assert r.status_code == 200 and r.json()["content"] == "Second question."
    assert [m["content"] for m in httpx.get(f"{web.base_url}/ui/api/sessions/{sid}").json()["messages"]] == [
        "First question.",
        messages[1]["content"],
    ]
    post_stream(
        web.base_url, f"/ui/api/sessions/{sid}/chat", {"content": "Second question.", "options": {"max_tokens": 6}}
    )
    again = httpx.get(f"{web.base_url}/ui/api/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in again] == ["user", "assistant", "user", "assistant"]
    assert again[3]["content"] == messages[3]["content"]  # greedy: the same reply to the same history
