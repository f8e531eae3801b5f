"""Saved target state for the prefix cache: every cache leaf, the token ids and the captured features.

A save shares the caches' buffers instead of copying them: each array gets a fresh handle, so the
caches' later in-place slice updates copy on write and never reach the saved state (the same rule as
`caches.Checkpoint`). Loading builds new cache objects from the saved fields, then cuts them to the
requested length where that is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import mlx.core as mx

from mlx_dspark.adapters.mlx import caches as cache_ops


@attrs.frozen(kw_only=True, eq=False)
class MlxCacheState:
    """One saved prefix (the CacheState port).

    Attributes:
        tag: what the state is compatible with (capture layers, KV bits); loads need the same tag.
        tokens: the token ids of its rows.
        kinds: the class name of every cache leaf, in order.
        fields: every leaf's attributes (arrays with fresh handles, ints, nested lists/tuples).
        features: captured target features of all rows, or None.
        nbytes: bytes of the arrays it keeps alive.
        min_length: the shortest prefix it can be cut back to exactly.
    """

    tag: str
    tokens: tuple[int, ...]
    kinds: tuple[str, ...]
    fields: tuple[dict[str, Any], ...]
    features: mx.array | None
    nbytes: int
    min_length: int

    @property
    def length(self) -> int:
        return len(self.tokens)


def save(caches: list[Any], *, tag: str, tokens: tuple[int, ...], features: mx.array | None) -> MlxCacheState:
    """The state of `caches` holding the rows of `tokens` (shares buffers; nothing is copied)."""
    leaves = list(cache_ops.leaves(caches))
    fields = tuple(cache_ops.fresh_handles(dict(vars(c))) for c in leaves)
    nbytes = sum(a.nbytes for f in fields for a in _arrays(f)) + (0 if features is None else features.nbytes)
    return MlxCacheState(
        tag=tag,
        tokens=tokens,
        kinds=tuple(kind(c) for c in leaves),
        fields=fields,
        features=None if features is None else mx.array(features),
        nbytes=int(nbytes),
        min_length=min_length(caches, len(tokens)),
    )


def load(state: MlxCacheState, fresh: list[Any], keep: int) -> bool:
    """Fill the new caches `fresh` from `state`, cut to `keep` rows; False when that cannot be exact."""
    leaves = list(cache_ops.leaves(fresh))
    if tuple(kind(c) for c in leaves) != state.kinds:
        return False
    for cache, saved in zip(leaves, state.fields):
        vars(cache).clear()
        vars(cache).update(cache_ops.fresh_handles(saved))
    drop = state.length - keep
    if drop < 0 or not cache_ops.can_cut(fresh, drop):
        return False
    cache_ops.cut(fresh, drop)
    return True


def kind(cache: Any) -> str:
    """The name a state records for `cache`: the class whose fields it holds (a subclass may say it keeps its
    base's, as `BucketedKVCache` does)."""
    return str(getattr(type(cache), "state_kind", type(cache).__name__))


def min_length(caches: list[Any], length: int) -> int:
    """The shortest prefix of the `length` cached rows that `caches.cut` reaches exactly."""
    lo, hi = 0, length  # the most rows that can be dropped exactly lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cache_ops.can_cut(caches, mid):  # exact cuts are monotone: fewer rows are exact too
            lo = mid
        else:
            hi = mid - 1
    return length - lo


def _arrays(value: Any) -> Iterator[mx.array]:
    if isinstance(value, mx.array):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _arrays(v)
