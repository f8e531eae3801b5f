"""BatchedPlainTarget: plain and speculative decoding of many requests in one forward over mlx-lm's batched
KV cache.

Each row is prefilled alone (the same pieces, chunks and last-token forward as `MlxTargetModel.extend` and
`prefill`, so its first token is the solo one) into its own `KVCache` list; it then joins the shared batch
cache (left-padded, with per-row masks and RoPE offsets) and every tick runs all rows as one [B, n]
forward: each row's anchor and drafts, right-padded to the longest block (a row's real tokens come before its
padding, so causal attention never lets them see it; rows never see each other). Each row's acceptance is
decided on its own logits by the serial target's functions. Rollback is per row: the columns no row keeps are
trimmed, and a row that keeps fewer than the longest keeper gets holes — columns masked out of every later
forward, its RoPE offset moved back to its real length — which are squeezed out once they add up.
Finished rows are filtered out at once. Dense KV targets batch plain and speculative decoding. Hybrid targets
with recurrent layers batch plain decoding only: those layers join through mlx-lm's own batched `ArraysCache`
(`merge`, `extend`, `filter`), and a plain tick keeps every row's one token, so no row ever needs the per-row
rollback a recurrent state lacks (`speculative` is False; a verify with drafts is refused). Rotating
(sliding-window) layers batch plain decoding too, each row keeping its own ring exactly as its lone cache
would (`_RingRows`): a shared batched ring would start each row at another phase, so attention would sum the
same terms in another order and round differently. On float32
CPU models the batched rows are bit-identical to solo decoding (tests check it); reduced-precision matmuls on
other devices may differ in the last bits, and on the CPU a wide solo verify at long context takes NumPy's
attention (`cpu_kernels`) while a batched verify keeps MLX's kernels, so a near tie can round differently
there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, cast

import attrs
import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, RotatingKVCache

from mlx_dspark.adapters.mlx import cache_state, cpu_kernels, key_buckets
from mlx_dspark.adapters.mlx import caches as cache_ops
from mlx_dspark.adapters.mlx.acceptance import accept_block, as_q_rows, pick_token
from mlx_dspark.adapters.mlx.target import MlxTargetModel, _Recorder, default_prefill_chunk
from mlx_dspark.domain.ports import TargetModel
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.greedy import longest_accepted_prefix
from mlx_dspark.domain.verification.outcome import Acceptance

_COMPACT_MIN = 32  # hole columns a row may carry before the batch is squeezed (and 1/4 of the columns)


class _Holes:
    """Columns of the batch cache that hold no row's real token (shared by every layer's cache), and whether its
    forwards attend over key buckets (`key_buckets`)."""

    def __init__(self, buckets: bool = False) -> None:
        self.alive: mx.array | None = None  # bool [B, n <= columns]; columns past n are alive; None: no holes
        self.most = 0  # hole columns of the row that has the most
        self.buckets = buckets

    def columns(self, width: int) -> mx.array | None:
        """alive padded (with True) to `width` columns, or None when there are no holes."""
        alive = self.alive
        if alive is None:
            return None
        n = int(alive.shape[1])
        if n < width:
            alive = mx.concatenate([alive, mx.ones((alive.shape[0], width - n), dtype=mx.bool_)], axis=1)
        return alive[:, :width]


class _HoleCache(BatchKVCache):  # type: ignore[misc]
    """mlx-lm's BatchKVCache whose mask also hides the batch's hole columns. With key buckets, forwards of up to
    `key_buckets.MAX_QUERY` rows (a batched mask is an array anyway, one-row steps included) attend over the
    whole buffer, grown in whole buckets, under a mask that also hides the columns not yet written."""

    holes: _Holes | None = None

    def _buckets(self) -> bool:
        return self.holes is not None and self.holes.buckets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self._idx, keys.shape[2]
        if self._buckets() and self.keys is not None and prev + n > self.keys.shape[2]:
            self.keys, self.values = key_buckets.grown(self.keys, self.values, prev, prev + n)
        exact = super().update_and_fetch(keys, values)
        if self._buckets() and key_buckets.armed(prev, n, self.keys.shape[2]):
            return self.keys, self.values
        return cast(tuple[mx.array, mx.array], exact)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        key_buckets.disarm()
        padded = (
            self._buckets() and self.keys is not None and N <= key_buckets.MAX_QUERY and not kwargs.get("window_size")
        )
        if padded:
            width = key_buckets.width_after(self.keys, self._idx + N)
            columns = mx.arange(width)
            mask = key_buckets.visible(N, self._idx, width, None) & (self.left_padding[:, None, None, None] <= columns)
        else:
            width = self._idx + N
            mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        alive = self.holes.columns(width) if self.holes is not None else None
        if alive is not None:
            mask = mask & alive[:, None, None, :]
        if not padded:
            return mask
        key_buckets.arm(self._idx, N, width)
        return key_buckets.additive(mask, self.keys.dtype)


class _RingRows:
    """A rotating (sliding-window) layer of batched rows for plain decoding: every row keeps its own
    `RotatingKVCache`, updated exactly as a lone request's is (growth, trim, rotation), so its keys keep their
    solo physical order; a step hands attention every row's keys right-padded to the longest, with a mask."""

    def __init__(self, rows: list[RotatingKVCache]) -> None:
        self.rows = rows

    @classmethod
    def merge(cls, caches: Sequence[RotatingKVCache]) -> _RingRows:
        copies = []
        for c in caches:  # own handles: the serial target's cache may go on without this row
            twin = RotatingKVCache(c.max_size, c.keep)
            twin.state = cache_ops.fresh_handles(c.state)
            copies.append(twin)
        return cls(copies)

    @property
    def offset(self) -> mx.array:
        return mx.array([r.offset for r in self.rows])

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> mx.array:
        if N != 1:
            raise ValueError("batched sliding-window rows decode one token a step")
        # Each row's keys after this step's update, and the mask its own cache would give (None: all of them).
        lengths = [min(r.offset + 1, r.max_size) for r in self.rows]
        width = max(lengths)
        masks = []
        for r, n in zip(self.rows, lengths, strict=True):
            own = r.make_mask(1, window_size=window_size)
            row = mx.ones((n,), dtype=mx.bool_) if own is None else own.astype(mx.bool_)
            masks.append(mx.concatenate([row, mx.zeros((width - n,), dtype=mx.bool_)]) if n < width else row)
        return mx.stack(masks)[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        ks, vs = [], []
        for i, r in enumerate(self.rows):
            k, v = r.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            ks.append(k)
            vs.append(v)
        width = max(k.shape[2] for k in ks)

        def padded(a: mx.array) -> mx.array:
            if a.shape[2] == width:
                return a
            pad = mx.zeros((*a.shape[:2], width - a.shape[2], a.shape[3]), dtype=a.dtype)
            return mx.concatenate([a, pad], axis=2)

        return mx.concatenate([padded(k) for k in ks]), mx.concatenate([padded(v) for v in vs])

    def filter(self, batch_indices: mx.array) -> None:
        self.rows = [self.rows[i] for i in cast(list[int], batch_indices.tolist())]

    def extend(self, other: _RingRows) -> None:
        self.rows.extend(other.rows)

    def arrays(self) -> list[mx.array]:
        return cache_ops.cache_arrays(list(self.rows))


@attrs.frozen
class RowVerify:
    """One row's part of a batched verify: [anchor, drafts...] with the drafts' q (None = one-hot)."""

    anchor: int
    drafts: tuple[int, ...]
    q: Any
    sampling: SamplingParams
    uniforms: tuple[float, ...]


class _Row:
    def __init__(self, caches: list[Any], capture: bool) -> None:
        self.caches = caches
        self.capture = capture  # records target features (a feature-reading drafter's row)
        self.pending: list[int] = []  # queued prompt tokens not yet prefilled
        self.joined = False
        self.features: list[mx.array] = []  # committed rows' features not yet taken


class BatchedPlainTarget:
    """Rows keyed by the caller's ids; prefill chunk by chunk, then batched verifies (a plain step is a verify
    of no drafts), each followed by one `commit` of every row.

    A row's prompt comes in the pieces the serial target gets: `extend` pieces (queued by `feed`, run by
    `extend_step`), then the prompt's end (`feed`, then `prefill_step`), each cut into the same chunks.

    Args:
        model: the mlx-lm module (shared with the serial target: weights are not copied).
        serial: the one-request target over the same module, whose rows `adopt` moves into the batch and whose
            layer taps record features for rows that capture them.
        prefill_chunk: prompt tokens per prefill forward (the serial target's value, for identical sums).
    """

    def __init__(
        self,
        model: Any,
        *,
        prefill_chunk: int | None = None,
        serial: MlxTargetModel | None = None,
        speculative: bool = True,
    ) -> None:
        self._model = model
        self._serial = serial
        self._chunk = prefill_chunk or default_prefill_chunk()
        self.speculative = speculative  # whether rows may verify drafts (dense KV layers only)
        self._buckets = serial._buckets if serial is not None else key_buckets.enabled()
        self._rows: dict[int, _Row] = {}
        self._order: list[int] = []  # row ids in batch order
        self._batch: list[BatchKVCache] | None = None
        self._holes = _Holes(self._buckets)
        self._recorder = _Recorder()
        self._pending: int | None = None  # the block width of the verify awaiting its commit
        self.compactions = 0

    @property
    def width(self) -> int:
        """Rows in the decode batch."""
        return len(self._order)

    def feed(self, row: int, tokens: Sequence[int], *, capture: bool = False) -> None:
        """Queue prompt tokens of `row` (starting the row): `extend_step` or `prefill_step` calls run them."""
        r = self._rows.get(row)
        if r is None:
            r = self._rows[row] = _Row(cache_ops.make_caches(self._model), capture and self._captures)
        elif r.joined:
            raise ValueError(f"row {row} is already in the batch")
        else:  # a row that started from a saved state: whether it captures is known now
            r.capture = capture and self._captures
        r.pending.extend(tokens)

    # Prefix-cache states of dense rows: a row loads one before its prompt, and saves its rows from the batch.

    @property
    def state_tag(self) -> str:
        """The serial target's state tag when rows can load and save states ("": they cannot)."""
        return self._serial.state_tag if self._serial is not None and self.speculative else ""

    def load_row(self, row: int, state: Any, keep: int) -> int:
        """Start `row` from `state` cut to `keep` rows (its features too); 0 when that is not exact."""
        if row in self._rows:
            raise ValueError(f"row {row} is already open")
        fresh = cache_ops.make_caches(self._model)
        if (
            not isinstance(state, cache_state.MlxCacheState)
            or not self.state_tag
            or state.tag != self.state_tag
            or not 0 < keep <= state.length
            or not cache_state.load(state, fresh, keep)
        ):
            return 0
        r = self._rows[row] = _Row(fresh, self._captures)
        if state.features is not None:
            r.features = [state.features[:keep]]
        return keep

    def keep_loaded(self, row: int, keep: int, *, capture: bool) -> int:
        """Cut a row that `load_row` started, before its prompt, to its first `keep` rows; with `capture`, also
        to the rows the state had features for (the serial target's `reset` rule: a drafter never starts
        without the context of rows it was given). Returns the rows kept; at 0 the row is gone, as never
        loaded, and `feed` starts it fresh."""
        r = self._rows[row]
        if r.joined or r.pending:
            raise RuntimeError(f"row {row} is under way")
        covered = int(r.features[0].shape[0]) if r.features else 0
        if capture and self._captures:
            keep = min(keep, covered)
        have = r.caches[0].offset if r.caches else 0
        keep = max(0, min(keep, have))
        if keep == 0 or not cache_ops.can_cut(r.caches, have - keep):
            del self._rows[row]
            return 0
        cache_ops.cut(r.caches, have - keep)
        r.features = [r.features[0][:keep]] if covered else []
        return keep

    def row_state(self, row: int, tokens: tuple[int, ...], features: mx.array | None) -> Any:
        """A state of `row`'s cached rows (`tokens`, and the features of all of them or None), copied out of
        the batch with its holes left out; None when the row does not hold exactly those rows."""
        if self._pending is not None:
            raise RuntimeError("row_state while a verify awaits its commit")
        r = self._rows[row]
        if not r.joined:
            caches = r.caches
        else:
            assert self._batch is not None
            i = self._order.index(row)
            first = self._batch[0]
            pad = int(cast(int, first.left_padding[i].item()))
            columns = mx.arange(pad, first._idx)
            alive = self._holes.columns(first._idx)
            if alive is not None:
                live = cast(list[bool], alive[i].tolist())
                columns = mx.array([j for j in range(pad, first._idx) if live[j]], dtype=mx.int32)
            caches = []
            for c in self._batch:
                one = KVCache()
                one.keys = mx.take(c.keys[i : i + 1, :, : first._idx], columns, axis=2)
                one.values = mx.take(c.values[i : i + 1, :, : first._idx], columns, axis=2)
                one.offset = int(columns.shape[0])
                caches.append(one)
            mx.eval(cache_ops.cache_arrays(caches))
        if not caches or caches[0].offset != len(tokens):
            return None  # not the rows its caller counts (a piece still under way): no state
        if features is not None and int(features.shape[0]) != len(tokens):
            features = None  # a drafter loading it starts without this context (as after a gap)
        return cache_state.save(caches, tag=self.state_tag, tokens=tokens, features=features)

    @property
    def _captures(self) -> bool:
        return self._serial is not None and bool(self._serial.capture_layers)

    def extend_step(self, row: int) -> bool:
        """Run the next chunk of the row's queued tokens without logits (as `MlxTargetModel.extend`); True when
        none is left."""
        r = self._rows[row]
        piece, r.pending = r.pending[: self._chunk], r.pending[self._chunk :]
        if piece:
            self._row_forward(piece, r)
            mx.eval(cache_ops.cache_arrays(r.caches), r.features[-1:] if r.capture else [])
        return not r.pending

    def _forward(
        self, tokens: mx.array, caches: list[Any], record: bool, *, kernels: bool = True
    ) -> tuple[mx.array, mx.array | None]:
        """tokens [B, n] after `caches`; with `record`, the serial target's taps give [B, n, C] features.

        `kernels`: the CPU wrappers' wide paths (a row's prompt chunk, as the serial prefill). A batched verify
        keeps MLX's own kernels: their rule looks at the whole [B, n] forward, so a row would otherwise round
        differently from its solo verify (which stays on MLX below long contexts) as the batch grows.
        """
        serial = self._serial
        scope = cpu_kernels.active() if kernels else contextlib.nullcontext()
        if not record or serial is None:
            try:
                with scope:
                    return self._model(tokens, cache=caches), None
            finally:
                key_buckets.disarm()
        rec = self._recorder
        rec.wanted = frozenset(serial.capture_layers)
        rec.rows = {}
        serial._hub.recorder = rec
        rec.active = True
        try:
            with scope:
                logits = self._model(tokens, cache=caches)
        finally:
            rec.active = False
            key_buckets.disarm()
        parts = [rec.rows[i] for i in serial.capture_layers]
        rec.rows = {}
        return logits, parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def _row_forward(self, tokens: Sequence[int], r: _Row) -> mx.array:
        """One row's prompt chunk, through the same attention path as the serial target's."""
        logits, features = self._forward(mx.array(list(tokens))[None], r.caches, r.capture)
        if features is not None:
            r.features.append(features[0])
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
            mx.eval(cache_ops.cache_arrays(r.caches), r.features[-1:] if r.capture else [])
            return None
        logits = self._row_forward(r.pending, r)[0, -1]
        token = pick_token(logits, sampling, uniform)
        mx.eval(token, r.features[-1:] if r.capture else [])
        r.pending = []
        self._join(row, r)
        return int(cast(int, token.item()))

    def row_verify(
        self, anchor: int, drafts: tuple[int, ...], q: Any, sampling: SamplingParams, uniforms: tuple[float, ...]
    ) -> RowVerify:
        return RowVerify(anchor, tuple(drafts), q, sampling, tuple(uniforms))

    def verify(self, calls: dict[int, RowVerify]) -> dict[int, tuple[Acceptance, mx.array | None]]:
        """Every row's [anchor, drafts...] in one forward; each row's verdict on its own logits, with the
        verified rows' features [n, C] when the row records them.

        The rows stay pending until `commit` says how many of each row's verified rows to keep.
        """
        if set(calls) != set(self._order):
            raise ValueError("a verify needs exactly the rows in the batch")
        if self._pending is not None:
            raise RuntimeError("verify while the previous verify awaits its commit")
        assert self._batch is not None
        order = self._order
        n = 1 + max(len(calls[r].drafts) for r in order)
        if n > 1 and not self.speculative:
            raise ValueError("this target's batched rows decode plainly: its caches cannot roll back one row")
        # Padding repeats the anchor: its rows come after the row's real ones and are never kept.
        tokens = mx.array([[c.anchor, *c.drafts] + [c.anchor] * (n - 1 - len(c.drafts)) for c in map(calls.get, order)])
        record = any(self._rows[r].capture for r in order)
        logits, features = self._forward(tokens, self._batch, record, kernels=False)
        greedy = [i for i, r in enumerate(order) if calls[r].sampling.greedy]
        out: list[mx.array] = []
        if greedy:
            out.append(mx.argmax(logits[mx.array(greedy)], axis=-1).astype(mx.int32).reshape(-1))
        sampled: list[int] = []
        for i, r in enumerate(order):
            c = calls[r]
            if c.sampling.greedy:
                continue
            sampled.append(i)
            k = len(c.drafts)
            if k == 0:  # the serial plain step's draw, so the same uniform picks the same token
                out.append(mx.stack([mx.array(0, mx.int32), pick_token(logits[i, 0], c.sampling, c.uniforms[0])]))
            else:
                out.append(
                    accept_block(
                        logits[i, : k + 1],
                        mx.array(list(c.drafts), dtype=mx.int32),
                        as_q_rows(c.q, k),
                        mx.array(list(c.uniforms[: k + 1]), dtype=mx.float32),
                        c.sampling,
                    ).astype(mx.int32)
                )
        flat = mx.concatenate(out) if len(out) > 1 else out[0]
        mx.eval(flat, _arrays(self._batch), [] if features is None else features)
        values = cast(list[int], flat.tolist())
        verdicts: dict[int, Acceptance] = {}
        for j, i in enumerate(greedy):
            c = calls[order[i]]
            best = values[j * n : j * n + len(c.drafts) + 1]
            verdicts[order[i]] = longest_accepted_prefix(c.drafts, best)
        base = len(greedy) * n
        for j, i in enumerate(sampled):
            accepted, next_token = values[base + 2 * j : base + 2 * j + 2]
            verdicts[order[i]] = Acceptance(accepted=accepted, next_token=next_token)
        self._pending = n
        return {
            r: (verdicts[r], features[i] if features is not None and self._rows[r].capture else None)
            for i, r in enumerate(order)
        }

    def commit(self, keep: dict[int, int]) -> None:
        """Keep the first `keep[row]` verified rows of every row of the last verify; the rest become holes."""
        if self._pending is None:
            raise RuntimeError("commit without a verify")
        n, self._pending = self._pending, None
        if set(keep) != set(self._order):
            raise ValueError("a commit needs exactly the rows in the batch")
        kept = [keep[r] for r in self._order]
        if any(not 0 <= k <= n for k in kept):
            raise ValueError(f"keep rows must be in [0, {n}], got {kept}")
        if not self._order:
            return
        assert self._batch is not None
        most = max(kept)
        if n > most:
            for c in self._batch:
                c.trim(n - most)
        short = [most - k for k in kept]
        if not any(short):
            return
        idx = self._batch[0]._idx
        shift = mx.array(short)
        for c in self._batch:
            c.offset = c.offset - shift
        # Row i's last short[i] columns hold rejected rows: dead from now on.
        dead = mx.arange(idx)[None, :] >= (idx - shift)[:, None]
        alive = self._holes.columns(idx)
        self._holes.alive = ~dead if alive is None else alive & ~dead
        self._holes.most += max(short)
        if self._holes.most > max(_COMPACT_MIN, idx // 4):
            self._compact()

    def take_features(self, row: int, *, peek: bool = False) -> list[mx.array]:
        """Features of the row's prompt chunks since the last call, in position order (`peek`: and keep them)."""
        r = self._rows.get(row)
        if r is None:
            return []
        out = list(r.features)
        if not peek:
            r.features = []
        return out

    def join_features(self, chunks: Sequence[tuple[mx.array, int | None]]) -> mx.array | None:
        """One float32 [rows, C] array (as `MlxTargetModel.take_features`) of (features, rows kept) chunks."""
        parts = [a if k is None else a[:k] for a, k in chunks]
        parts = [p for p in parts if int(p.shape[0])]
        if not parts:
            return None
        rows = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        return rows.astype(mx.float32)

    def _compact(self) -> None:
        """Squeeze the holes out: every row's live columns, left-padded to the longest (exact: a copy)."""
        assert self._batch is not None and self._holes.alive is not None
        first = self._batch[0]
        idx = first._idx
        alive = self._holes.columns(idx)
        assert alive is not None
        pad = cast(list[int], first.left_padding.tolist())
        live = cast(list[list[bool]], alive.tolist())
        columns = [[j for j in range(pad[i], idx) if live[i][j]] for i in range(len(pad))]
        width = max(len(c) for c in columns)
        gather = mx.array([[0] * (width - len(c)) + c for c in columns], dtype=mx.int32)
        left = mx.array([width - len(c) for c in columns])
        for c in self._batch:
            index = gather[:, None, :, None]
            c.keys = mx.take_along_axis(c.keys[..., :idx, :], index, axis=2)
            c.values = mx.take_along_axis(c.values[..., :idx, :], index, axis=2)
            c._idx = width
            c.left_padding = left
        mx.eval(_arrays(self._batch))
        self._holes.alive = None
        self._holes.most = 0
        self.compactions += 1

    def step(
        self, anchors: dict[int, int], sampling: dict[int, SamplingParams], uniforms: dict[int, float]
    ) -> dict[int, int]:
        """One plain token for every row in the batch, from its anchor (the last committed token)."""
        verdicts = self.verify({r: RowVerify(anchors[r], (), None, sampling[r], (uniforms[r],)) for r in anchors})
        self.commit({r: 1 for r in anchors})
        return {r: v.next_token for r, (v, _) in verdicts.items()}

    def close(self, row: int) -> None:
        """Drop a row (finished, cancelled, or failed) at once."""
        self._rows.pop(row, None)
        if row not in self._order:
            return
        keep = [i for i, r in enumerate(self._order) if r != row]
        self._order = [self._order[i] for i in keep]
        if not keep:
            self._batch = None
            self._holes = _Holes(self._buckets)
            self._pending = None
            return
        assert self._batch is not None
        index = mx.array(keep)
        before = self._batch[0]._idx if self._holes.alive is not None else 0
        for c in self._batch:
            c.filter(index)
        if self._holes.alive is not None:  # filter shifted the columns left by the padding no row needs now
            alive = self._holes.columns(before)
            assert alive is not None
            self._holes.alive = alive[index][:, before - self._batch[0]._idx :]

    def adopt(self, row: int, *, capture: bool = False) -> None:
        """Copy the serial target's cached rows into the batch as `row`; the serial target keeps its own."""
        if self._serial is None:
            raise RuntimeError("no serial target to adopt from")
        if row in self._rows:
            raise ValueError(f"row {row} is already open")
        # Its caches are plain KV (checked by batch_backend) and no verify is pending between two rounds; a
        # pipelined plain step queued ahead holds one row too many, so it is undone first.
        self._serial._drop_ahead()
        self._rows[row] = r = _Row(list(self._serial._caches), capture and self._captures)
        self._join(row, r)

    def _join(self, row: int, r: _Row) -> None:
        if self._pending is not None:
            raise RuntimeError("a row joins while a verify awaits its commit")
        rows = [_joined(c) for c in r.caches]
        if self._batch is None:
            self._batch = rows
            for c in rows:
                c.holes = self._holes
        else:
            holes = self._holes.alive is not None
            before = self._batch[0]._idx if holes else 0
            for b, c in zip(self._batch, rows):
                b.extend(c)
            after = self._batch[0]._idx if holes else 0
            alive = self._holes.columns(before)
            if alive is not None:  # extend left-padded the older rows by the newcomer's extra columns
                older = mx.concatenate([mx.ones((alive.shape[0], after - before), dtype=mx.bool_), alive], axis=1)
                self._holes.alive = mx.concatenate([older, mx.ones((1, after), dtype=mx.bool_)], axis=0)
        mx.eval(_arrays(self._batch))  # copies now: the rows' own caches may change later
        self._order.append(row)
        r.joined = True
        r.caches = []


_BATCHED_FORM = (KVCache, RotatingKVCache, ArraysCache)  # caches whose rows join a batch exactly


def _joined(cache: Any) -> Any:
    """One row's cache as a batch of one: dense KV hole-aware, a sliding window as its own ring, a recurrent
    state through mlx-lm's own batched `ArraysCache`."""
    if isinstance(cache, KVCache):  # the serial target's key-bucketed caches too
        return _HoleCache.merge([cache])
    if type(cache) is RotatingKVCache:
        return _RingRows.merge([cache])
    return type(cache).merge([cache])


def _arrays(batch: list[Any]) -> list[mx.array]:
    """Every array holding a batch's state (for `mx.eval`)."""
    out: list[mx.array] = []
    for c in batch:
        out.extend(c.arrays() if isinstance(c, _RingRows) else cache_ops.cache_arrays([c]))
    return out


def batch_backend(target: TargetModel) -> BatchedPlainTarget | None:
    """A batched backend for `target`, or None when its caches have no exact batched form (serial decoding):
    dense KV batches plain and speculative decoding, sliding-window and recurrent layers beside it plain decoding."""
    if not isinstance(target, MlxTargetModel):
        return None
    # The serial target's own settings (read, not changed: target.py stays one-request).
    kv_bits, chunk = target._kv_bits, target._prefill_chunk
    probe = cache_ops.make_caches(target.model, kv_bits)
    if not all(type(c) in _BATCHED_FORM for c in probe):  # quantized KV, nested caches: one request at a time
        return None
    dense = all(type(c) is KVCache for c in probe)
    return BatchedPlainTarget(target.model, prefill_chunk=chunk, serial=target, speculative=dense)
