"""The one decode loop every mode runs, as a state machine: prefill, then rounds of draft → verify → accept →
commit/rollback.

A `RequestDecoder` never calls the model's forwards itself. `work()` says what the request needs next — a
prompt piece (`Prefill`), a draft (`Draft`) or a verify (`Verify`) — and whoever runs the model (the step
engine, over one row or many) feeds the result back with `advance()`; the decoder emits its events to the
caller's sink as they happen. Its bookkeeping calls on its row (reset, features, cached length) are direct.

Plain decoding is this loop with no draft source (cap 0), so budget, stop and sampling rules are the same in
every mode by construction. When the next round is known to be another plain step, the verify carries that
step's uniform (`ahead`), so a target can queue it before the host reads the current token; uniforms are
drawn in the same order either way. A selection may carry a SourceSwitcher (auto mode): after each round it
may hand over to another source; the target verifies every round, so a switch never changes output.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from mlx_dspark.domain.budget import plan_commit, round_cap
from mlx_dspark.domain.costmodel.acceptance import AcceptanceStats
from mlx_dspark.domain.costmodel.draft_cap import CapPolicy, FixedCap
from mlx_dspark.domain.drafting.block import EMPTY_BLOCK, DraftBlock, DraftContext
from mlx_dspark.domain.drafting.selection import PLAIN, Selection, SourceSwitcher
from mlx_dspark.domain.errors import ContextTooLong, InvalidRequest
from mlx_dspark.domain.events import (
    CapChanged,
    DecodeEvent,
    Finished,
    PrefillProgress,
    RoundFinished,
    TokensCommitted,
    Usage,
)
from mlx_dspark.domain.ports import Clock, DraftSource
from mlx_dspark.domain.tokens import FinishReason, SamplingParams, StopRule
from mlx_dspark.domain.verification.outcome import Acceptance

PROGRESS_EVERY = 1024  # prompt tokens between progress events (and the longest prompt piece)


@attrs.frozen
class Prefill:
    """Put `tokens` in the row's cache; `last`: they end the prompt, and the result is the first token."""

    tokens: tuple[int, ...]
    last: bool
    sampling: SamplingParams
    uniform: float


@attrs.frozen
class Draft:
    """Ask the request's draft `source` (its own fork) for up to `cap` tokens after `ctx`."""

    source: DraftSource
    ctx: DraftContext
    cap: int
    sampling: SamplingParams
    uniforms: tuple[float, ...]


@attrs.frozen
class Verify:
    """One forward of [anchor, block...] and its verdict; `ahead`: the next plain step's uniform, when known."""

    anchor: int
    block: DraftBlock
    sampling: SamplingParams
    uniforms: tuple[float, ...]
    ahead: float | None = None


Work = Prefill | Draft | Verify


class DecodeRow(Protocol):
    """What the decoder itself asks of its row of the target (the forwards are the engine's)."""

    @property
    def cached_tokens(self) -> int: ...

    def reset(self, keep: int = 0, *, capture: bool = True) -> int: ...

    def take_features(self) -> Any: ...


def _policy(selection: Selection) -> CapPolicy:
    if selection.source is None:
        return FixedCap(0)
    return selection.policy or FixedCap(selection.source.max_block)


def prefill_pieces(total: int, start: int, snapshots: Sequence[int], every: int) -> tuple[list[int], bool]:
    """Where the prompt's prefill hands control back (piece ends before the prompt's end), and whether it
    reports progress: every `every` tokens of a long prefill and at each snapshot point."""
    points = {p for p in snapshots if start < p <= total}
    report = total - start > every
    stops = points | (set(range(start + every, total, every)) if report else set())
    return sorted(s for s in stops if s < total), report


