"""The MLX target as the step engine's rows: a lone request on the serial target (its fast paths: the queued
plain step, prefix reuse of live rows, snapshots), more than one in the batched target (`batched_target.py`).

A row opened while no other row is open runs on the serial target. Once another row is open, it moves into the
batch at its next verify (between two rounds, so its cache is whole): its cached rows are copied in, and the
features it committed there that no drafter has read yet go with it. Rows opened beside others start in the
batch: their prompt pieces are prefilled one chunk per step (so a long prompt never stalls the rows that
decode), and a dense row may start from a saved prefix-cache state and save its rows out of the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlx_dspark.adapters.mlx.batched_target import BatchedPlainTarget, batch_backend
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.domain.decoder import Prefill, Verify
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.ports import RollbackKind, TargetModel
from mlx_dspark.domain.verification.outcome import Acceptance

_CAPACITY = 64  # rows open at once (the engine's max_batch is the real bound)


class MlxRow:
    """One request's row: the TargetModel bookkeeping over the serial target while alone, over the batch after."""

    def __init__(self, rows: MlxRows, rid: int, solo: MlxTargetModel | None) -> None:
        self._rows = rows
        self.id = rid
        self.solo = solo
        self._ids: list[int] = []
        self._features: list[tuple[mx.array, int | None]] = []  # committed rows' features not yet taken
        self._taken: list[tuple[mx.array, int | None]] = []  # every features chunk handed out (a saved state's)
        self._verified: tuple[int, DraftBlock, mx.array | None] | None = None  # awaiting its commit
        self.capture = False  # whether this request reads target features (set by reset)
        self.fed: Prefill | None = None  # the prompt piece under way (the batch holds it, or the serial target)
        self.fed_at = 0  # tokens of it a lone row has prefilled
        self._loaded = False  # holds a loaded state's rows that `reset` has not yet cut to what it keeps

    def to_batched(self, read: Any, unread: Any) -> None:
        """The row now lives in the batch; its cached ids are the serial target's, `read` the features of rows
        its drafter already took there (its saved states keep them) and `unread` those it has not yet."""
        assert self.solo is not None
        self._ids = list(self.solo.cached_ids)
        self.solo = None
        if read is not None:
            self._taken.append((read, None))
        if unread is not None:
            self._features.append((unread, None))

    @property
    def vocab_size(self) -> int:
        return self._rows.serial.vocab_size

    @property
    def rollback_kind(self) -> RollbackKind:
        return self.solo.rollback_kind if self.solo is not None else RollbackKind.TRIM

    @property
    def cached_tokens(self) -> int:
        return self.solo.cached_tokens if self.solo is not None else len(self._ids)

    @property
    def cached_ids(self) -> tuple[int, ...]:
        return tuple(self.solo.cached_ids) if self.solo is not None else tuple(self._ids)

    def reset(self, keep: int = 0, *, capture: bool = True) -> int:
        self.capture = capture
        if self.solo is not None:
            return self.solo.reset(keep, capture=capture)
        if not self._loaded:
            if self._ids and keep != len(self._ids):
                raise RuntimeError("a batched row decodes one request")
            return len(self._ids) if keep else 0
        if keep > len(self._ids):
            raise RuntimeError("a batched row decodes one request")
        # The rows a loaded state gave it (the prefix cache's), cut as the serial target cuts its own.
        self._loaded = False
        kept = self._rows.batch.keep_loaded(self.id, keep, capture=capture)
        del self._ids[kept:]
        return kept

    def take_features(self) -> Any:
        if self.solo is not None:
            return self.solo.take_features()
        if not self.capture:
            return None
        batch = self._rows.batch
        chunks = [(a, None) for a in batch.take_features(self.id)] + self._features
        self._features = []
        self._taken.extend(chunks)
        return batch.join_features(chunks)

    # Prefix-cache states: a lone row's are the serial target's; a batched row of a dense target loads a state
    # before its prompt and saves its rows out of the batch.

    @property
    def state_tag(self) -> str:
        return self.solo.state_tag if self.solo is not None else self._rows.batch.state_tag

    def save_state(self) -> Any:
        if self.solo is not None:
            return self.solo.save_state()
        batch = self._rows.batch
        if not batch.state_tag:
            raise RuntimeError("this target's batched rows have no state to save")
        features = None
        if self.capture:  # every row's features: those handed out, then those still waiting
            waiting = [(a, None) for a in batch.take_features(self.id, peek=True)] + self._features
            features = batch.join_features(self._taken + waiting)
        return batch.row_state(self.id, tuple(self._ids), features)

    def load_state(self, state: Any, keep: int) -> int:
        if self.solo is not None:
            return self.solo.load_state(state, keep)
        batch = self._rows.batch
        if self._ids or not batch.state_tag:
            return 0
        kept = batch.load_row(self.id, state, keep)
        if kept:
            self._ids = list(state.tokens[:kept])
            self._loaded = True
        return kept


