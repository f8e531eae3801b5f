"""Continuous batching: many engine jobs share one batched target forward per step, plain or speculative.

Each job keeps running its own unchanged code (chat service → GenerationService → decode loop) in a lane: a
thread that runs only while the scheduler waits for it (a baton, so exactly one thread runs at a time and
the tokenizer and MLX are never used concurrently). The lane's target is a `RowTarget` whose `prefill` and
`verify` park the lane and hand the work to the scheduler; all MLX work happens on the engine thread.

The scheduler's step: admit queued jobs up to `max_batch`; give every lane that is prefilling one prompt
chunk (so a long prompt never stalls the rows that decode); run one batched step for every row waiting
for a token; resume each lane with its result. A row's prompt pieces (`extend`, then `prefill`) are calls
of their own, so its decode loop gets control back once each piece is really cached and its
PrefillProgress flows through the service's telemetry like a solo row's. A finished, failed or cancelled
row leaves the batch at once; the others never notice. Each row draws its uniforms from its own decode
loop's seeded RNG, so its output is the one it would produce alone.

Speculative fixed modes (lookup, DFlash, DSpark) batch too: each lane drafts with its own fork of the
service's draft source (its own n-gram index or drafter context, the weights shared), on the engine thread,
and every row's block is verified in the tick's one forward (rows of different block lengths padded; the
backend masks and rolls back each row on its own). Per batch width the scheduler asks the calibrated cost
curves (`domain/costmodel/batch.py`) whether speculation still pays and at which cap: while two or more
rows share the batch, that plan sets the cap of every row whose policy adapts (`--max-draft auto`; 0 means
plain batched steps, lossless), since a row's round is then one shared tick and its solo cost model would
misread it. A fixed `--max-draft N` is obeyed at every width (its seeded sampled output stays the solo one).
Each decision is a `BatchSpeculation` event. Greedy rows of one drafter draft together in one batched call
(`RowsDraftSource.propose_rows`); sampled rows draft alone, since their q is part of their seeded output.
Auto mode batches with each lane on auto's own rule over the lane's forks (`LaneAutoSelector`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import attrs
import structlog

from mlx_dspark.application.auto_mode import AutoSelector
from mlx_dspark.application.generation import GenerationService
from mlx_dspark.domain.costmodel.acceptance import DecayedAcceptance
from mlx_dspark.domain.costmodel.batch import (
    BatchDraftCost,
    BatchPlan,
    TickCorrection,
    batch_tick_seconds,
    plan_batch,
)
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.costmodel.draft_cap import CapDecision, CapPolicy, FixedCap
from mlx_dspark.domain.drafting.block import EMPTY_BLOCK, DraftBlock, DraftContext
from mlx_dspark.domain.drafting.selection import FixedSelector, Selection
from mlx_dspark.domain.events import BatchSpeculation, BatchStepped
from mlx_dspark.domain.ports import DraftSource, RollbackKind, RowsDraftSource, TargetModel
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.outcome import Acceptance

_GREEDY = SamplingParams()
_EXPLORE_EVERY = 16  # while speculating, one plain tick in this many (with observed forwards)
_PROBE_CAP = 2  # drafts per row on a probe tick while the batch decodes plainly
_PROBE_BACKOFF_MAX = 16  # the wait between probes grows to at most this many times `probe_every`
TELEMETRY_ID = "batch"  # the request id the scheduler's BatchStepped events carry (they belong to no request)
_log = structlog.get_logger("mlx_dspark.batching")


class BatchBackend(Protocol):
    """A target's batched form (adapters/mlx/batched_target.py)."""

    @property
    def width(self) -> int: ...

    @property
    def speculative(self) -> bool:
        """Whether rows may verify drafts (else every verify is a plain step)."""
        ...

    def feed(self, row: int, tokens: Sequence[int], *, capture: bool = False) -> None:
        """Queue prompt tokens of `row` (starting the row; `capture`: record target features)."""
        ...

    def extend_step(self, row: int) -> bool:
        """Prefill the next chunk of a piece before the prompt's end; True once the queued tokens are in."""
        ...

    def prefill_step(self, row: int, sampling: SamplingParams, uniform: float) -> int | None:
        """Prefill the next chunk of the prompt's end; after the last one, the first token (the row joins)."""
        ...

    def verify(self, calls: dict[int, Any]) -> dict[int, tuple[Acceptance, Any]]:
        """Every row's [anchor, drafts...] (`row_verify` values) in one forward: per row its verdict and the
        verified rows' features (None when the row records none); pending until `commit`."""
        ...

    def commit(self, keep: dict[int, int]) -> None:
        """Keep the first `keep[row]` verified rows of every row; exactly undo the rest."""
        ...

    def take_features(self, row: int, *, peek: bool = False) -> list[Any]:
        """Features of the row's prompt chunks since the last call (`peek`: left for the next call too)."""
        ...

    @property
    def state_tag(self) -> str:
        """The serial target's state tag when rows load and save prefix-cache states ("": they cannot)."""
        ...

    def load_row(self, row: int, state: Any, keep: int) -> int:
        """Start `row` from a saved state cut to `keep` rows; 0 when that is not exact."""
        ...

    def row_state(self, row: int, tokens: tuple[int, ...], features: Any) -> Any:
        """A saved state of the row's cached rows (`tokens`), or None when it does not hold exactly those."""
        ...

    def join_features(self, chunks: Sequence[tuple[Any, int | None]]) -> Any:
        """One float32 [rows, C] array of (array, rows kept or None = all) chunks, or None when empty."""
        ...

    def row_verify(
        self, anchor: int, drafts: tuple[int, ...], q: Any, sampling: SamplingParams, uniforms: tuple[float, ...]
    ) -> Any:
        """The backend's value for one row of `verify`."""
        ...

    def close(self, row: int) -> None: ...

    def adopt(self, row: int, *, capture: bool = False) -> None:
        """Move the serial target's cached rows into the batch as `row` (the serial target keeps its copy)."""
        ...


