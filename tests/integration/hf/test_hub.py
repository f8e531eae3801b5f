"""The hub adapter against a local fake hub speaking the Hugging Face HTTP API: search, fit facts, downloads
(a failed one, a resumed one) into the Hugging Face cache layout the loader reads."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_dspark.adapters.hf.catalog import LocalModelCatalog
from mlx_dspark.adapters.hf.hub import HfModelHub
from mlx_dspark.domain.errors import ModelUnavailable
from tests.fakes.hub import FakeHub, FakeRepo, safetensors_bytes, serve

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 64, "max_position_embeddings": 2048, "torch_dtype": "float16"}  # fmt: skip
# 12 MiB of weights: bigger than huggingface-hub's 10 MiB download chunk, so a cut after 11 MB resumes mid-file
WEIGHTS = safetensors_bytes({"w": ("F16", [6 * 1024, 1024])})
CUT = 11_000_000


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add(
        FakeRepo(repo_id="fake/tiny", files={"config.json": json.dumps(CONFIG).encode(), "model.safetensors": WEIGHTS})
    )
    fake.add(FakeRepo(repo_id="fake/other", files={"config.json": b"{}"}))
    with serve(fake):
        yield fake


def test_search_lists_matching_repos(hub: FakeHub, tmp_path: Path) -> None:
    client = HfModelHub(hub.url, cache_dir=str(tmp_path))
    assert [m["id"] for m in client.search("tiny")] == ["fake/tiny"]
    assert {m["id"] for m in client.search("fake")} == {"fake/tiny", "fake/other"}


def test_facts_read_only_the_config_and_the_safetensors_header(hub: FakeHub, tmp_path: Path) -> None:
    facts = HfModelHub(hub.url, cache_dir=str(tmp_path)).facts("fake/tiny")
    assert facts.weight_bytes == 6 * 1024 * 1024 * 2 and facts.shape.layers == 2 and facts.model_type == "llama"
    ranges = [r for m, p, r in hub.requests if p.endswith("model.safetensors")]
    assert ranges == ["bytes=0-7", f"bytes=8-{8 + int.from_bytes(WEIGHTS[:8], 'little') - 1}"]
    assert not any(tmp_path.iterdir())  # nothing was written to the cache


def test_unknown_repos_and_repos_without_weights_are_clear_errors(hub: FakeHub, tmp_path: Path) -> None:
    client = HfModelHub(hub.url, cache_dir=str(tmp_path))
    with pytest.raises(ModelUnavailable, match="not found"):
        client.facts("fake/missing")
    with pytest.raises(ModelUnavailable, match="config"):
        client.facts("fake/other")


def test_a_download_lands_in_the_hub_cache_with_progress(hub: FakeHub, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    path = Path(HfModelHub(hub.url, cache_dir=str(tmp_path)).download("fake/tiny", lambda d, t: seen.append((d, t))))
    assert path.parent.name == "snapshots" and path.parent.parent.name == "models--fake--tiny"
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    total = len(WEIGHTS) + len(json.dumps(CONFIG))
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen))  # progress only goes forward
    listed = LocalModelCatalog(project_cache=tmp_path / "p", hub_cache=tmp_path, lm_studio=[]).local_models()
    entry = next(m for m in listed if m.name == "fake/tiny")
    assert entry.source == "huggingface cache" and entry.size_bytes == total and entry.context == 2048


def test_a_download_cut_short_resumes_where_it_stopped(hub: FakeHub, tmp_path: Path) -> None:
    hub.truncate["model.safetensors"] = CUT
    hub.truncate_times["model.safetensors"] = 1  # the connection drops once
    path = Path(HfModelHub(hub.url, cache_dir=str(tmp_path)).download("fake/tiny"))
    data = (path / "model.safetensors").read_bytes()
    assert hashlib.sha256(data).digest() == hashlib.sha256(WEIGHTS).digest()
    gets = [r for m, p, r in hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert gets[0] == "" and gets[1] == "bytes=10485760-"  # asked only for the rest after the last written chunk


def test_a_failed_download_reports_the_error_and_leaves_no_broken_file(hub: FakeHub, tmp_path: Path) -> None:
    hub.truncate["model.safetensors"] = CUT  # every attempt drops
    client = HfModelHub(hub.url, cache_dir=str(tmp_path))
    with pytest.raises(ModelUnavailable, match=r"model\.safetensors"):
        client.download("fake/tiny")
    snapshot = next((tmp_path / "models--fake--tiny" / "snapshots").iterdir())
    assert not (snapshot / "model.safetensors").exists()
    assert "fake/tiny" not in {
        m.name for m in LocalModelCatalog(project_cache=tmp_path, hub_cache=tmp_path, lm_studio=[]).local_models()
    }
    del hub.truncate["model.safetensors"]  # the hub recovers: trying again completes
    path = Path(client.download("fake/tiny"))
    assert (path / "model.safetensors").read_bytes() == WEIGHTS


def test_hf_hub_offline_stops_every_hub_call(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    client = HfModelHub(hub.url, cache_dir=str(tmp_path))
    for call in (
        lambda: client.search("tiny"),
        lambda: client.facts("fake/tiny"),
        lambda: client.download("fake/tiny"),
    ):
        with pytest.raises(ModelUnavailable, match="HF_HUB_OFFLINE"):
            call()
    assert hub.requests == [] and client.search("") == []


def test_an_unreachable_hub_is_said_at_once_without_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, every call says "hub unreachable" after one refused connection, not "not found" after
    huggingface-hub's retries (a search once hung 23 s and showed nothing)."""
    import socket

    import huggingface_hub

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    connects: list[tuple[str, int]] = []
    real = socket.create_connection

    def counting(address: tuple[str, int], *args: object, **kwargs: object) -> socket.socket:
        connects.append(address)
        return real(address, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "create_connection", counting)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda **_kw: pytest.fail("no HTTP call when unreachable"))
    client = HfModelHub(f"http://127.0.0.1:{port}", cache_dir=str(tmp_path))
    for call in (
        lambda: client.search("tiny"),
        lambda: client.facts("fake/tiny"),
        lambda: client.download("fake/tiny"),
    ):
        with pytest.raises(ModelUnavailable, match="hub unreachable") as info:
            call()
        assert "not found" not in str(info.value)
    assert connects == [("127.0.0.1", port)]  # asked once, the answer kept for the next calls
