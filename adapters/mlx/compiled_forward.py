"""A verify's (and, on the CPU, a plain step's) target forward as one compiled graph, replayed without building
it again in Python.

With key buckets (`key_buckets`) a verify of n rows sees the same shapes for 256 rows of growth: the cache
buffers, the padded mask, the tokens. So the forward can be traced once per (n, bucket) by `mx.compile` and
replayed: the host no longer walks every layer's modules each round (about 2 ms for a 28-layer model on the
H200, time the device waited on), and MLX fuses the elementwise chains into fewer kernels. Inside the trace
each layer's cache is a `TracedKV`: the whole buffer in, the rows written at an offset that is an array
(`mx.slice_update`), the whole buffer out; the caller puts the new buffers back into its `BucketedKVCache`s,
so everything else (trimming, saved states, plain steps) sees the usual caches. Recorded hidden states (the
drafters' features) are outputs of the graph. Only targets whose every layer is a plain KV cache take this
path; anything else runs the model as it is.

Plain steps (one row) run compiled where `steps_enabled`: on the CPU, where the graph's fused elementwise kernels
and the Python it no longer walks made plain decoding of the default model 13% faster (the plain KV cache's
buffer grows in the same 256-row steps, so a trace serves 256 steps). Not by default on CUDA: a one-row step
there attends through a fused vector kernel that takes no mask array, and the padded buffer needs one. On the
CPU, verifies compile with them while rows x keys stays below what the NumPy attention (`cpu_kernels`) takes over
in an eager forward: past that, an eager verify over the exact keys is faster (at 6,000 keys, 151 against 305 ms).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_dspark.adapters.mlx import key_buckets
from mlx_dspark.adapters.mlx.device import switch_mode

ENV = "MLX_DSPARK_COMPILE"  # "auto" (where key buckets are on), "on", "off" (no compiled forward at all)
STEPS_ENV = "MLX_DSPARK_COMPILE_STEPS"  # plain steps: "auto" (the CPU), "on", "off"


def enabled(buckets: bool) -> bool:
    """Whether verifies run compiled in this process: needs key buckets (fixed shapes) unless forced off."""
    return buckets and switch_mode(ENV) != "off"


def steps_enabled() -> bool:
    """Whether plain steps run compiled in this process (auto: on the CPU; never with MLX_DSPARK_COMPILE=off)."""
    mode = switch_mode(STEPS_ENV)
    if switch_mode(ENV) == "off" or mode == "off":
        return False
    return mode == "on" or bool(mx.default_device().type == mx.cpu)


_DENSE = (key_buckets.BucketedKVCache, KVCache)  # exactly these: subclasses (quantized, rotating) keep their rules


class TracedKV:
    """One layer's KV cache inside the compiled forward: whole buffers, rows written at an array offset."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array) -> None:
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.offset, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.offset, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None, **kwargs: Any) -> mx.array:
        if window_size is not None:  # only dense-KV targets are compiled (see `applies`)
            raise NotImplementedError("a sliding-window mask in a compiled forward")
        return key_buckets.visible(n, self.offset, self.keys.shape[2], self.keys.dtype)


class CompiledForward:
    """The compiled forward of one mlx-lm model over its list of plain (or key-bucketed) KV caches.

    Args:
        model: the mlx-lm module (its weights are constants of the graph: they never change at inference).
        start_recording: `layers` → the target's recorder, its layer taps armed for one traced forward (its
            `rows` then hold those layers' hidden states).
    """

    def __init__(self, model: Any, start_recording: Callable[[Sequence[int]], Any]) -> None:
        self._model = model
        self._start_recording = start_recording
        self._graphs: dict[tuple[int, ...], Any] = {}

    @staticmethod
    def applies(caches: Sequence[Any], rows: int) -> bool:
        """Whether a forward of `rows` rows over `caches` can run compiled (dense KV only: a verify, or a plain
        step); prefill chunks wider than `MAX_QUERY` stay eager."""
        return (
            0 < rows <= key_buckets.MAX_QUERY
            and bool(caches)
            and all(type(c) in _DENSE and c.keys is not None for c in caches)
        )

    def __call__(
        self, tokens: mx.array, caches: Sequence[Any], layers: Sequence[int]
    ) -> tuple[mx.array, list[mx.array]]:
        """Logits [1, n, V] of `tokens` [n] after the cached rows, and the hidden states [1, n, H] of `layers`
        (in that order); the caches then hold the n rows, as after an eager forward."""
        n = int(tokens.shape[0])
        offset = int(caches[0].offset)
        for c in caches:
            if offset + n > c.keys.shape[2]:
                c.keys, c.values = key_buckets.grown(c.keys, c.values, offset, offset + n)
        key = tuple(layers)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = mx.compile(self._traced(key, len(caches)))
        buffers = [a for c in caches for a in (c.keys, c.values)]
        logits, *rest = graph(tokens, mx.array([offset], dtype=mx.int32), *buffers)
        for i, c in enumerate(caches):
            c.keys, c.values = rest[2 * i], rest[2 * i + 1]
            c.offset = offset + n
        return logits, rest[2 * len(caches) :]

    def _traced(self, layers: tuple[int, ...], count: int) -> Callable[..., list[mx.array]]:
        model, start = self._model, self._start_recording

        def forward(tokens: mx.array, offset: mx.array, *buffers: mx.array) -> list[mx.array]:
            traced = [TracedKV(buffers[2 * i], buffers[2 * i + 1], offset) for i in range(count)]
            recorded = start(layers)
            logits = model(tokens[None], cache=traced)
            features = [recorded.rows.pop(i) for i in layers] if layers else []
            return [logits, *(a for c in traced for a in (c.keys, c.values)), *features]

        return forward
