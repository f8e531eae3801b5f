"""Use case: prefix reuse across requests — find the longest usable cached prefix, put it in the target,
snapshot during prefill, remember the state after each request, spill cold entries to disk.

One per loaded target (the engine thread is its only user). States are the target's own (`save_state`):
KV, recurrent state and captured drafter features together, so every drafter's context stays consistent
with the target rows it was computed from. The policy (radix tree, LRU, budget) is `domain.cache`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from mlx_dspark.application.ports import LoadedModel, PrefixStore
from mlx_dspark.application.settings import CacheSettings, parse_bytes
from mlx_dspark.domain.cache import CacheEntry, Match, PrefixIndex, StoredPrefix, common_prefix, snapshot_points
from mlx_dspark.domain.ports import RollbackKind, TargetModel

DISK_BUDGET_FACTOR = 4  # spilled entries may take this many times the memory budget on disk


@attrs.frozen(kw_only=True)
class Reuse:
    """How a request starts: rows already in the target and where they came from."""

    rows: int
    source: str  # "none", "live" (the target still held them), "memory" or "disk"


class PrefixCache:
    """Cached prefixes of one target in memory (under `budget_bytes`) and optionally on disk.

    Args:
        budget_bytes: memory the saved states may keep alive (0 = keep only the live cache).
        store: where cold entries spill (None = memory only).
        warn: receives one line per problem (a spill that failed, a file refused).
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        store: PrefixStore | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self._memory: dict[str, PrefixIndex] = {}
        self._disk: dict[str, PrefixIndex] = {}
        self._store = store
        self._warn = warn or (lambda _msg: None)
        if store is not None:
            for stored in store.scan():  # oldest first: the scan order is the LRU order
                self._disk_index(stored.tag).insert(_disk_entry(stored))

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def entries(self, tag: str) -> list[CacheEntry]:
        """In-memory entries of one state tag, least recently used first (for tests and telemetry)."""
        return self._memory_index(tag).entries()

    def disk_entries(self, tag: str) -> list[CacheEntry]:
        return self._disk_index(tag).entries()

    # Per request ----------------------------------------------------------------------------------

    def prepare(self, target: TargetModel, ids: Sequence[int]) -> Reuse:
        """Put the longest usable cached prefix of `ids` into `target` (at most len(ids) - 1 rows)."""
        limit = len(ids) - 1
        live = min(common_prefix(target.cached_ids, ids), limit)
        tag = target.state_tag
        if not self.enabled or limit < 1 or not tag:
            kept = target.reset(live)
            return Reuse(rows=kept, source="live" if kept else "none")
        memory = self._memory_index(tag).lookup(ids, limit)
        disk = self._disk_index(tag).lookup(ids, limit) if self._store is not None else None
        on_disk = disk.length if disk is not None else 0
        if memory is not None and memory.length >= max(live, on_disk):
            kept = self._load(target, tag, memory)
            if kept:
                return Reuse(rows=kept, source="memory")
        if live and live >= on_disk:
            kept = target.reset(live)  # the live cache may not cut back exactly (recurrent state)
            if kept:
                return Reuse(rows=kept, source="live")
        if disk is not None:
            kept = self._load_from_disk(target, tag, disk)
            if kept:
                return Reuse(rows=kept, source="disk")
        kept = target.reset(live)
        return Reuse(rows=kept, source="live" if kept else "none")

    def snapshot_points(
        self, target: TargetModel, boundaries: Sequence[int], *, start: int, end: int
    ) -> tuple[int, ...]:
        """Where to save states during this prefill: only a target that cannot be cut back needs them."""
        if not self.enabled or target.rollback_kind is RollbackKind.TRIM:
            return ()
        return snapshot_points(boundaries, start=start, end=end)

    def remember(self, target: TargetModel) -> bool:
        """Save the target's cached rows as an entry; returns whether it was admitted."""
        if not self.enabled or target.cached_tokens == 0 or not target.state_tag:
            return False
        state = target.save_state()
        if state is None:  # the target declined (a batched row whose rows are still under way)
            return False
        tokens = tuple(target.cached_ids)
        tag = target.state_tag
        entry = CacheEntry(tokens=tokens, handle=state, nbytes=state.nbytes, min_length=state.min_length)
        result = self._memory_index(tag).insert(entry)
        for old in result.evicted:
            self._spill(tag, old)
        return result.stored

    def clear(self) -> None:
        """Forget every in-memory entry (files on disk stay)."""
        self._memory.clear()

    def flush(self) -> int:
        """Spill every in-memory entry to disk (at shutdown); returns how many were written."""
        if self._store is None:
            return 0
        written = 0
        for tag, index in self._memory.items():
            for entry in index.entries():
                written += self._spill(tag, entry)
        return written

    # Internals ------------------------------------------------------------------------------------

    def _memory_index(self, tag: str) -> PrefixIndex:
        index = self._memory.get(tag)
        if index is None:
            index = self._memory[tag] = PrefixIndex(self.budget_bytes)
        return index

    def _disk_index(self, tag: str) -> PrefixIndex:
        index = self._disk.get(tag)
        if index is None:
            index = self._disk[tag] = PrefixIndex(self.budget_bytes * DISK_BUDGET_FACTOR)
        return index

    def _load(self, target: TargetModel, tag: str, match: Match) -> int:
        kept = target.load_state(match.entry.handle, match.length)
        if kept:
            self._memory_index(tag).touch(match.entry)
        else:  # a state that no longer loads is of no use to anyone
            self._memory_index(tag).remove(match.entry)
        return kept

    def _load_from_disk(self, target: TargetModel, tag: str, match: Match) -> int:
        stored: StoredPrefix = match.entry.handle
        state = self._store.load(stored) if self._store is not None else None
        disk = self._disk_index(tag)
        if state is None:
            disk.remove(match.entry)
            return 0
        disk.touch(match.entry)
        kept = target.load_state(state, match.length)
        if kept:  # warm again: it lives in memory until evicted (its file stays for the next restart)
            entry = CacheEntry(tokens=stored.tokens, handle=state, nbytes=state.nbytes, min_length=state.min_length)
            for old in self._memory_index(tag).insert(entry).evicted:
                self._spill(tag, old)
        return kept

    def _spill(self, tag: str, entry: CacheEntry) -> bool:
        # A state held across several processes (a sharded target's) cannot be written to one file.
        if self._store is None or not getattr(entry.handle, "spillable", True):
            return False
        disk = self._disk_index(tag)
        if any(e.serves(entry) for e in disk.entries()):
            return False  # already on disk
        try:
            stored = self._store.save(entry.handle, tag=tag, tokens=entry.tokens)
        except OSError as exc:
            self._warn(f"prefix cache: could not spill {len(entry.tokens)} tokens to disk: {exc}")
            return False
        result = disk.insert(_disk_entry(stored))
        for old in (*result.evicted, *result.replaced):
            self._store.delete(old.handle)
        if not result.stored:
            self._store.delete(stored)
        return result.stored