class MlxRows:
    """The RowsBackend over one MLX target: the serial target for a lone row, the batch for more."""

    def __init__(self, serial: MlxTargetModel, batch: BatchedPlainTarget) -> None:
        self.serial = serial
        self.batch = batch
        self._open: list[MlxRow] = []
        self._next = 0
        self.migrations = 0  # lone rows moved into the batch

    @property
    def capacity(self) -> int:
        return _CAPACITY

    @property
    def speculative(self) -> bool:
        return bool(self.batch.speculative)

    @property
    def stats(self) -> Mapping[str, int]:
        return {"migrations": self.migrations, "compactions": self.batch.compactions}

    def open(self) -> MlxRow:
        alone = not self._open
        row = MlxRow(self, self._next, self.serial if alone else None)
        self._next += 1
        self._open.append(row)
        return row

    def close(self, row: Any) -> None:
        assert isinstance(row, MlxRow)
        self.batch.close(row.id)
        if row in self._open:
            self._open.remove(row)

    def prefill(self, row: Any, piece: Prefill) -> tuple[bool, int | None]:
        assert isinstance(row, MlxRow)
        if row.solo is not None:
            return self._solo_prefill(row, row.solo, piece)
        if row.fed is not piece:
            self.batch.feed(row.id, piece.tokens, capture=row.capture)
            row.fed = piece
        if piece.last:  # the prompt's end: done with the first token
            token = self.batch.prefill_step(row.id, piece.sampling, piece.uniform)
            done = token is not None
        else:
            token, done = None, self.batch.extend_step(row.id)
        if done:
            row.fed = None
            row._ids.extend(piece.tokens)
        return done, token

    def _solo_prefill(self, row: MlxRow, serial: MlxTargetModel, piece: Prefill) -> tuple[bool, int | None]:
        """One chunk of `piece` on the serial target, cut where its own prefill cuts (the same forwards, so the
        same sums): the body's chunks from its start, the rest with the prompt's last token at the end."""
        if row.fed is not piece:
            row.fed, row.fed_at = piece, 0
        chunk = serial._prefill_chunk
        rest = piece.tokens[row.fed_at :]
        body = len(rest) - 1 if piece.last else len(rest)
        if body > chunk:
            serial.extend(rest[:chunk])
            row.fed_at += chunk
            return False, None
        row.fed = None
        if piece.last:
            return True, serial.prefill(rest, piece.sampling, piece.uniform)
        serial.extend(rest)
        return True, None

    def _migrate(self, row: MlxRow) -> None:
        """Move a lone row into the batch now that another row is open (it is between two rounds)."""
        serial = row.solo
        assert serial is not None
        self.batch.adopt(row.id, capture=row.capture)
        row.to_batched(*(serial.hand_over_features() if row.capture else (None, None)))
        self.migrations += 1

    def verify(self, calls: Mapping[Any, Verify]) -> dict[Any, Acceptance]:
        rows = [r for r in calls if isinstance(r, MlxRow)]
        for row in rows:
            if row.solo is not None and len(self._open) > 1:
                self._migrate(row)
        solo = [r for r in rows if r.solo is not None]
        if solo:
            ((row, call),) = calls.items()  # a lone row verifies alone
            return {row: row.solo.verify(call.anchor, call.block, call.sampling, call.uniforms, ahead=call.ahead)}
        batch = self.batch
        verdicts = batch.verify(
            {
                r.id: batch.row_verify(c.anchor, c.block.tokens, c.block.q, c.sampling, c.uniforms)
                for r, c in calls.items()
            }
        )
        out: dict[Any, Acceptance] = {}
        for r, c in calls.items():
            acceptance, features = verdicts[r.id]
            r._verified = (c.anchor, c.block, features)
            out[r] = acceptance
        return out

    def commit(self, keep: Mapping[Any, int]) -> None:
        batched: dict[int, int] = {}
        for r, k in keep.items():
            if r.solo is not None:
                r.solo.commit(k)
                continue
            pending, r._verified = r._verified, None
            assert pending is not None
            anchor, block, features = pending
            if k == 0 and not self.batch.speculative:
                # A row ending on an EOS keeps no verified row, but a ring or a recurrent state cannot drop one:
                # it keeps its anchor's (a committed token's, so the cache is still exactly its tokens').
                k = 1
            r._ids.extend([anchor, *block.tokens][:k])  # drafts still on the device are read now, after the verify
            if features is not None and k:
                r._features.append((features, k))
            batched[r.id] = k
        if batched:
            self.batch.commit(batched)


def mlx_rows(target: TargetModel, speculative: bool) -> MlxRows | None:
    """The batched rows of `target`, or None when it has none for this use (no batched form of its caches, or
    rows that must verify drafts over caches that batch plain decoding only): then one request at a time."""
    batch = batch_backend(target)
    if batch is None or (speculative and not batch.speculative):
        return None
    assert isinstance(target, MlxTargetModel)
    return MlxRows(target, batch)


__all__ = ["MlxRow", "MlxRows", "mlx_rows"]
