"""Spilled prefix-cache entries: safetensors round trip on every cache kind, survival across a restart,
and refusal (with a warning, never a load) of corrupt, truncated, renamed and foreign files."""

from __future__ import annotations

import functools
import shutil

import pytest

from mlx_dspark.adapters.mlx.prefix_store import SafetensorsPrefixStore
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.prefix_cache import PrefixCache
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.tiny_models import FAMILIES, tiny_model

GREEDY = SamplingParams()
PROMPT = [3, 9, 4, 1, 12, 7, 2, 15, 6, 11, 5, 8, 14, 13, 10, 3, 9, 21, 33]


@functools.cache
def _model(family: str, **kw):
    return tiny_model(family, seed=5, **kw)


def make(kind: str) -> MlxTargetModel:
    if kind == "llama-q8":
        return MlxTargetModel(_model("llama", head_dim=32), capture_layers=(0,), kv_bits=8, kv_group_size=32)
    return MlxTargetModel(_model(kind), capture_layers=(-1, 1))


@pytest.mark.parametrize("kind", ["llama-q8", *FAMILIES])
def test_a_state_survives_the_disk_and_a_restart(tmp_path, kind):
    target = make(kind)
    target.prefill(PROMPT, GREEDY, 0.5)
    state = target.save_state()
    warnings: list[str] = []
    stored = SafetensorsPrefixStore(tmp_path, "model@1", warn=warnings.append).save(
        state, tag=target.state_tag, tokens=tuple(PROMPT)
    )
    restarted = SafetensorsPrefixStore(tmp_path, "model@1", warn=warnings.append)
    (found,) = restarted.scan()
    assert found == stored
    loaded = restarted.load(found)
    assert loaded is not None and not warnings
    assert loaded.min_length == state.min_length and loaded.length == len(PROMPT)
    other = make(kind)
    assert other.load_state(loaded, len(PROMPT)) == len(PROMPT)
    assert other.prefill([6], GREEDY, 0.5) == make(kind).prefill([*PROMPT, 6], GREEDY, 0.5)


def saved_file(tmp_path, identity="model@1", prompt=PROMPT):
    target = make("llama")
    target.prefill(prompt, GREEDY, 0.5)
    store = SafetensorsPrefixStore(tmp_path, identity)
    stored = store.save(target.save_state(), tag=target.state_tag, tokens=tuple(prompt))
    return store, stored, store.folder / f"{stored.key}.safetensors"


def test_a_corrupt_file_is_refused_with_a_warning(tmp_path):
    _store, stored, path = saved_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the tensor data
    path.write_bytes(bytes(data))
    warnings: list[str] = []
    reader = SafetensorsPrefixStore(tmp_path, "model@1", warn=warnings.append)
    assert reader.scan() == [stored]  # the header is intact, so it is listed...
    assert reader.load(stored) is None  # ...but never loaded
    assert "checksum" in warnings[-1]


def test_truncated_renamed_and_foreign_files_are_ignored(tmp_path):
    store, stored, path = saved_file(tmp_path)
    truncated = path.with_name("0" * 40 + ".safetensors")
    truncated.write_bytes(path.read_bytes()[:50])
    renamed = path.with_name("1" * 40 + ".safetensors")
    shutil.copy(path, renamed)
    _, _, foreign = saved_file(tmp_path / "elsewhere", identity="another-model@7", prompt=PROMPT[:9])
    shutil.copy(foreign, store.folder / foreign.name)
    (store.folder / "junk.safetensors").write_bytes(b"\x00" * 7)
    warnings: list[str] = []
    reader = SafetensorsPrefixStore(tmp_path, "model@1", warn=warnings.append)
    assert reader.scan() == [stored]
    assert len(warnings) == 4
    assert any("another model" in w for w in warnings)


def test_a_spilled_entry_serves_a_prompt_after_a_restart(tmp_path):
    target = make("llama")
    cache = PrefixCache(10**9, store=SafetensorsPrefixStore(tmp_path, "model@1"))
    assert cache.prepare(target, PROMPT).rows == 0
    target.prefill(PROMPT, GREEDY, 0.5)
    cache.remember(target)
    assert cache.flush() == 1
    # A new process: an empty target, an empty memory tier, the same folder.
    fresh = make("llama")
    restarted = PrefixCache(10**9, store=SafetensorsPrefixStore(tmp_path, "model@1"))
    reuse = restarted.prepare(fresh, [*PROMPT, 6, 7])
    assert (reuse.rows, reuse.source) == (len(PROMPT), "disk")
    assert fresh.prefill([6, 7], GREEDY, 0.5) == make("llama").prefill([*PROMPT, 6, 7], GREEDY, 0.5)
    # Now warm in memory too.
    fresh.reset(0)
    assert restarted.prepare(fresh, [*PROMPT, 6, 7]).source == "memory"


def test_entries_evicted_from_memory_spill_to_disk(tmp_path):
    target = make("llama")
    target.prefill(PROMPT, GREEDY, 0.5)
    size = target.save_state().nbytes
    cache = PrefixCache(size + size // 2, store=SafetensorsPrefixStore(tmp_path, "model@1"))
    cache.remember(target)
    target.reset(0)
    target.prefill([*PROMPT[::-1], 1], GREEDY, 0.5)  # as long, so it may evict the first
    cache.remember(target)
    tag = target.state_tag
    assert [e.tokens for e in cache.entries(tag)] == [(*PROMPT[::-1], 1)]
    assert [e.tokens for e in cache.disk_entries(tag)] == [tuple(PROMPT)]
    target.reset(0)
    reuse = cache.prepare(target, [*PROMPT, 2])
    assert (reuse.rows, reuse.source) == (len(PROMPT), "disk")


class _HeldElsewhere:
    """A target whose states live partly in other processes (a sharded target's MirroredState): never written to
    one file."""

    def __init__(self, inner: MlxTargetModel) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def save_state(self):
        from mlx_dspark.adapters.mlx.distributed import MirroredState

        return MirroredState(0, self._inner.save_state(), [])


def test_a_state_held_across_processes_is_evicted_without_a_spill(tmp_path):
    target = _HeldElsewhere(make("llama"))
    target.prefill(PROMPT, GREEDY, 0.5)
    size = target.save_state().nbytes
    warnings: list[str] = []
    cache = PrefixCache(size + size // 2, store=SafetensorsPrefixStore(tmp_path, "model@1"), warn=warnings.append)
    cache.remember(target)
    target.reset(0)
    target.prefill([*PROMPT[::-1], 1], GREEDY, 0.5)
    cache.remember(target)
    assert [e.tokens for e in cache.entries(target.state_tag)] == [(*PROMPT[::-1], 1)]
    assert cache.disk_entries(target.state_tag) == [] and not warnings and not list(tmp_path.rglob("*.safetensors"))