BatchBackendFactory = Callable[[TargetModel], BatchBackend | None]


def batchable(generator: GenerationService, backend: BatchBackend | None = None) -> bool:
    """Whether requests of this service can share batched forwards: plain decoding, a fixed speculative mode, or
    auto mode, as long as every draft source involved can fork a per-request copy, and `backend` (when given)
    verifies drafts at all (a target with rotating or recurrent layers batches plain decoding only)."""
    selector = generator.selector
    if backend is not None and not backend.speculative:
        return isinstance(selector, FixedSelector) and selector.source is None
    if isinstance(selector, FixedSelector):
        sources: list[DraftSource | None] = [selector.source]
    elif isinstance(selector, AutoSelector):
        sources = list(selector.sources().values())
    else:
        return False
    return all(source is None or hasattr(source, "fork") for source in sources)


class _Cancelled(Exception):
    """Raised inside a lane whose job was cancelled while it waited for the scheduler."""


@attrs.define
class _Call:
    # "extend" | "prefill" | "verify" (batched rows); "solo" | "solo-prefill" | "solo-verify" (serial);
    # "draft" (the lane's draft source, on the engine thread)
    kind: str
    tokens: list[int]
    sampling: SamplingParams
    uniform: float
    run: Callable[[], Any] | None = None  # the serial target call of a solo row, or the draft call
    block: DraftBlock = EMPTY_BLOCK
    uniforms: tuple[float, ...] = ()
    propose: _Propose | None = None  # a draft call's proposal, for drafting together with other rows


@attrs.frozen
class _Propose:
    """A lane's `propose`: its fork of the draft source, its context (features not yet joined), cap, sampling."""

    source: DraftSource
    ctx: DraftContext
    cap: int
    sampling: SamplingParams
    root: DraftSource  # the service's source the lane's fork came from (forks of one root draft together)


@attrs.frozen
class FeatureRows:
    """A batched row's features since the last take, as chunks (array, rows kept or None = all): an opaque
    handle for the decode loop that the row's draft source joins (`backend.join_features`) on the engine thread.
    """

    chunks: tuple[tuple[Any, int | None], ...]


@attrs.frozen
class _Verdict:
    """A batched verify's answer to one lane: its acceptance and its verified rows' features (or None)."""

    acceptance: Acceptance
    features: Any


