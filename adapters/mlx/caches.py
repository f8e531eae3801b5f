"""Exact rollback over mlx-lm's per-layer caches: trim what can be cut exactly, checkpoint the rest.

Plain KV caches cut by offset. A sliding-window `RotatingKVCache` is cut by rebuilding its buffer in
temporal order without the dropped rows, and only when the window it leaves is complete (peer-lessons
§2.3); anything else (recurrent `ArraysCache` state, unknown kinds) is restored from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    CacheList,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlx_dspark.adapters.mlx import key_buckets

# Caches whose rows are addressed by `offset` alone: trimming is exact by construction.
_OFFSET_CUT = (KVCache, QuantizedKVCache, ConcatenateKVCache)


def make_caches(model: Any, kv_bits: int | None = None, kv_group_size: int = 64, *, buckets: bool = False) -> list[Any]:
    """The model's own fresh cache list, with plain KV caches quantized when `kv_bits` is set, or else
    attending in key buckets when `buckets` is set (`key_buckets`)."""
    caches = make_prompt_cache(model)
    if kv_bits is not None:
        return [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c for c in caches]
    if buckets:
        return [key_buckets.BucketedKVCache() if type(c) is KVCache else c for c in caches]
    return caches


def leaves(caches: list[Any]) -> Iterator[Any]:
    """Every leaf cache, descending into `CacheList` containers."""
    for c in caches:
        if isinstance(c, CacheList):
            yield from leaves(list(c.caches))
        else:
            yield c


def cuts_by_offset(cache: Any) -> bool:
    """Whether trimming `cache` is always exact (plain or quantized KV)."""
    return isinstance(cache, _OFFSET_CUT) and not isinstance(cache, RotatingKVCache)


def fresh_handles(value: Any) -> Any:
    # New array handles: later in-place slice updates on the cache's arrays must not reach a checkpoint.
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, list):
        return [fresh_handles(v) for v in value]
    if isinstance(value, tuple):
        return tuple(fresh_handles(v) for v in value)
    if isinstance(value, dict):
        return {k: fresh_handles(v) for k, v in value.items()}
    return value


class Checkpoint:
    """The state of the caches that cannot be trimmed exactly, taken before a forward."""

    def __init__(self, caches: list[Any]) -> None:
        self._saved = [(c, fresh_handles(vars(c))) for c in leaves(caches) if not cuts_by_offset(c)]

    def restore(self) -> None:
        """Put every checkpointed cache back as it was (the checkpoint stays valid)."""
        for cache, saved in self._saved:
            vars(cache).clear()
            vars(cache).update(fresh_handles(saved))


def _temporal_rows(cache: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """The keys and values of a rotating cache in temporal order, unused slots dropped."""
    keys: Any = cache.keys
    values: Any = cache.values
    idx, keep = cache._idx, cache.keep
    if idx == keys.shape[2]:
        return keys, values
    if idx < cache.offset:  # the ring has wrapped: [keep rows | oldest (idx:) | newest (keep:idx)]
        order = (slice(0, keep), slice(idx, None), slice(keep, idx))
        return (
            mx.concatenate([keys[..., s, :] for s in order], axis=2),
            mx.concatenate([values[..., s, :] for s in order], axis=2),
        )
    return keys[..., :idx, :], values[..., :idx, :]


def _rotating_cut(cache: RotatingKVCache, n: int, apply: bool) -> bool:
    """Drop the newest `n` rows of a rotating cache if the result is exactly the cache without them."""
    if n == 0:
        return True
    if cache.keys is None or n > cache.offset:
        return False
    keys, values = _temporal_rows(cache)
    present = keys.shape[2]
    rows_left, offset_left = present - n, cache.offset - n
    if rows_left < 0:
        return False
    never_dropped = present == cache.offset
    # After a wrap, mlx-lm's one-token update assumes a full buffer (>= max_size rows, newest last), and
    # the next query needs max_size - 1 earlier rows; sink rows (keep > 0) make the window approximate.
    full_window = cache.keep == 0 and rows_left >= cache.max_size
    if not (never_dropped or full_window):
        return False
    if apply:
        cache.keys = keys[..., :rows_left, :]
        cache.values = values[..., :rows_left, :]
        cache.offset = offset_left
        cache._idx = rows_left
    return True


def can_cut(caches: list[Any], n: int) -> bool:
    """Whether the newest `n` rows can be dropped from every cache exactly, without a checkpoint."""
    return all(_cut_leaf(c, n, apply=False) for c in leaves(caches))


def cut(caches: list[Any], n: int) -> None:
    """Drop the newest `n` rows of every cache; call only after `can_cut` said yes."""
    for c in leaves(caches):
        if not _cut_leaf(c, n, apply=True):
            raise RuntimeError(f"cannot cut {n} rows from {type(c).__name__} exactly")


def trim_offset_caches(caches: list[Any], n: int) -> None:
    """Trim the offset-addressed caches by `n` (the others are restored from a checkpoint)."""
    for c in leaves(caches):
        if cuts_by_offset(c):
            c.trim(n)


def _cut_leaf(cache: Any, n: int, apply: bool) -> bool:
    if n == 0:
        return True
    if cuts_by_offset(cache):
        ok: bool = n <= cache.offset
        if ok and apply:
            cache.trim(n)
        return ok
    if isinstance(cache, RotatingKVCache):
        return _rotating_cut(cache, n, apply)
    return False  # recurrent state and unknown kinds: only a checkpoint undoes them


def all_cut_by_offset(caches: list[Any]) -> bool:
    """Whether every cache is a plain (or quantized) KV cache."""
    return all(cuts_by_offset(c) for c in leaves(caches))


def cache_arrays(caches: list[Any]) -> list[mx.array]:
    """Arrays that hold the caches' state, for `mx.eval` after a forward whose output is not read."""
    out: list[mx.array] = []

    def collect(value: Any) -> None:
        if isinstance(value, mx.array):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)

    for c in leaves(caches):
        collect(list(vars(c).values()))
    return out
