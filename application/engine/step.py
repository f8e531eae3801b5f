"""The step engine: every request is a row, and one `step()` moves every row on by one round.

A step gives each row that is prefilling one chunk of its prompt (a long prompt never stalls the rows that
decode), drafts for each row that drafts — greedy rows of one drafter together in one batched call
(`RowsDraftSource.propose_rows`), sampled rows alone since their q is part of their seeded output —,
verifies every row's block in one forward of the backend, lets the width plan decide the next caps, hands
each request its verdict and commits what each row keeps. A lone request is a batch of width one on the same
path. Each row draws its uniforms from its own request's seeded RNG, so its output is the one it would
produce alone; a finished, failed or cancelled row leaves at once and the others never notice.

Each request runs the engine's GenerationService over its own row, with its own fork of the mode's draft
source (its own n-gram index or drafter context, the weights shared); auto mode runs auto's own rule per
request over its forks (`AutoSelector.lane_view`), holding its source while the batch's plan decides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import structlog

from mlx_dspark.application.engine.jobs import Emit, JobEnded, JobEvent, JobFailed, JobItem, StepJob
from mlx_dspark.application.engine.plan import TELEMETRY_ID, WidthPlan
from mlx_dspark.application.engine.rows import Row, RowsBackend, SerialRows
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.costmodel.draft_cap import CapPolicy, FixedCap
from mlx_dspark.domain.decoder import Draft, Prefill, RequestDecoder, Verify, Work
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.drafting.selection import FixedSelector, Selection
from mlx_dspark.domain.events import BatchStepped, DecodeEvent, TelemetryEvent
from mlx_dspark.domain.ports import Clock, DraftSource, RowsDraftSource, TargetModel
from mlx_dspark.domain.tokens import SamplingParams, StopRule

if TYPE_CHECKING:  # the service imports this module to run its own requests
    from mlx_dspark.application.generation import GenerationService

_log = structlog.get_logger("mlx_dspark.engine")


class Task(Protocol):
    """A submitted decode job as the engine sees it."""

    @property
    def cancelled(self) -> bool: ...

    def start(self, service: GenerationService, emit: Emit) -> StepJob:
        """Build the request's job over `service` (its row's); raises the request's own errors."""
        ...

    def push(self, event: JobEvent) -> None:
        """Deliver one event to the job's consumer."""
        ...

    def cancel(self) -> None:
        """End the job at the next step (its consumer is gone, or the engine stops)."""
        ...


def forkable(generator: GenerationService) -> bool:
    """Whether requests of this service can each get their own draft sources (so they can share a batch):
    plain decoding, a fixed speculative mode or auto mode whose sources all fork."""
    selector = generator.selector
    if isinstance(selector, FixedSelector):
        sources: list[DraftSource | None] = [selector.source]
    elif hasattr(selector, "lane_view"):  # auto mode
        sources = list(getattr(selector, "sources")().values())  # noqa: B009 - duck-typed: auto imports us
    else:
        return False
    return all(source is None or hasattr(source, "fork") for source in sources)


def speculates(generator: GenerationService) -> bool:
    """Whether the service's requests may draft (a fixed speculative mode, or auto)."""
    selector = generator.selector
    return not (isinstance(selector, FixedSelector) and selector.source is None)


@attrs.define
class _LaneSelector(FixedSelector):
    """A fixed mode's selector for one request: the batch's plan sets its adaptive caps while rows share the
    batch, except a seeded request's, which learn from modelled seconds (so its tokens are its solo ones)."""

    gated: Callable[[CapPolicy], CapPolicy] = lambda policy: policy

    def select(self, prompt: Sequence[int], sampling: SamplingParams | None = None) -> Selection:
        selection = super().select(prompt, sampling)
        if selection.policy is None or (sampling is not None and sampling.seeded):
            return selection
        return attrs.evolve(selection, policy=self.gated(selection.policy))


class NoTelemetry:
    """A telemetry sink that drops every event (work nobody watches: the engine without a sink, a warm-up)."""

    def emit(self, request_id: str, event: TelemetryEvent) -> None:
        pass