class RowTarget:
    """The TargetModel port of one row: every forward done by the scheduler.

    A row admitted alone is solo: it runs on the serial target (today's path, prefix reuse included) until
    another row needs the batch; then the scheduler moves its cached rows into the batch (`to_batched`).
    """

    def __init__(self, lane: Lane, vocab_size: int, solo: TargetModel | None = None, backend: Any = None) -> None:
        self._lane = lane
        self.vocab_size = vocab_size
        self.solo = solo
        self._backend = backend
        self._ids: list[int] = []
        # The anchor and block of the verify awaiting its commit. Its drafts are read at the commit, once the
        # scheduler has read them on the engine thread: a lane's thread never waits on the device itself.
        self._verified: tuple[int, DraftBlock] | None = None
        self._verified_features: Any = None
        self._features: list[tuple[Any, int | None]] = []  # committed rows' features not yet taken
        self._taken: list[tuple[Any, int | None]] = []  # every features chunk handed out (a saved state's)
        self.capture = False  # whether this request reads target features (set by reset)

    def to_batched(self, unread: Any = None) -> None:
        """The row now lives in the batch; its cached ids are the serial target's, and `unread` the features
        of rows it committed there that no drafter has taken yet."""
        assert self.solo is not None
        self._ids = list(self.solo.cached_ids)
        self.solo = None
        if unread is not None:
            self._features.append((unread, None))

    @property
    def rollback_kind(self) -> RollbackKind:
        return RollbackKind.TRIM

    @property
    def cached_tokens(self) -> int:
        return self.solo.cached_tokens if self.solo is not None else len(self._ids)

    @property
    def cached_ids(self) -> tuple[int, ...]:
        return tuple(self.solo.cached_ids) if self.solo is not None else tuple(self._ids)

    def _solo(self, run: Callable[[], Any], kind: str = "solo") -> Any:
        return self._lane.call(_Call(kind, [], _GREEDY, 0.0, run))

    def reset(self, keep: int = 0, *, capture: bool = True) -> int:
        self.capture = capture
        solo = self.solo
        if solo is not None:
            kept: int = self._solo(lambda: solo.reset(keep, capture=capture))
            return kept
        if self._ids and keep != len(self._ids):  # only the rows a loaded state gave it (the prefix cache's)
            raise RuntimeError("a batched row decodes one request")
        return len(self._ids) if keep else 0

    def prefill(self, tokens: Sequence[int], sampling: SamplingParams, uniform: float) -> int:
        solo = self.solo
        if solo is not None:
            first: int = self._solo(lambda: solo.prefill(tokens, sampling, uniform), "solo-prefill")
            return first
        token: int = self._lane.call(_Call("prefill", list(tokens), sampling, uniform))
        self._ids.extend(tokens)
        return token

    def verify(
        self,
        anchor: int,
        block: DraftBlock,
        sampling: SamplingParams,
        uniforms: Sequence[float],
        *,
        ahead: float | None = None,
    ) -> Acceptance:
        if self._verified is not None:
            raise RuntimeError("verify while the previous verify awaits its commit")
        solo = self.solo
        kind, run = "verify", None
        if solo is not None:
            kind = "solo-verify"
            run = lambda: solo.verify(anchor, block, sampling, uniforms, ahead=ahead)  # noqa: E731
        call = _Call(kind, [anchor], sampling, uniforms[0], run, block=block, uniforms=tuple(uniforms))
        self._verified = (anchor, block)
        result = self._lane.call(call)
        if isinstance(result, _Verdict):  # verified in the batch (a solo row may have moved in meanwhile)
            self._verified_features = result.features
            return result.acceptance
        assert isinstance(result, Acceptance)
        return result

    def commit(self, keep_rows: int) -> None:
        pending, self._verified = self._verified, None
        if pending is None:
            raise RuntimeError("commit without a verify")
        if self.solo is not None:
            solo = self.solo
            self._solo(lambda: solo.commit(keep_rows))
            return
        self._ids.extend([pending[0], *pending[1].tokens][:keep_rows])
        if self._verified_features is not None and keep_rows:
            self._features.append((self._verified_features, keep_rows))
        self._verified_features = None
        self._lane.keep = keep_rows  # the scheduler rolls every row of the batch back at once
        if not keep_rows:  # the loop is finishing: the row must not step again
            self._lane.spent = True

    def take_features(self) -> Any:
        solo = self.solo
        if solo is not None:
            return self._solo(solo.take_features)
        if not self.capture:
            return None
        prompt = [(a, None) for a in self._backend.take_features(self._lane.row)] if self._backend else []
        chunks, self._features = tuple(prompt + self._features), []
        self._taken.extend(chunks)
        return FeatureRows(chunks)

    # Prefix-cache hooks: a solo row is the serial target; a batched row of a dense target loads a state before
    # its prompt and saves its rows out of the batch (the backend's), both on the engine thread.

    @property
    def state_tag(self) -> str:
        if self.solo is not None:
            return self.solo.state_tag
        return str(getattr(self._backend, "state_tag", ""))

    def extend(self, tokens: Sequence[int]) -> None:
        solo = self.solo
        if solo is None:  # the scheduler runs the piece chunk by chunk; the lane resumes once it is cached
            if tokens:
                self._lane.call(_Call("extend", list(tokens), _GREEDY, 0.0))
                self._ids.extend(tokens)
            return
        self._solo(lambda: solo.extend(tokens), "solo-prefill")

    def save_state(self) -> Any:
        solo = self.solo
        if solo is not None:
            return self._solo(solo.save_state)
        if not self.state_tag:
            raise RuntimeError("this target's batched rows have no state to save")
        backend, row, tokens = self._backend, self._lane.row, tuple(self._ids)

        def save() -> Any:
            features = None
            if self.capture:  # every row's features: those handed out, then those still waiting
                waiting = [(a, None) for a in backend.take_features(row, peek=True)] + self._features
                features = backend.join_features(self._taken + waiting)
            return backend.row_state(row, tokens, features)

        return self._solo(save)

    def load_state(self, state: Any, keep: int) -> int:
        solo = self.solo
        if solo is not None:
            loaded: int = self._solo(lambda: solo.load_state(state, keep))
            return loaded
        if self._ids or not self.state_tag:
            return 0
        backend, row = self._backend, self._lane.row
        kept: int = self._solo(lambda: backend.load_row(row, state, keep))
        if kept:
            self._ids = list(state.tokens[:kept])
        return kept


