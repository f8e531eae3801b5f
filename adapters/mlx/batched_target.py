"""BatchedPlainTarget: plain decoding of many requests in one forward over mlx-lm's batched KV cache.

Each row is prefilled alone (the same pieces, chunks and last-token forward as `MlxTargetModel.extend` and
`prefill`, so its first token is the solo one) into its own `KVCache` list; it then joins the shared `BatchKVCache`
(left-padded, with per-row masks and RoPE offsets) and every decode step runs all rows as one [B, 1]
forward. Finished rows are filtered out at once. Only dense KV targets batch: rotating (sliding-window)
and recurrent caches have no batched form here, so `batch_backend` returns None for them and they run
serially. On float32 CPU models the batched rows are bit-identical to solo decoding (tests check it);
reduced-precision matmuls on other devices may differ in the last bits (see architecture.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_dspark.adapters.mlx import caches as cache_ops
from mlx_dspark.adapters.mlx import cpu_kernels
from mlx_dspark.adapters.mlx.acceptance import pick_token
from mlx_dspark.adapters.mlx.target import MlxTargetModel, default_prefill_chunk
from mlx_dspark.domain.ports import TargetModel
from mlx_dspark.domain.tokens import SamplingParams


class _Row:
    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches
        self.pending: list[int] = []  # queued prompt tokens not yet prefilled
        self.joined = False


class BatchedPlainTarget:
    """Rows keyed by the caller's ids; prefill chunk by chunk, then batched one-token steps.

    A row's prompt comes in the pieces the serial target gets: `extend` pieces (queued by `feed`, run by
    `extend_step`), then the prompt's end (`feed`, then `prefill_step`), each cut into the same chunks.

    Args:
        model: the mlx-lm module (shared with the serial target: weights are not copied).
        serial: the one-request target over the same module, whose rows `adopt` moves into the batch.
        prefill_chunk: prompt tokens per prefill forward (the serial target's value, for identical sums).
    """

    def __init__(self, model: Any, *, prefill_chunk: int | None = None, serial: MlxTargetModel | None = None) -> None:
        self._model = model
        self._serial = serial
        self._chunk = prefill_chunk or default_prefill_chunk()
        self._rows: dict[int, _Row] = {}
        self._order: list[int] = []  # row ids in batch order
        self._batch: list[BatchKVCache] | None = None

    @property
    def width(self) -> int:
        """Rows in the decode batch."""
        return len(self._order)

    def feed(self, row: int, tokens: Sequence[int]) -> None:
        """Queue prompt tokens of `row` (starting the row): `extend_step` or `prefill_step` calls run them."""
        r = self._rows.get(row)
        if r is None:
            r = self._rows[row] = _Row(cache_ops.make_caches(self._model))
        elif r.joined:
            raise ValueError(f"row {row} is already in the batch")
        r.pending.extend(tokens)

    def extend_step(self, row: int) -> bool:
        """Run the next chunk of the row's queued tokens without logits (as `MlxTargetModel.extend`); True when
        none is left."""
        r = self._rows[row]
        piece, r.pending = r.pending[: self._chunk], r.pending[self._chunk :]
        if piece:
            self._row_forward(piece, r)
            mx.eval(cache_ops.cache_arrays(r.caches))
        return not r.pending

    def _row_forward(self, tokens: Sequence[int], r: _Row) -> mx.array:
        """One row's prompt chunk, through the same attention path as the serial target's."""
        with cpu_kernels.active():
            logits: mx.array = self._model(mx.array(list(tokens))[None], cache=r.caches)
        return logits

    def prefill_step(self, row: int, sampling: SamplingParams, uniform: float) -> int | None:
        """Run the next chunk of the prompt's end (`MlxTargetModel.prefill`); after the last one, the first token
        (then the row is in the batch)."""
        r = self._rows[row]
        if not r.pending:
            raise ValueError("prefill needs at least one token")
        if len(r.pending) > 1:
            body = len(r.pending) - 1
            piece, r.pending = r.pending[: min(self._chunk, body)], r.pending[min(self._chunk, body) :]
            self._row_forward(piece, r)
            mx.eval(cache_ops.cache_arrays(r.caches))
            return None
        logits = self._row_forward(r.pending, r)[0, -1]
        token = pick_token(logits, sampling, uniform)
        mx.eval(token)
        r.pending = []
        self._join(row, r)
        return int(cast(int, token.item()))

    def step(
        self, anchors: dict[int, int], sampling: dict[int, SamplingParams], uniforms: dict[int, float]
    ) -> dict[int, int]:
        """One token for every row in the batch, from its anchor (the last committed token)."""
        if set(anchors) != set(self._order):
            raise ValueError("a step needs exactly the rows in the batch")
        assert self._batch is not None
        tokens = mx.array([[anchors[r]] for r in self._order])
        logits = self._model(tokens, cache=self._batch)[:, -1]
        greedy = [i for i, r in enumerate(self._order) if sampling[r].greedy]
        picks: dict[int, mx.array] = {}
        if greedy:
            best = mx.argmax(logits[mx.array(greedy)], axis=-1)
            for j, i in enumerate(greedy):
                picks[i] = best[j]
        for i, r in enumerate(self._order):
            if i not in picks:  # the serial plain step's draw, so the same uniform picks the same token
                picks[i] = pick_token(logits[i], sampling[r], uniforms[r])
        out = mx.stack([picks[i].astype(mx.int32) for i in range(len(self._order))])
        mx.eval(out, cache_ops.cache_arrays(self._batch))
        values = cast(list[int], out.tolist())
        return {r: values[i] for i, r in enumerate(self._order)}

    def close(self, row: int) -> None:
        """Drop a row (finished, cancelled, or failed) at once."""
        self._rows.pop(row, None)
        if row not in self._order:
            return
        keep = [i for i, r in enumerate(self._order) if r != row]
        self._order = [self._order[i] for i in keep]
        if not keep:
            self._batch = None
            return
        assert self._batch is not None
        index = mx.array(keep)
        for c in self._batch:
            c.filter(index)

    def adopt(self, row: int) -> None:
        """Copy the serial target's cached rows into the batch as `row`; the serial target keeps its own."""
        if self._serial is None:
            raise RuntimeError("no serial target to adopt from")
        if row in self._rows:
            raise ValueError(f"row {row} is already open")
        # Its caches are plain KV (checked by batch_backend) and no verify is pending between two rounds; a
        # pipelined plain step queued ahead holds one row too many, so it is undone first.
        self._serial._drop_ahead()
        self._rows[row] = r = _Row(list(self._serial._caches))
        self._join(row, r)

    def _join(self, row: int, r: _Row) -> None:
        rows = [BatchKVCache.merge([c]) for c in r.caches]
        if self._batch is None:
            self._batch = rows
        else:
            for b, c in zip(self._batch, rows):
                b.extend(c)
        mx.eval(cache_ops.cache_arrays(self._batch))  # copies now: the rows' own caches may change later
        self._order.append(row)
        r.joined = True
        r.caches = []


def batch_backend(target: TargetModel) -> BatchedPlainTarget | None:
    """A batched backend for `target`, or None when its caches have no batched form (serial decoding)."""
    if not isinstance(target, MlxTargetModel):
        return None
    # The serial target's own settings (read, not changed: target.py stays one-request).
    kv_bits, chunk = target._kv_bits, target._prefill_chunk
    probe = cache_ops.make_caches(target.model, kv_bits)
    if not all(type(c) is KVCache for c in probe):
        return None
    return BatchedPlainTarget(target.model, prefill_chunk=chunk, serial=target)
