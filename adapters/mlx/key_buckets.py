"""Attention key lengths in buckets, for backends that build an attention plan per shape.

MLX's CUDA backend runs multi-row attention (a verify, a draft block) in bf16/fp16 through cuDNN, whose
execution graph is built per (query, key) shape and then cached; without cuDNN (fp32) the fallback's GEMMs
pick a plan per shape too. A verify attends over a key length that grows every round, so every round built a
new plan on the host while the device waited (the H200's 8.1 ms of `async_eval` in a DSpark round against
2.7 ms in a plain step). Here a wide forward attends over the cache's whole allocated buffer, always a
multiple of `STEP` rows, with a mask hiding the rows not yet written: the shapes change once per `STEP` rows
of growth instead of every round. Metal's and the CPU's kernels have no per-shape cost, so "auto" keeps exact
lengths there (padded keys would only add masked work).
"""

from __future__ import annotations

import threading

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_dspark.adapters.mlx.device import cuda_switch

ENV = "MLX_DSPARK_KEY_BUCKETS"  # "auto" (CUDA only), "on", "off"
STEP = 256  # rows per bucket: mlx-lm's own KV growth step, which MLX's CUDA decode path also keys on
MAX_QUERY = 32  # widest forward that attends over the padded buffer (verifies, draft blocks); prefill stays exact


def enabled() -> bool:
    """Whether wide forwards attend over padded key buckets in this process (see the module docstring)."""
    return cuda_switch(ENV)


def capacity(rows: int) -> int:
    """The bucket holding `rows` rows: the next multiple of `STEP`."""
    return max(STEP, -(-rows // STEP) * STEP)


def visible(n: int, offset: int | mx.array, width: int, dtype: mx.Dtype | None) -> mx.array:
    """The causal mask of `n` query rows at positions offset… (an int, or an array inside a compiled graph) over
    `width` key rows (rows past the last query hidden): additive in `dtype` (so attention does not convert it in
    every layer), boolean when None."""
    keys = mx.arange(width)[None]
    queries = (offset + mx.arange(n))[:, None]
    return additive(keys <= queries, dtype)


def additive(seen: mx.array, dtype: mx.Dtype | None) -> mx.array:
    """A boolean mask as 0 / -inf in `dtype` (unchanged when None)."""
    if dtype is None:
        return seen
    return mx.where(seen, mx.array(0, dtype=dtype), mx.array(-mx.inf, dtype=dtype))


def width_after(keys: mx.array | None, rows: int) -> int:
    """The buffer rows a cache holding `keys` has once it holds `rows` rows (`grown`'s rule)."""
    return int(keys.shape[2]) if keys is not None and rows <= keys.shape[2] else capacity(rows)


def grown(keys: mx.array, values: mx.array, used: int, rows: int) -> tuple[mx.array, mx.array]:
    """Buffers [B, H, capacity(rows), D] holding the first `used` rows of `keys`/`values` (the rest zeros)."""
    b, heads, _, dk = keys.shape
    cap = capacity(rows)
    new_k = mx.zeros((b, heads, cap, dk), keys.dtype)
    new_v = mx.zeros((b, heads, cap, values.shape[3]), values.dtype)
    if used:
        new_k[..., :used, :] = keys[..., :used, :]
        new_v[..., :used, :] = values[..., :used, :]
    return new_k, new_v


def arm(offset: int, n: int, width: int) -> None:
    """This thread's next forward runs `n` rows after `offset` over a `width`-row padded mask (see `armed`)."""
    _ARMED.forward = (offset, n, width)


def armed(offset: int, n: int, width: int) -> bool:
    """Whether a layer writing `n` rows after `offset` into a `width`-row buffer serves the padded mask that
    this thread's forward built: only then may it return the whole buffer."""
    return getattr(_ARMED, "forward", None) == (offset, n, width)


def disarm() -> None:
    """Forget the current thread's padded mask (after the forward it was built for)."""
    _ARMED.forward = None


# The (offset, width, buffer rows) the current thread's forward built its padded mask for.
_ARMED = threading.local()


class BucketedKVCache(KVCache):  # type: ignore[misc]
    """mlx-lm's KVCache whose buffer always holds a multiple of `STEP` rows, and whose wide forwards
    (2..`MAX_QUERY` rows) attend over that whole buffer under `make_mask`'s mask.

    A layer pads only when this forward's mask came from `make_mask` for its own offset and width: a model
    that built its mask any other way (a "causal" string would align the queries to the buffer's end) sees
    the exact rows, as with the plain cache. One-row steps and prefill chunks always see the exact rows. The
    instance fields are the plain cache's, so saved states move between the two kinds.
    """

    state_kind = "KVCache"  # what cache_state compares: the fields and their meaning are KVCache's

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self.offset, keys.shape[2]
        if self.keys is None:
            self.keys, self.values = grown(keys, values, 0, n)
        elif prev + n > self.keys.shape[2]:
            self.keys, self.values = grown(self.keys, self.values, prev, prev + n)
        exact = super().update_and_fetch(keys, values)
        if armed(prev, n, self.keys.shape[2]):
            return self.keys, self.values
        return exact  # type: ignore[no-any-return]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None, **kwargs: object) -> object:
        disarm()
        if not 1 < n <= MAX_QUERY or window_size is not None:
            return super().make_mask(n, return_array=return_array, window_size=window_size, **kwargs)
        width = width_after(self.keys, self.offset + n)
        arm(self.offset, n, width)
        return visible(n, self.offset, width, None if self.keys is None else self.keys.dtype)