class RowDraftSource:
    """One lane's own fork of the service's draft source; every call runs on the engine thread."""

    def __init__(self, inner: DraftSource, lane: Lane, join: Callable[[Any], Any], root: DraftSource) -> None:
        self._inner = inner
        self._lane = lane
        self._join = join  # FeatureRows chunks -> one features array (the backend's)
        self.root = root

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def max_block(self) -> int:
        return self._inner.max_block

    @property
    def uses_features(self) -> bool:
        return self._inner.uses_features

    def begin(self, prompt: Sequence[int]) -> None:
        self._lane.call(_Call("draft", [], _GREEDY, 0.0, lambda: self._inner.begin(prompt)))

    def propose(
        self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]
    ) -> DraftBlock:
        def run() -> DraftBlock:
            return self._inner.propose(joined(ctx, self._join), cap, sampling, uniforms).truncated(cap)

        propose = _Propose(self._inner, ctx, cap, sampling, self.root)
        block: DraftBlock = self._lane.call(_Call("draft", [], _GREEDY, 0.0, run, propose=propose))
        return block


def joined(ctx: DraftContext, join: Callable[[Any], Any]) -> DraftContext:
    """`ctx` with a batched row's FeatureRows joined into the one features array its draft source reads."""
    if isinstance(ctx.features, FeatureRows):
        return attrs.evolve(ctx, features=join(ctx.features.chunks))
    return ctx


@attrs.define
class _LaneSelector(FixedSelector):
    """A fixed mode's selector for one lane: the batch's plan sets its adaptive caps while rows share the batch,
    except a seeded request's, which learn from modelled seconds (so its tokens are its solo ones)."""

    gated: Callable[[CapPolicy], CapPolicy] = lambda policy: policy

    def select(self, prompt: Sequence[int], sampling: SamplingParams | None = None) -> Selection:
        selection = super().select(prompt, sampling)
        if selection.policy is None or (sampling is not None and sampling.seeded):
            return selection
        return attrs.evolve(selection, policy=self.gated(selection.policy))


class _Gate:
    """The scheduler's cap for the next tick, read by every lane's adaptive cap policy.

    None: each row's own policy decides (a lone row, or no calibrated curves). A number: the batch's plan
    decides for every row, since a batched round costs one shared forward, not the row's own solo round.
    """

    def __init__(self) -> None:
        self.cap: int | None = None


@attrs.define
class _GatedCap:
    """A lane's adaptive cap policy, overruled by the batch's plan while the batch decides."""

    inner: CapPolicy
    gate: _Gate
    max_cap: int
    planned: bool = False  # whether the batch's plan chose this row's last cap

    def cap(self, depth: int) -> int:
        self.planned = self.gate.cap is not None
        if self.gate.cap is None:
            return self.inner.cap(depth)
        return min(self.gate.cap, self.max_cap)

    def observe(self, drafted: int, accepted: int, seconds: float, depth: int) -> CapDecision | None:
        # A batched round's seconds are a shared tick's (every row's drafts, one wide forward): they say
        # nothing about this row's solo round, so the row's own model learns only from its solo rounds. The
        # gate may have changed since the round's cap was chosen (the batch shrank to one): what counts is who
        # chose it.
        if self.planned:
            return None
        return self.inner.observe(drafted, accepted, seconds, depth)


class Lane:
    """One job's thread, run strictly in turns with the scheduler."""

    def __init__(self, row: int, job: Any, push: Callable[[Any, str, Any], None]) -> None:
        self.row = row
        self.job = job
        self.call_pending: _Call | None = None
        self.done = False
        self.spent = False
        self.keep: int | None = None  # rows the lane's last batched verify keeps (set by its commit)
        self.fed: _Call | None = None  # the prompt piece the backend holds for this row
        self.service: GenerationService | None = None  # set before the first resume
        self.target: RowTarget | None = None
        self._push = push
        self.aborted = False  # the engine failed: the job was answered; the thread only winds down
        self._result: int | BaseException | None = None
        self._go = threading.Event()
        self._parked = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"mlx-dspark-row-{row}", daemon=True)

    # In the lane's thread.

    def call(self, request: _Call) -> Any:
        if self.aborted:
            raise _Cancelled()
        if self.spent and request.kind != "solo":  # its last state may still be saved (the prefix cache's)
            raise RuntimeError("a finished row asked for another step")
        self.call_pending = request
        self._parked.set()
        self._go.wait()
        self._go.clear()
        result, self._result = self._result, None
        if isinstance(result, BaseException):
            raise result
        return result

    def _main(self) -> None:
        self._go.wait()
        self._go.clear()
        items: Iterator[Any] | None = None
        outcome: tuple[str, Any] = ("end", None)
        try:
            items = self.job.work(self.service)
            for item in items:
                self._push(self.job, "item", item)
                if self.job.cancelled:
                    break
        except _Cancelled:
            pass
        except Exception as exc:  # a failed row must never disturb the others
            outcome = ("error", exc)
        finally:
            close = getattr(items, "close", None)
            try:
                if close is not None:
                    close()  # the stream's own way out (its prefix-cache save)
            except _Cancelled:
                pass
            except Exception as exc:  # the request's output is complete: a failed save on the way out is logged
                _log.warning("batching.close_failed", error=str(exc), row=self.row)
            finally:
                self.done = True
                self.call_pending = None
                self._parked.set()
        if not self.aborted:
            self._push(self.job, *outcome)

    # In the scheduler's thread.

    def resume(self, result: Any = None) -> None:
        """Hand the baton to the lane until it asks for work again or ends."""
        if not self._thread.is_alive() and not self.done:
            self._thread.start()
        self.call_pending = None
        self._result = result
        self._parked.clear()
        self._go.set()
        self._parked.wait()
        if self.done:
            self._thread.join()