class _Features:
    """Target features taken this request, so a feature-reading source that switches back in catches up.

    `take_features` hands each row out once; while another feature reader runs, the rows it takes are
    kept here (opaque handles, in order) and replayed to a returning source before its next draft.
    """

    def __init__(self, row: DecodeRow, keep: bool) -> None:
        self._row = row
        self._keep = keep
        self._chunks: list[tuple[int, Any]] = []  # (position the rows end at, features)
        self._read: dict[int, int] = {}  # id(source) -> chunks it has seen

    def for_round(self, source: DraftSource, position: int, history: Sequence[int], sampling: SamplingParams) -> Any:
        if self._keep:
            for end, rows in self._chunks[self._read.get(id(source), 0) :]:
                ctx = DraftContext(anchor=history[end], position=end, history=history[: end + 1], features=rows)
                source.propose(ctx, 0, sampling, ())  # cap 0: only takes the rows in
        features = self._row.take_features()
        if self._keep:
            self._chunks.append((position, features))
            self._read[id(source)] = len(self._chunks)
        return features


class RequestDecoder:
    """One request's decode loop; `work()` / `advance()` until `finished`.

    Args:
        row: the request's row of the target (bookkeeping; its forwards come as `work()`).
        prompt: prompt token ids (at least one).
        sampling: temperature, truncation and seed.
        stop: max_tokens and EOS ids.
        clock: monotonic time source.
        emit: receives every event as it happens (PrefillProgress, TokensCommitted, RoundFinished,
            CapChanged, SourceSwitched, then exactly one Finished).
        selection: the selector's choice; its `switcher` (if any) may move the request to another source
            between rounds.
        reuse_prefix: leading prompt tokens whose rows are already in the row's cache.
        context_window: the target's context length, enforced before every round.
        halt: asked before every round and after the prefill; True ends the request as STOP_SEQUENCE (the
            caller saw a stop string in what was emitted), with the real accounting in Finished.
        snapshots: prompt lengths at which `on_snapshot` saves the row's state during prefill.
        on_snapshot: called when the cache holds exactly a snapshot point's rows.

    Raises (at construction):
        InvalidRequest: the prompt is empty.
        ContextTooLong: the prompt does not fit the context window.
    """

    def __init__(
        self,
        row: DecodeRow,
        prompt: Sequence[int],
        sampling: SamplingParams,
        stop: StopRule,
        clock: Clock,
        emit: Callable[[DecodeEvent], None],
        *,
        selection: Selection,
        reuse_prefix: int = 0,
        context_window: int | None = None,
        halt: Callable[[], bool] | None = None,
        snapshots: Sequence[int] = (),
        on_snapshot: Callable[[], object] | None = None,
        progress_every: int | None = None,
    ) -> None:
        if not prompt:
            raise InvalidRequest(message="the prompt is empty", param="prompt")
        if context_window is not None and len(prompt) >= context_window:
            raise ContextTooLong(
                message=f"prompt of {len(prompt)} tokens does not fit the context window of {context_window}",
                limit=context_window,
                requested=len(prompt),
            )
        self._row = row
        self._prompt = list(prompt)
        self._sampling = sampling
        self._stop = stop
        self._clock = clock
        self._emit = emit
        self._window = context_window
        self._halt = halt
        self._on_snapshot = on_snapshot
        self._rng = random.Random(sampling.seed)
        self._current = selection
        self._switcher: SourceSwitcher | None = selection.switcher
        self._policy = _policy(selection)
        self._begun: set[int] = set()
        if selection.source is not None:
            selection.source.begin(self._prompt)
            self._begun.add(id(selection.source))
        self._features = _Features(row, keep=self._switcher is not None)
        # A switcher may move the request to a feature drafter later: capture from the start then.
        wants = self._switcher is not None or (selection.source is not None and selection.source.uses_features)
        self._reuse = row.reset(keep=max(0, min(reuse_prefix, len(prompt) - 1)), capture=wants)
        self._start = clock.now()
        self._prefill_s = 0.0
        self._decode_start: float | None = None
        total = len(self._prompt)
        every = progress_every or PROGRESS_EVERY
        self._pieces, self._report = prefill_pieces(total, self._reuse, snapshots, every)
        self._points = {p for p in snapshots if self._reuse < p <= total}
        self._pos = self._reuse
        self._first_uniform = self._rng.random()
        self._history = list(self._prompt)
        self._stats = AcceptanceStats()
        self._generated = 0
        self._index = 0
        self._queued: float | None = None  # the uniform of a plain step the target may already have queued
        self._round_start = 0.0
        self._work: Work | None = self._next_piece()
        self._round: tuple[int, float, int] | None = None  # (cap, round start, depth) of the round under way
        self._block: DraftBlock = EMPTY_BLOCK
        self._t1 = 0.0
        self._pending: FinishReason | None = None  # the last round's finish, settled before the next round
        self._after: tuple[int, int, int] | None = None  # the last round's (produced, drafted, depth) for auto
        self.finished: Finished | None = None

    # ---- what the engine asks ---------------------------------------------------------------------------

    @property
    def row(self) -> DecodeRow:
        return self._row

    @property
    def depth(self) -> int:
        """Rows in the request's cache now."""
        return self._row.cached_tokens

    def work(self) -> Work | None:
        """What the request needs next (None: it has finished)."""
        if self.finished is not None:
            return None
        if self._work is None:
            self._work = self._plan_round()
        return self._work

    def advance(self, result: Any) -> int | None:
        """The result of the current work: the first token (or None) of a Prefill, the block of a Draft, the
        Acceptance of a Verify. Returns, for a Verify, how many of the verified rows the row keeps (the engine
        commits them); None otherwise."""
        work, self._work = self._work, None
        if isinstance(work, Prefill):
            self._prefilled(work, result)
            return None
        if isinstance(work, Draft):
            self._drafted(work, result)
            return None
        if isinstance(work, Verify):
            return self._verified(work, result)
        raise RuntimeError("advance without work")

    def cancel(self) -> None:
        """The request ends where it is (its client went away): nothing more is asked or emitted."""
        self._work = None
        if self.finished is None:
            self.finished = Finished(reason=FinishReason.CANCELLED, usage=self._usage())

    # ---- prefill ------------------------------------------------------------------------------------------

    def _next_piece(self) -> Prefill:
        if self._pieces:
            stop = self._pieces.pop(0)
            return Prefill(tuple(self._prompt[self._pos : stop]), False, self._sampling, 0.0)
        return Prefill(tuple(self._prompt[self._pos :]), True, self._sampling, self._first_uniform)

    def _prefilled(self, piece: Prefill, first: int | None) -> None:
        self._pos += len(piece.tokens)
        if self._pos in self._points and self._on_snapshot is not None:
            self._on_snapshot()
        if self._report:
            self._emit(PrefillProgress(done=self._pos, total=len(self._prompt), reused=self._reuse))
        if not piece.last:
            self._work = self._next_piece()
            return
        assert first is not None
        self._prefill_s = self._clock.now() - self._start
        plan = plan_commit((first,), self._generated, self._stop)
        if plan.tokens:
            self._history.extend(plan.tokens)
            self._generated += len(plan.tokens)
            self._emit(TokensCommitted(tokens=plan.tokens))
        self._decode_start = self._round_start = self._clock.now()
        self._pending = plan.finish
        self._after = None

    # ---- rounds -------------------------------------------------------------------------------------------

    def _settle(self) -> bool:
        """The end of the previous round (or of the prefill), once the caller has seen its events: a stop
        string, the switcher's word on the round, the context window. Whether the request goes on."""
        finish, self._pending = self._pending, None
        if finish is None and self._halt is not None and self._halt():
            finish = FinishReason.STOP_SEQUENCE
        after, self._after = self._after, None
        if after is not None and self._switcher is not None:
            self._switch(finish, *after)
        if finish is None:
            depth = self._row.cached_tokens
            if self._window is not None and depth + 1 >= self._window:
                finish = FinishReason.CONTEXT
        if finish is not None:
            self.finished = Finished(reason=finish, usage=self._usage())
            self._emit(self.finished)
            return False
        return True

    def _plan_round(self) -> Work | None:
        if self._round is None and not self._settle():
            return None
        src = self._current.source
        depth = self._row.cached_tokens
        requested = self._policy.cap(depth) if src is not None else 0
        cap = round_cap(requested, self._stop.max_tokens - self._generated)
        if self._window is not None:
            cap = max(0, min(cap, self._window - depth - 2))
        t0 = self._clock.now()
        self._round = (cap, t0, depth)
        if src is not None and cap > 0:
            feats = self._features.for_round(src, depth, self._history, self._sampling) if src.uses_features else None
            ctx = DraftContext(anchor=self._history[-1], position=depth, history=self._history, features=feats)
            cap = min(cap, src.max_block)
            self._round = (cap, t0, depth)
            return Draft(src, ctx, cap, self._sampling, tuple(self._rng.random() for _ in range(cap)))
        return self._verify_work(EMPTY_BLOCK)

    def _drafted(self, work: Draft, block: DraftBlock) -> None:
        self._work = self._verify_work(block.truncated(work.cap))

    def _verify_work(self, block: DraftBlock) -> Verify:
        assert self._round is not None
        depth = self._round[2]
        self._block = block
        self._t1 = self._clock.now()
        if len(block):
            uniforms = tuple(self._rng.random() for _ in range(len(block) + 1))
        else:
            uniforms = (self._queued if self._queued is not None else self._rng.random(),)
        self._queued = None
        # Plain mode: the next round is another plain step unless this one ends the request.
        if (
            self._current.source is None
            and self._generated + 1 < self._stop.max_tokens
            and (self._window is None or depth + 2 < self._window)
        ):
            self._queued = self._rng.random()
        return Verify(self._history[-1], block, self._sampling, uniforms, self._queued)

    def _verified(self, work: Verify, verdict: Acceptance) -> int:
        assert self._round is not None
        (cap, t0, depth), self._round = self._round, None
        block = work.block
        candidates = (*block.tokens[: verdict.accepted], verdict.next_token)
        plan = plan_commit(candidates, self._generated, self._stop)
        t2 = self._clock.now()
        # An EOS that ends generation was still produced by this round: it counts towards acceptance.
        produced = len(plan.tokens) + (1 if plan.finish is FinishReason.STOP else 0)
        self._stats.record(len(block), verdict.accepted, produced)
        if plan.tokens:
            self._history.extend(plan.tokens)
            self._generated += len(plan.tokens)
            self._emit(TokensCommitted(tokens=plan.tokens))
        self._emit(
            RoundFinished(
                index=self._index,
                source=block.source if len(block) else "none",
                cap=cap,
                drafted=len(block),
                accepted=verdict.accepted,
                committed=len(plan.tokens),
                draft_s=self._t1 - t0,
                verify_s=t2 - self._t1,
                depth=depth,
            )
        )
        if self._current.source is not None:
            decision = self._policy.observe(len(block), verdict.accepted, t2 - t0, depth, cap)
            if decision is not None:
                self._emit(CapChanged(old=decision.old, new=decision.new, reason=decision.reason))
        self._index += 1
        self._pending = plan.finish
        self._after = (produced, len(block), depth)
        return plan.keep_rows

    def _switch(self, finish: FinishReason | None, produced: int, drafted: int, depth: int) -> None:
        # Wall time per round, the caller's share included: what the request really gets. The last round is
        # reported too (what it measured outlives the request); a move after it is void.
        assert self._switcher is not None
        now = self._clock.now()
        nxt = self._switcher.after_round(
            self._current.name, produced, now - self._round_start, drafted=drafted, depth=depth, history=self._history
        )
        self._round_start = now
        if finish is None and nxt is not None and nxt.name != self._current.name:
            self._current, self._policy = nxt, _policy(nxt)
            if nxt.source is not None and id(nxt.source) not in self._begun:
                nxt.source.begin(self._prompt)
                self._begun.add(id(nxt.source))
            if nxt.switched is not None:
                self._emit(nxt.switched)

    def _usage(self) -> Usage:
        decode_s = self._clock.now() - self._decode_start if self._decode_start is not None else 0.0
        return Usage(
            prompt_tokens=len(self._prompt),
            generated_tokens=self._generated,
            cached_prompt_tokens=self._reuse,
            rounds=self._stats.rounds,
            drafted=self._stats.drafted,
            accepted=sum(self._stats.accepts),
            mean_accepted=self._stats.mean_accepted,
            prefill_s=self._prefill_s,
            decode_s=decode_s,
            source=self._current.name,
        )


def selection_of(source: DraftSource | None, cap_policy: CapPolicy | None) -> Selection:
    """A fixed source and cap policy as a selection."""
    return Selection(name=source.name if source is not None else PLAIN, source=source, policy=cap_policy)