@attrs.define(eq=False)
class _Alone:
    """The task of a request run alone (`run_alone`): its end or error is kept for the caller."""

    cancelled: bool = False
    ended: JobEvent | None = None

    def push(self, event: JobEvent) -> None:
        if not isinstance(event, JobItem):
            self.ended = event

    def cancel(self) -> None:
        self.cancelled = True


@attrs.define(eq=False)
class _Active:
    task: Task | _Alone
    row: Row
    job: StepJob | None = None
    work: Work | None = None


class Engine:
    """Steps requests over one RowsBackend.

    Args:
        backend: the target's rows.
        service: the engine's GenerationService (model, mode, clock, telemetry, prefix cache); `admit` runs
            each task over its row's copy of it. Without one, only `run_alone` (a bare decode) is served.
        max_batch: rows decoded together (the backend's capacity bounds it too).
        fork: each request drafts with its own fork of the mode's sources (rows can share the batch); False:
            requests run one at a time on the service's own sources.
        curves: the calibrated cost curves of the width plan (default: those of the mode's adaptive cap policy).
        probe_every: see `WidthPlan`.
        observe_forwards: time every step on the service's clock and correct the cost model by it (the
            server and bench do; tests on fake clocks do not).
        report_steps: emit each step's BatchStepped (the server's batch; a request run alone reports none).
    """

    def __init__(
        self,
        backend: RowsBackend,
        service: GenerationService | None = None,
        *,
        max_batch: int = 1,
        fork: bool = True,
        curves: CostCurves | None = None,
        probe_every: int = 16,
        observe_forwards: bool = False,
        clock: Clock | None = None,
        report_steps: bool = True,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.backend = backend
        self.service = service
        self.max_batch = min(max_batch, backend.capacity)
        self._forks = fork and service is not None and forkable(service)
        if not self._forks:
            self.max_batch = 1  # one request at a time on the service's own sources
        self._telemetry = service.telemetry if service is not None else None
        self._report = report_steps and self._telemetry is not None  # the batch's width, per step
        self.plan = WidthPlan(
            self._telemetry or NoTelemetry(), curves=curves, probe_every=probe_every, observed=observe_forwards
        )
        self._clock = (service.clock if service is not None else clock) if observe_forwards else None
        self._active: list[_Active] = []
        self._roots: dict[int, DraftSource] = {}  # id(fork) -> the service's source it came from
        self.steps = 0  # forwards that verified rows
        self.widest = 0
        self.drafting_steps = 0  # forwards in which some row verified drafts

    # ---- admission -----------------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def full(self) -> bool:
        return len(self._active) >= self.max_batch

    def tasks(self) -> list[Task | _Alone]:
        """The tasks decoding now (a snapshot; safe to read from another thread)."""
        return [a.task for a in list(self._active)]

    @property
    def migrations(self) -> int:
        return int(self.backend.stats.get("migrations", 0))

    def admit(self, task: Task, service: GenerationService | None = None) -> None:
        """Start `task` on a row of its own (its prompt's checks, prefix reuse and prefill plan run now).

        Args:
            task: the job.
            service: the task's own service over the engine's target (a race lane's mode) instead of the
                engine's; its draft sources are forked per row as the engine's are, so it must fork when rows
                share the batch.
        """
        if task.cancelled:
            task.push(JobEnded())
            return
        if self.full:
            raise RuntimeError("the engine is full")
        chosen = service or self.service
        if chosen is not None and service is not None and self._forks and not forkable(service):
            raise ValueError(f"mode {service.mode} cannot fork its draft sources, so it cannot share the batch")

        def make(row: Row) -> StepJob:
            return task.start(self._row_service(row, chosen), lambda item: task.push(JobItem(item)))

        self._start(task, make)

    def _start(self, task: Task | _Alone, make: Callable[[Row], StepJob]) -> None:
        active = _Active(task, self.backend.open())
        self._active.append(active)

        def start() -> None:
            active.job = make(active.row)

        # The request's own errors (context too long, a template that cannot render) fail it alone.
        self._then(active, start)

    def _row_service(self, row: Row, service: GenerationService | None) -> GenerationService:
        """`service` over `row`; a speculative mode's with the request's own source fork."""
        assert service is not None
        selector = service.selector
        if not self._forks:
            return service.on_target(row)  # type: ignore[arg-type]

        def own(root: DraftSource) -> DraftSource:
            fork: DraftSource = root.fork()  # type: ignore[attr-defined]
            self._roots[id(fork)] = root
            return fork

        if hasattr(selector, "lane_view"):
            # Auto's own rule per request over its forks. While rows share the batch the plan sets their caps
            # and they stay on their sources (a shared tick is no source's own round); alone, auto decides.
            view = selector.lane_view(own, policy=self.plan.gated, hold=lambda: self.plan.deciding)
            return service.on_target(row, selector=view)  # type: ignore[arg-type]
        if not isinstance(selector, FixedSelector) or selector.source is None:
            return service.on_target(row)  # type: ignore[arg-type]
        source = own(selector.source)
        factory = selector.policy_factory

        def policy() -> CapPolicy:
            return factory() if factory is not None else FixedCap(source.max_block)

        lane = _LaneSelector(selector.name, source, policy, self.plan.gated)
        return service.on_target(row, selector=lane)  # type: ignore[arg-type]

    # ---- the step ------------------------------------------------------------------------------------------

    def step(self) -> None:
        """Move every row on by one round (a prompt chunk, or a draft and a verify)."""
        started = self._clock.now() if self._clock is not None else 0.0
        for active in list(self._active):
            if active.task.cancelled:
                self._cancel(active)
        prefilled = self._prefill()
        self._draft()
        stepping = [a for a in self._active if isinstance(a.work, Verify)]
        drafting = 0
        if stepping:
            drafting = self._verify(stepping, started if not prefilled else None)
        width = len(stepping)
        if (width or prefilled) and self._report and self._telemetry is not None:
            self._telemetry.emit(TELEMETRY_ID, BatchStepped(width=width, prefilling=prefilled, drafting=drafting))

    def drained(self) -> None:
        """Nothing decodes until the next job: the batch's width reads zero."""
        if self._report and self._telemetry is not None:
            self._telemetry.emit(TELEMETRY_ID, BatchStepped(width=0, prefilling=0, drafting=0))

    def _prefill(self) -> int:
        """One chunk for every row that is prefilling; returns how many ran one."""
        prefilling = [a for a in self._active if isinstance(a.work, Prefill)]
        for active in prefilling:
            piece = active.work
            assert isinstance(piece, Prefill)
            try:
                done, first = self.backend.prefill(active.row, piece)
            except Exception as exc:
                self._fail(active, exc)
                continue
            if done:
                self._advance(active, first)
        return len(prefilling)

    def _advance(self, active: _Active, result: Any) -> None:
        """Hand `active` the result of a prompt piece or a draft and read its next work (none: it has ended)."""
        job = active.job
        assert job is not None
        self._then(active, lambda: job.advance(result))

    def _next(self, active: _Active) -> None:
        """After the commit: the row's next work, or its end."""
        self._then(active, lambda: None)

    def _then(self, active: _Active, before: Callable[[], object]) -> None:
        """Run `before` on the row's job, then read its next work: an error fails the row alone, no work ends it."""
        try:
            before()
            assert active.job is not None
            active.work = active.job.work()
        except Exception as exc:
            self._fail(active, exc)
            return
        if active.work is None:
            self._end(active)

    # ---- drafting ------------------------------------------------------------------------------------------

    def _root(self, work: Draft) -> RowsDraftSource | None:
        """The source whose forks this draft may share one batched call with (None: it drafts alone)."""
        if not work.sampling.greedy:  # a sampled row's q is part of its seeded output: it drafts alone
            return None
        root = self._roots.get(id(work.source))
        return root if isinstance(root, RowsDraftSource) else None

    def _rows_source(self) -> RowsDraftSource | None:
        """The service's draft source when it is fixed and its forks draft together."""
        if self.service is None:
            return None
        selector = self.service.selector
        source = selector.source if isinstance(selector, FixedSelector) else None
        return source if isinstance(source, RowsDraftSource) else None

    def _draft(self) -> None:
        """Every row waiting on its draft source drafts now (then it waits for its verify)."""
        waiting = [a for a in self._active if isinstance(a.work, Draft)]
        groups: dict[int, list[_Active]] = {}
        for active in waiting:
            assert isinstance(active.work, Draft)
            root = self._root(active.work)
            if root is None or sum(1 for a in waiting if isinstance(a.work, Draft) and self._root(a.work) is root) < 2:
                self._draft_alone(active)
            else:
                groups.setdefault(id(root), []).append(active)
        for together in groups.values():
            self._draft_together(together)

    def _draft_alone(self, active: _Active) -> None:
        work = active.work
        assert isinstance(work, Draft)
        try:
            block = work.source.propose(work.ctx, work.cap, work.sampling, work.uniforms)
        except Exception as exc:  # a failed draft fails its row, never the others
            self._fail(active, exc)
            return
        self._advance(active, block)

    def _draft_together(self, rows: list[_Active]) -> None:
        """One batched draft call for greedy rows (forks of one source); what it cost (its drafts read back, as
        the verify would read them) tells the width plan what drafting together costs."""
        works = [a.work for a in rows]
        assert all(isinstance(w, Draft) for w in works)
        drafts: list[Draft] = [w for w in works if isinstance(w, Draft)]
        root = self._root(drafts[0])
        assert root is not None
        started = self._clock.now() if self._clock is not None else 0.0
        try:
            blocks: Sequence[DraftBlock] = root.propose_rows([(d.source, d.ctx, d.cap) for d in drafts])
            widest = max(d.cap for d in drafts)
            curves = self.plan.curves
            if self._clock is not None and curves is not None and widest > 0 and root is self._rows_source():
                for block in blocks:
                    block.tokens  # noqa: B018 - waits for the drafts, so the time is the drafting's
                self.plan.draft_cost.record(len(drafts), self._clock.now() - started, curves.draft(widest))
        except Exception as exc:  # a failed draft fails its rows, never the others
            for active in rows:
                self._fail(active, exc)
            return
        for active, block in zip(rows, blocks, strict=True):
            self._advance(active, block)

    # ---- the verify ----------------------------------------------------------------------------------------

    def _verify(self, stepping: list[_Active], started: float | None) -> int:
        """Every row's block in one forward, the plan's next caps, each row's verdict and commit; returns how
        many rows verified drafts."""
        calls: dict[Row, Verify] = {}
        for active in stepping:
            assert isinstance(active.work, Verify)
            calls[active.row] = active.work
        try:
            verdicts = self.backend.verify(calls)
        except Exception as exc:  # the shared forward failed: every row in it fails, the engine goes on
            _log.error("engine.step_failed", error=str(exc), rows=len(stepping))
            for active in stepping:
                self._fail(active, exc)
            return 0
        self.steps += 1
        self.widest = max(self.widest, len(stepping))
        drafting = 0
        offered = self.plan.gate.cap  # what this step's adaptive rows were asked to draft (None: their own)
        for active in stepping:
            call = calls[active.row]
            if len(call.block):
                drafting += 1
                self.plan.record(len(call.block), verdicts[active.row].accepted)
            elif offered:
                # Asked to draft and found nothing (lookup without a match, a confidence cut to zero): the row
                # still commits one token for the widened forward, as if its first draft had been rejected.
                self.plan.record(1, 0)
        self.drafting_steps += drafting > 0
        # The next round's caps are chosen as the rows plan it: decide for this width first.
        width = len(stepping)
        depth = sum(a.row.cached_tokens for a in stepping) // width
        greedy = sum(c.sampling.greedy for c in calls.values())
        draft_rows = self.plan.drafting(greedy, width, self._rows_source() is not None)
        self.plan.decide(width, depth, draft_rows)
        keep: dict[Row, int] = {}
        for active in stepping:
            assert active.job is not None
            try:
                rows = active.job.advance(verdicts[active.row])
            except Exception as exc:
                keep[active.row] = 0
                self._fail(active, exc, close=False)
                continue
            keep[active.row] = rows if rows is not None else 0
        self.backend.commit(keep)
        for active in stepping:
            if active in self._active:
                self._next(active)
            else:  # failed on its verdict: it leaves after the commit
                self.backend.close(active.row)
        if started is not None and self._clock is not None:
            cap = max(len(c.block) for c in calls.values())
            self.plan.tick(width, cap, depth, self._clock.now() - started, draft_rows)
        return drafting

    # ---- ends ----------------------------------------------------------------------------------------------

    def _end(self, active: _Active) -> None:
        if active in self._active:
            self._active.remove(active)
            self.backend.close(active.row)
            active.task.push(JobEnded())

    def _cancel(self, active: _Active) -> None:
        if active.job is not None:
            try:
                active.job.cancel()
            except Exception as exc:  # its output is complete as far as it went: a failure on the way out is logged
                _log.warning("engine.cancel_failed", error=str(exc))
        self._end(active)

    def _fail(self, active: _Active, exc: Exception, *, close: bool = True) -> None:
        if active in self._active:
            self._active.remove(active)
            if close:
                self.backend.close(active.row)
            active.task.push(JobFailed(exc))

    def abort(self, failure: Exception) -> None:
        """The engine itself failed: every request gets `failure` now (its rows are dropped with the backend)."""
        actives, self._active = self._active, []
        for active in actives:
            active.task.push(JobFailed(failure))

    def run(self, first: Task, take: Callable[[], Task | None], between: Callable[[], None] = lambda: None) -> None:
        """Serve `first` and every task `take()` returns (None: nothing waiting) while there is room, until no
        row is left (the bench's and tests' loop; the engine thread has its own)."""
        self.admit(first)
        while self._active:
            between()
            while not self.full:
                task = take()
                if task is None:
                    break
                self.admit(task)
            self.step()
        self.drained()

    # ---- one request alone ---------------------------------------------------------------------------------

    def run_alone(self, make: Callable[[Row], StepJob], items: list[Any]) -> Iterator[Any]:
        """Step one request to its end on a row of its own, yielding what it put in `items` as it goes (the
        request's errors are raised here). Closing the iterator cancels the request."""
        task = _Alone()
        self._start(task, make)
        try:
            while True:
                while items:
                    yield items.pop(0)
                if task.ended is not None:
                    break
                # Alone, a prompt piece is a step of its own: the first token is out before the first round.
                if not self._prefill():
                    self.step()
        finally:
            if task.ended is None:
                task.cancelled = True
                for active in list(self._active):
                    if active.task is task:
                        self._cancel(active)
        if isinstance(task.ended, JobFailed):
            raise task.ended.error


class _DecodeJob:
    """A bare decode as a StepJob: the decoder over a row, its events collected."""

    def __init__(self, decoder: RequestDecoder) -> None:
        self.decoder = decoder

    def work(self) -> Work | None:
        return self.decoder.work()

    def advance(self, result: Any) -> int | None:
        return self.decoder.advance(result)

    def cancel(self) -> None:
        self.decoder.cancel()


def decode(
    target: TargetModel,
    prompt: Sequence[int],
    sampling: SamplingParams,
    stop: StopRule,
    clock: Clock,
    *,
    source: DraftSource | None = None,
    cap_policy: CapPolicy | None = None,
    selection: Selection | None = None,
    reuse_prefix: int = 0,
    context_window: int | None = None,
    halt: Callable[[], bool] | None = None,
    snapshots: Sequence[int] = (),
    on_snapshot: Callable[[], object] | None = None,
) -> Iterator[DecodeEvent]:
    """Generate from `prompt` on a bare target, yielding the decode events (see `RequestDecoder`): the step
    engine over that one row. Closing the iterator cancels the request.

    Args:
        source, cap_policy: a fixed source and its cap policy (or `selection`, a selector's choice).
        Others: as `RequestDecoder`.
    """
    from mlx_dspark.domain.decoder import selection_of

    chosen = selection or selection_of(source, cap_policy)
    events: list[Any] = []

    def make(row: Row) -> StepJob:
        decoder = RequestDecoder(
            row,
            prompt,
            sampling,
            stop,
            clock,
            events.append,
            selection=chosen,
            reuse_prefix=reuse_prefix,
            context_window=context_window,
            halt=halt,
            snapshots=snapshots,
            on_snapshot=on_snapshot,
        )
        return _DecodeJob(decoder)

    yield from Engine(SerialRows(target)).run_alone(make, events)