class BatchScheduler:
    """Drives lanes over one batch backend; the engine thread calls `run` with the first job.

    Args:
        backend: the target's batched form.
        generator: the engine's service; each lane gets a copy of it over its own RowTarget (and, in a
            speculative mode, its own fork of the draft source).
        max_batch: rows decoded together.
        push: delivers a job's item / error / end to its caller (the engine's queue plumbing).
        curves: the calibrated cost curves for the width decision (default: those of the service's adaptive
            cap policy, when it has them; without curves every row keeps its own cap policy).
        probe_every: while speculation is off, one tick in this many lets rows draft again, so the batch's
            acceptance estimate stays current; each probe that leaves it off doubles the wait (up to
            `_PROBE_BACKOFF_MAX` times), since at high width a probe tick costs several plain ones.
        observe_forwards: time every batched tick on the service's clock and correct the cost model by what
            ticks of each token count really take (the engine and bench do; tests on fake clocks do not).
    """

    def __init__(
        self,
        backend: BatchBackend,
        generator: GenerationService,
        *,
        max_batch: int,
        push: Callable[[Any, str, Any], None],
        curves: CostCurves | None = None,
        probe_every: int = 16,
        observe_forwards: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._backend = backend
        self._generator = generator
        self._max_batch = max_batch
        self._push = push
        self._lanes: list[Lane] = []
        self._next_row = 0
        self._gate = _Gate()
        self._curves = curves
        self._max_cap = 0
        # The batch's drafts, all rows pooled (re-sized to the cap); every row of a tick adds one round.
        self._acceptance = DecayedAcceptance()
        self._probe_every = probe_every
        self._probe_wait = probe_every  # off ticks until the next probe (grows while probes say "off")
        self._probed = False  # whether the tick just decided was a probe
        self._clock = generator.clock if observe_forwards else None
        self._correction = TickCorrection()  # observed ÷ predicted batched tick seconds, by width and cap
        self._draft_cost = BatchDraftCost()  # what drafting rows together costs, by width
        self._off_ticks = 0
        self._on_ticks = 0
        self._announced: tuple[int, int] | None = None  # the last reported (width, cap)
        self.steps = 0  # batched forwards
        self.widest = 0
        self.migrations = 0  # solo rows moved into the batch
        self.drafting_steps = 0  # batched forwards in which some row verified drafts
        # The latest width decisions that changed the width or the cap, in order (also emitted as telemetry).
        self.decisions: collections.deque[BatchPlan] = collections.deque(maxlen=256)

    @property
    def active(self) -> int:
        return len(self._lanes)

    def run(
        self,
        first: Any,
        take: Callable[[], Any | None],
        stopping: Callable[[], bool] = lambda: False,
        between: Callable[[], None] = lambda: None,
    ) -> None:
        """Serve `first` and every job `take()` returns (None: nothing waiting) until no lane is left.

        Once `stopping()` says so, running rows are cancelled at their next step and nothing is admitted;
        `between()` runs before every tick (the engine's quick jobs).
        """
        self._admit(first)
        while self._lanes:
            between()
            if stopping():
                for lane in self._lanes:
                    lane.job.cancel()
            while not stopping() and len(self._lanes) < self._max_batch:
                job = take()
                if job is None:
                    break
                self._admit(job)
            self._tick()
        self._report(0, 0)  # drained: nothing decodes until the next job

    def jobs(self) -> list[Any]:
        """The jobs decoding now (a snapshot; safe to read from another thread)."""
        return [lane.job for lane in list(self._lanes)]

    def abort(self, failure: Exception) -> None:
        """The engine failed mid-tick: every lane's job gets `failure` now, and its thread winds down without
        touching the model again (this scheduler and its backend are dropped)."""
        lanes, self._lanes = self._lanes, []
        for lane in lanes:
            self._push(lane.job, "error", failure)
            lane.aborted = True
            if lane.call_pending is not None:
                try:
                    lane.resume(_Cancelled())
                except Exception as exc:  # pragma: no cover - a lane's thread handles its own errors
                    _log.warning("batching.abort_failed", error=str(exc), row=lane.row)

    def _report(self, width: int, prefilling: int, drafting: int = 0) -> None:
        event = BatchStepped(width=width, prefilling=prefilling, drafting=drafting)
        self._generator.telemetry.emit(TELEMETRY_ID, event)

    def _row_service(self, lane: Lane) -> GenerationService:
        """The engine's service over the lane's target; a speculative mode's with the lane's own source fork."""
        assert lane.target is not None
        selector = self._generator.selector

        def own(root: DraftSource) -> RowDraftSource:
            return RowDraftSource(root.fork(), lane, self._backend.join_features, root)  # type: ignore[attr-defined]

        if isinstance(selector, AutoSelector):
            # Auto's own rule per request over the lane's forks. While rows share the batch its plan sets their
            # caps and they stay on their sources (a shared tick is no source's own round); alone, auto decides.
            view = selector.lane_view(own, policy=self._gated, hold=lambda: self._gate.cap is not None)
            return self._generator.on_target(lane.target, selector=view)
        if not isinstance(selector, FixedSelector) or selector.source is None:
            return self._generator.on_target(lane.target)
        source = own(selector.source)
        factory = selector.policy_factory

        def policy() -> CapPolicy:
            return factory() if factory is not None else FixedCap(source.max_block)

        lane_selector = _LaneSelector(selector.name, source, policy, self._gated)
        return self._generator.on_target(lane.target, selector=lane_selector)

    def _gated(self, inner: CapPolicy) -> CapPolicy:
        """A row's adaptive cap policy under the batch's plan (its curves become the plan's); a fixed one as is."""
        if isinstance(inner, FixedCap):  # --max-draft N: obeyed at every width
            return inner
        curves = getattr(inner, "curves", None)
        if self._curves is None and isinstance(curves, CostCurves):
            self._curves = curves
        max_cap = int(getattr(inner, "max_cap", 1))
        self._max_cap = max(self._max_cap, max_cap)
        return _GatedCap(inner, self._gate, max_cap)

    def _admit(self, job: Any) -> None:
        if job.cancelled:
            self._push(job, "end", None)
            return
        row = self._next_row
        self._next_row += 1
        lane = Lane(row, job, self._push)
        serial = self._generator.model.target
        lane.target = RowTarget(lane, serial.vocab_size, solo=None if self._lanes else serial, backend=self._backend)
        lane.service = self._row_service(lane)
        self._lanes.append(lane)
        lane.resume()  # runs until its prefill call (or its end)
        self._settle(lane)

    def _settle(self, lane: Lane) -> None:
        """A lane that ended or was cancelled leaves the batch now."""
        if lane.done:
            self._backend.close(lane.row)
            if lane in self._lanes:
                self._lanes.remove(lane)
        elif lane.job.cancelled and lane.call_pending is not None:
            if lane.call_pending.kind == "solo":  # its bookkeeping on the way out (a state save) still runs
                return
            self._backend.close(lane.row)
            lane.resume(_Cancelled())
            self._settle(lane)

    def _tick(self) -> None:
        solo, prefilled, width, drafting = self._tick_rows()
        if width or solo or prefilled:
            self._report(width or solo, prefilled, drafting)

    def _run(self, lane: Lane, call: _Call) -> None:
        """Run a lane's engine-thread call (a solo target call or a draft) and hand it the result."""
        assert call.run is not None
        try:
            result = call.run()
        except Exception as exc:
            lane.resume(exc)
        else:
            if call.kind == "solo-verify" and len(call.block) and isinstance(result, Acceptance):
                # A lone row's rounds tell the batch's estimate what this drafter achieves before rows join.
                self._acceptance.record(len(call.block), result.accepted)
            lane.resume(result)
        self._settle(lane)

    def _drafts(self) -> None:
        """Every lane waiting on its draft source drafts now (then it waits for its verify): greedy rows of a
        source that drafts rows together in one call, the others one by one."""
        while True:
            waiting = [
                lane for lane in self._lanes if lane.call_pending is not None and lane.call_pending.kind == "draft"
            ]
            if not waiting:
                return
            # Calls that draft alone (a `begin`, a sampled row, lookup) first: a lane may reach a proposal that
            # joins the others' through them.
            alone = next((lane for lane in waiting if self._joins_rows(lane.call_pending) is None), None)
            if alone is None:
                groups: dict[int, list[Lane]] = {}
                for lane in waiting:
                    groups.setdefault(id(self._joins_rows(lane.call_pending)), []).append(lane)
                together = max(groups.values(), key=len)
                if len(together) > 1:
                    self._propose_rows(together)
                    continue
                alone = together[0]
            call = alone.call_pending
            assert call is not None
            self._run(alone, call)

    def _rows_source(self) -> RowsDraftSource | None:
        """The service's draft source when it is fixed and its forks draft together."""
        selector = self._generator.selector
        source = selector.source if isinstance(selector, FixedSelector) else None
        return source if isinstance(source, RowsDraftSource) else None

    @staticmethod
    def _joins_rows(call: _Call | None) -> RowsDraftSource | None:
        """The source whose forks this draft call may share one batched draft with (None: it drafts alone)."""
        if call is None or call.propose is None:
            return None
        if not call.propose.sampling.greedy:  # a sampled row's q is part of its seeded output: it drafts alone
            return None
        root = call.propose.root
        return root if isinstance(root, RowsDraftSource) else None

    def _propose_rows(self, lanes: list[Lane]) -> None:
        """One batched draft call for greedy `lanes` (forks of one source); what it cost (its drafts read back,
        as the verify would read them) tells the width decision what drafting together costs."""
        source = self._joins_rows(lanes[0].call_pending)
        assert source is not None
        proposals = [lane.call_pending.propose for lane in lanes if lane.call_pending is not None]
        rows = [(p.source, joined(p.ctx, self._backend.join_features), p.cap) for p in proposals if p is not None]
        started = self._clock.now() if self._clock is not None else 0.0
        try:
            blocks = source.propose_rows(rows)
            widest = max(cap for _, _, cap in rows)
            if self._clock is not None and self._curves is not None and widest > 0 and source is self._rows_source():
                for block in blocks:
                    block.tokens  # noqa: B018 - waits for the drafts, so the time is the drafting's
                self._draft_cost.record(len(rows), self._clock.now() - started, self._curves.draft(widest))
        except Exception as exc:  # a failed draft fails its rows, never the others
            for lane in lanes:
                lane.resume(exc)
                self._settle(lane)
            return
        for lane, block, (_, _, cap) in zip(lanes, blocks, rows, strict=True):
            lane.resume(block.truncated(cap))
            self._settle(lane)

    def _drafting(self, greedy: int, width: int) -> float | None:
        """A tick's drafting in one-row drafts when `greedy` of its `width` rows draft together (None: one each)."""
        if greedy < 2 or self._rows_source() is None:
            return None
        return self._draft_cost.rows(greedy) + (width - greedy)

    def _decide(self, width: int, depth: int, greedy: int = 0) -> None:
        """Set the cap of the next round of `width` rows (`greedy` of them greedy) from the calibrated curves
        (the gate)."""
        if self._curves is None or self._max_cap < 1:
            if self._announced is None and self._max_cap:
                self._announce(BatchPlan(width=width, cap=self._max_cap, plain_tok_s=0.0, speculative_tok_s=0.0),
                               "uncalibrated")
            self._gate.cap = None
            return
        if self._acceptance.positions < self._max_cap:
            self._acceptance = DecayedAcceptance(positions=self._max_cap)
        if width <= 1:  # alone, the row's own cap policy decides (it runs the same cost model)
            self._gate.cap = None
            return
        plan = plan_batch(
            self._curves,
            # One standard error below the pooled estimate: at widths where speculation wins by a few percent
            # at best, an estimate from a handful of noisy ticks must not switch it on.
            self._acceptance.lower(),
            width,
            self._max_cap,
            depth=depth,
            correction=self._correction if self._clock is not None else None,
            draft_rows=self._drafting(greedy, width),
            cap_acceptance=self._acceptance.estimate(),
        )
        if (width, plan.cap) != self._announced:
            self._announce(plan, "calibrated")
        if plan.speculate:
            self._off_ticks = 0
            self._on_ticks += 1
            self._probe_wait = self._probe_every
            self._probed = False
            # Observing forwards: one plain tick in a while keeps the plain forward's own cost measured.
            explore = self._clock is not None and self._on_ticks % _EXPLORE_EVERY == 0
            self._gate.cap = 0 if explore else plan.cap
            return
        if self._probed:  # the probe's rounds are in and speculation stays off: wait longer for the next
            self._probe_wait = min(self._probe_wait * 2, self._probe_every * _PROBE_BACKOFF_MAX)
        self._off_ticks += 1
        probe = self._probe_every > 0 and self._off_ticks >= self._probe_wait
        if probe:
            self._off_ticks = 0
        self._probed = probe
        # A probe tick measures acceptance (and a drafting forward's cost); it is not a decision.
        self._gate.cap = min(_PROBE_CAP, self._max_cap) if probe else 0

    def _announce(self, plan: BatchPlan, reason: str) -> None:
        self._announced = (plan.width, plan.cap)
        self.decisions.append(plan)
        event = BatchSpeculation(
            width=plan.width,
            speculate=plan.speculate,
            cap=plan.cap,
            plain_tok_s=plan.plain_tok_s,
            speculative_tok_s=plan.speculative_tok_s,
            reason=reason,
        )
        self._generator.telemetry.emit(TELEMETRY_ID, event)

    def _quiesce(self) -> None:
        """Run every lane's engine-thread calls that are not a round of its own (drafts; a batched row's state
        save or load; a solo row's bookkeeping) until each lane waits on the batch, on a solo round or prompt
        chunk, or has ended. A row that joined the batch with its first token may end at once (a budget of one
        token, an EOS) and save its state before it leaves: the tick's forward must not start before it has."""
        while True:
            self._drafts()
            busy = [lane for lane in self._lanes if lane.call_pending is not None and lane.call_pending.kind == "solo"]
            if not busy:
                return
            for lane in busy:
                call = lane.call_pending
                assert call is not None
                self._run(lane, call)

    def _tick_rows(self) -> tuple[int, int, int, int]:
        """One tick; returns (solo rows decoded, rows that ran a prompt chunk, width of the batched forward,
        rows of it that verified drafts)."""
        solo = prefilled = 0
        started = self._clock.now() if self._clock is not None else 0.0
        for lane in list(self._lanes):
            self._settle(lane)
        self._drafts()
        for lane in [
            lane for lane in self._lanes if lane.call_pending is not None and lane.call_pending.kind.startswith("solo")
        ]:
            call = lane.call_pending
            assert call is not None and call.run is not None and lane.target is not None
            if call.kind == "solo-verify" and len(self._lanes) > 1:  # another row wants the batch: move in
                serial = lane.target.solo
                assert serial is not None
                self._backend.adopt(lane.row, capture=lane.target.capture)
                unread = serial.take_features() if lane.target.capture else None
                lane.target.to_batched(unread)
                call.kind = "verify"
                self.migrations += 1
                continue
            solo += call.kind == "solo-verify"
            prefilled += call.kind == "solo-prefill"
            self._run(lane, call)
        prefilling = [
            lane
            for lane in self._lanes
            if lane.call_pending is not None and lane.call_pending.kind in ("extend", "prefill")
        ]
        for lane in prefilling:  # one chunk each per tick, interleaved with the decode step
            call = lane.call_pending
            assert call is not None and lane.target is not None
            if lane.fed is not call:
                self._backend.feed(lane.row, call.tokens, capture=lane.target.capture)
                lane.fed = call
            prefilled += 1
            try:
                if call.kind == "extend":  # the piece is in: the lane goes on (its progress event, the next piece)
                    token, done = None, self._backend.extend_step(lane.row)
                else:  # the prompt's end: done with the first token
                    token = self._backend.prefill_step(lane.row, call.sampling, call.uniform)
                    done = token is not None
            except Exception as exc:
                self._backend.close(lane.row)
                lane.resume(exc)
                self._settle(lane)
                continue
            if done:
                lane.resume(token)
                self._settle(lane)
        self._quiesce()  # rows that just got their first token: their bookkeeping, then their first block
        stepping = [
            lane for lane in self._lanes if lane.call_pending is not None and lane.call_pending.kind == "verify"
        ]
        if not stepping:
            return solo, prefilled, 0, 0
        if len(stepping) != self._backend.width:  # by construction every row in the batch waits for its verify
            raise RuntimeError(f"{len(stepping)} rows asked for a verify of a batch of {self._backend.width}")
        calls = {lane.row: lane.call_pending for lane in stepping}
        try:
            verdicts = self._backend.verify(
                {
                    r: self._backend.row_verify(c.tokens[0], c.block.tokens, c.block.q, c.sampling, c.uniforms)
                    for r, c in calls.items()
                    if c is not None
                }
            )
        except Exception as exc:  # the shared forward failed: every row in it fails, the engine goes on
            _log.error("batching.step_failed", error=str(exc), rows=len(stepping))
            for lane in stepping:
                self._backend.close(lane.row)
                lane.resume(exc)
                self._settle(lane)
            return solo, prefilled, 0, 0
        self.steps += 1
        self.widest = max(self.widest, len(stepping))
        drafting = 0
        offered = self._gate.cap  # what this tick's adaptive rows were asked to draft (None: their own policies)
        for r, c in calls.items():
            if c is not None and len(c.block):
                drafting += 1
                self._acceptance.record(len(c.block), verdicts[r][0].accepted)
            elif c is not None and offered:
                # Asked to draft and found nothing (lookup without a match, a confidence cut to zero): the row
                # still commits one token for the widened forward, as if its first draft had been rejected.
                self._acceptance.record(1, 0)
        self.drafting_steps += drafting > 0
        # The next round's caps are chosen as the lanes resume: decide for this width first.
        depth = sum(lane.target.cached_tokens for lane in stepping if lane.target is not None) // len(stepping)
        greedy = sum(c is not None and c.sampling.greedy for c in calls.values())
        self._decide(len(stepping), depth, greedy)
        for lane in stepping:
            lane.keep = None
            acceptance, features = verdicts[lane.row]
            lane.resume(_Verdict(acceptance, features))
            self._settle(lane)
        if self._backend.width:
            keep = {lane.row: lane.keep or 0 for lane in stepping if lane in self._lanes}
            self._backend.commit(keep)
        if self._clock is not None and self._curves is not None and not (solo or prefilled):
            # The whole tick (every row's draft, the forward, every lane's own work) against the model's
            # uncorrected tick: what the next decisions rescale by. Ticks that also ran prompt chunks or a
            # solo row's call would overstate it.
            cap = max(len(c.block) for c in calls.values() if c is not None)
            predicted = batch_tick_seconds(
                self._curves, len(stepping), cap, depth, draft_rows=self._drafting(greedy, len(stepping))
            )
            self._correction.record(len(stepping), cap, self._clock.now() - started, predicted)
        return solo, prefilled, len(stepping), drafting