def _disk_entry(stored: StoredPrefix) -> CacheEntry:
    return CacheEntry(tokens=stored.tokens, handle=stored, nbytes=stored.nbytes, min_length=stored.min_length)


class PrefixCaches:
    """One PrefixCache per loaded model (shared by every GenerationService on it), from the cache settings.

    Args:
        settings: the budget (`prefix_cache_bytes`) and the spill directory (`prefix_cache_dir`).
        default_budget: the budget when the settings say auto (a fraction of free memory).
        store_factory: model identity → where its cold entries spill (None: memory only).
        warn: receives one line per problem.
    """

    def __init__(
        self,
        settings: CacheSettings,
        *,
        default_budget: Callable[[], int],
        store_factory: Callable[[str], PrefixStore | None] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self._settings = settings
        self._default_budget = default_budget
        self._store_factory = store_factory
        self._warn = warn
        self._caches: dict[str, PrefixCache] = {}

    def __call__(self, model: LoadedModel) -> PrefixCache:
        cache = self._caches.get(model.identity)
        if cache is None:
            budget = parse_bytes(self._settings.prefix_cache_bytes)
            budget = self._default_budget() if budget is None else budget
            store = self._store_factory(model.identity) if (self._store_factory and budget > 0) else None
            cache = self._caches[model.identity] = PrefixCache(budget, store=store, warn=self._warn)
        return cache

    def flush(self) -> int:
        """Spill every in-memory entry to disk (at shutdown, when a directory is set); returns how many."""
        return sum(c.flush() for c in self._caches.values())
