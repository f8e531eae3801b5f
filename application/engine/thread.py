"""The engine thread: one thread owns all MLX work; async callers submit jobs and read their events from queues.

HTTP handlers never touch the model. A decode job (`submit_decode`) is a request's StepJob, stepped by the step
engine (`step.py`) beside every other decoding request; its items travel to the caller's asyncio queue as
`JobEvent`s through `loop.call_soon_threadsafe`. Cancelling a job (client disconnect) ends its row at the
next step. Other work (`submit`) is a function of the engine's GenerationService returning an iterator:
quick work (token counting) runs between two steps, so it never waits for a generation (a server turn is
rendered and tokenized in a worker thread before it is submitted: the tokenizer adapter serialises its calls);
exclusive work (a model switch, a race, a timing) waits until the decoding rows have finished and runs alone.

The queue is bounded (`max_queue` jobs waiting; one more is refused with `Overloaded`).

The thread supervises itself: an error that escapes the serving loop (a bug; a failed request never does)
ends every in-flight job at once with `EngineRestarted`, resets the target and serves on with the model still
loaded; repeated failures within a minute reload the model. `restarts` and `last_restart` say what happened.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs
import structlog

from mlx_dspark.application.engine.jobs import Emit, JobEnded, JobEvent, JobFailed, JobItem, StepJob
from mlx_dspark.application.engine.rows import RowsBackend, SerialRows
from mlx_dspark.application.engine.step import Engine, forkable, speculates
from mlx_dspark.domain.errors import CapacityExceeded, Overloaded
from mlx_dspark.domain.ports import TargetModel

if TYPE_CHECKING:  # the generation use case imports the engine's decoder
    from mlx_dspark.application.generation import GenerationService

T = TypeVar("T")
Work = Callable[["GenerationService"], Iterator[T]]
DecodeWork = Callable[["GenerationService", Emit], StepJob]
RowsFactory = Callable[[TargetModel, bool], RowsBackend | None]  # (target, rows speculate) -> batched rows
_log = structlog.get_logger("mlx_dspark.engine")


@attrs.define(auto_exc=True, kw_only=True)
class EngineDown(CapacityExceeded):
    """The engine thread is not running (the model failed to load, or the thread died)."""


@attrs.define(auto_exc=True, kw_only=True)
class EngineRestarted(CapacityExceeded):
    """The engine failed while this request was in flight and restarted; the request may be sent again."""


@attrs.frozen
class Restart:
    """One recovery of the engine thread: when (Unix time), why, and whether the model was loaded again."""

    at: float
    cause: str
    reloaded: bool


_CAUSE_CHARS = 300  # a cause is shown on /health: bounded
_CRASH_WINDOW_S = 60.0
_CRASHES_BEFORE_RELOAD = 3  # failures within the window after which the model is loaded again
_WAKE = object()  # puts the idle engine thread to work on the quick lane


@attrs.frozen
class SideBySide:
    """Requests of several services as rows of one batch: a private step engine over the served target's
    batched rows, or why they cannot share one (`engine` None)."""

    engine: Engine | None
    reason: str = ""


class EngineJob(Generic[T]):
    """One submitted job as seen from the event loop: iterate it, or cancel it."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        work: Work[T] | None = None,
        decode: DecodeWork | None = None,
        exclusive: bool = False,
    ) -> None:
        self.work = work
        self.decode = decode
        self.exclusive = exclusive  # runs alone on the engine's own service, never beside decoding rows
        self._loop = loop
        self._queue: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.finished = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the job at its next step (safe from any thread, idempotent)."""
        self._cancelled.set()

    def start(self, service: GenerationService, emit: Emit) -> StepJob:
        """The decode job over `service` (the step engine's Task)."""
        assert self.decode is not None
        return self.decode(service, emit)

    def push(self, event: JobEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the caller's loop is gone: nobody is listening any more
            self._cancelled.set()

    async def next(self, timeout: float | None = None) -> T:
        """The next item.

        Raises:
            StopAsyncIteration: the job is done.
            TimeoutError: nothing arrived within `timeout` seconds (the job goes on).
            Exception: whatever the job raised.
        """
        if self.finished:
            raise StopAsyncIteration
        # A checkpoint per item: with items queued ahead, taking one never suspends, and a consumer whose client
        # hung up (its task cancelled) must still see the cancellation here. asyncio.timeout, not wait_for: on
        # Python 3.11, wait_for hands back an item that arrives together with a cancellation.
        await asyncio.sleep(0)
        if timeout is None:
            event = await self._queue.get()
        else:
            async with asyncio.timeout(timeout):
                event = await self._queue.get()
        if isinstance(event, JobEnded):
            self.finished = True
            raise StopAsyncIteration
        if isinstance(event, JobFailed):
            self.finished = True
            raise event.error
        result: T = event.value
        return result

    async def __aiter__(self) -> AsyncIterator[T]:
        while True:
            try:
                yield await self.next()
            except StopAsyncIteration:
                return


class EngineThread:
    """Owns the GenerationService, its step engine and the one thread that runs them.

    Args:
        generator_factory: builds the GenerationService (loads the model) on the engine thread.
        max_queue: jobs that may wait (both lanes together) besides the running ones.
        name: the thread's name.
        max_batch: requests decoded together (1: strictly one at a time).
        rows: the target's batched rows, when it has them (else requests run one at a time on the target).
        on_serve: runs on the engine thread with each GenerationService before it is served (after the load,
            at every switch): facts measured there can be read by callers without waiting for the engine.
    """

    def __init__(
        self,
        generator_factory: Callable[[], GenerationService],
        *,
        max_queue: int = 16,
        name: str = "mlx-dspark-engine",
        max_batch: int = 1,
        rows: RowsFactory | None = None,
        on_serve: Callable[[GenerationService], None] | None = None,
    ) -> None:
        self._factory = generator_factory
        self._on_serve = on_serve
        self._max_batch = max_batch
        self._rows = rows
        self._engine: Engine | None = None
        self._jobs: queue.Queue[Any] = queue.Queue()  # EngineJob, _WAKE, or None (stop)
        self._quick: queue.SimpleQueue[EngineJob[Any]] = queue.SimpleQueue()
        self._max_queue = max_queue
        self._waiting = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._ready = threading.Event()
        self._generator: GenerationService | None = None
        self._held: EngineJob[Any] | None = None  # an exclusive job waiting for the rows to finish
        self.load_error: BaseException | None = None
        self._stopping = False
        self.restarts = 0
        self.last_restart: Restart | None = None
        self._crashes: list[float] = []  # monotonic times of recent failures (the reload rule's window)
        self._running: EngineJob[Any] | None = None  # the iterator job `_run` serves now

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive() and not self._ready.is_set():
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """End the running jobs now (their callers get `EngineDown`; the rows stop at their next step), answer the
        queued ones the same way, end the thread. Safe from any thread: a shutdown never waits for a generation."""
        self._stopping = True
        self._end_in_flight()
        self._jobs.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _end_in_flight(self) -> None:
        down = EngineDown(message="the server is shutting down")
        engine, running = self._engine, self._running
        jobs: list[Any] = ([running] if running is not None else []) + (engine.tasks() if engine is not None else [])
        for job in jobs:
            job.push(JobFailed(down))
            job.cancel()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (or failed to load)."""
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._generator is not None and self.alive

    @property
    def alive(self) -> bool:
        """False once the thread has died or failed to load: /health reports 503."""
        if self.load_error is not None:
            return False
        return self._thread.is_alive() or (not self._ready.is_set() and not self._stopping)

    @property
    def generator(self) -> GenerationService:
        """The loaded GenerationService.

        Raises:
            EngineDown: not loaded (yet, or ever).
        """
        if self._generator is None:
            raise EngineDown(message=self._down_message())
        return self._generator

    @property
    def engine(self) -> Engine | None:
        """The step engine serving decode jobs (its counters: steps, widest, migrations)."""
        return self._engine

    def _down_message(self) -> str:
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if not self._ready.is_set():
            return "the model is still loading"
        if self._stopping:
            return "the server is shutting down"
        return "the inference engine is not running"

    # ---- jobs ---------------------------------------------------------------------------------------------

    def switch(
        self, factory: Callable[[GenerationService], GenerationService], loop: asyncio.AbstractEventLoop | None = None
    ) -> EngineJob[GenerationService]:
        """Queue a job that builds a new GenerationService from the current one and serves it from then on.

        Queued after the jobs already waiting, so none of them sees a half-switched engine; on failure the
        current GenerationService stays.
        """

        def work(current: GenerationService) -> Iterator[GenerationService]:
            new = factory(current)
            self._serving(new)
            self._generator = new
            self._engine = self._make_engine(new)
            _log.info("engine.switched", model=new.model.name, mode=new.mode)
            yield new

        return self.submit(work, loop, exclusive=True)

    def submit_decode(self, work: DecodeWork, loop: asyncio.AbstractEventLoop | None = None) -> EngineJob[Any]:
        """Queue a decode job: `work(service, emit)` builds the request's StepJob over its row's service.

        Raises:
            EngineDown: the engine is not running.
            Overloaded: `max_queue` jobs are already waiting.
        """
        job: EngineJob[Any] = EngineJob(self._loop(loop), decode=work)
        self._enqueue(job, quick=False)
        return job

    def submit(
        self,
        work: Work[T],
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        quick: bool = False,
        exclusive: bool = False,
    ) -> EngineJob[T]:
        """Queue `work` (an iterator over the engine's GenerationService) for the engine thread: `quick` work
        (short, no decoding) runs between two steps; any other waits until the decoding rows before it have
        finished and then runs alone (`exclusive`: the same, said explicitly).

        Raises:
            EngineDown: the engine is not running.
            Overloaded: `max_queue` jobs are already waiting.
        """
        job: EngineJob[T] = EngineJob(self._loop(loop), work=work, exclusive=exclusive or not quick)
        self._enqueue(job, quick=quick)
        return job

    @staticmethod
    def _loop(loop: asyncio.AbstractEventLoop | None) -> asyncio.AbstractEventLoop:
        return loop or asyncio.get_running_loop()

    def _enqueue(self, job: EngineJob[Any], *, quick: bool) -> None:
        if not self.alive or self._stopping:
            raise EngineDown(message=self._down_message())
        with self._lock:
            if self._waiting >= self._max_queue:
                raise Overloaded(
                    message=f"the server is busy: {self._waiting} requests are already waiting; try again in 1s"
                )
            self._waiting += 1
        if quick:
            self._quick.put(job)
            self._jobs.put(_WAKE)
        else:
            self._jobs.put(job)

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for the engine thread, both lanes (not counting the running ones)."""
        return self._waiting

    def _taken(self) -> None:
        with self._lock:
            self._waiting -= 1

    # ---- the thread ---------------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            try:
                generator = self._factory()
                self._serving(generator)
                self._generator = generator
                self._engine = self._make_engine(generator)
            except BaseException as exc:
                self.load_error = exc
                _log.error("engine.load_failed", error=str(exc), exc_info=exc)
                return
            finally:
                self._ready.set()
            _log.info("engine.ready", model=generator.model.name, mode=generator.mode, max_batch=self._engine.max_batch)
            while True:
                try:
                    self._serve()
                    return
                except Exception as exc:  # a bug in the serving loop: end what is in flight, serve on
                    if not self._recover(exc):
                        return
        finally:
            self._drain()

    def _serve(self) -> None:
        """Serve jobs until the stop marker: step while rows decode, block on the queue while none do."""
        while True:
            engine = self._engine
            assert engine is not None and self._generator is not None
            if engine.active:
                if self._stopping:
                    for task in engine.tasks():
                        task.cancel()
                self._admit_waiting(engine)
                self._run_quick(self._generator)
                engine.step()
                if not engine.active:
                    engine.drained()
                continue
            job = self._held if self._held is not None else self._jobs.get()
            self._held = None
            if job is None:
                self._flush_prefix_cache(self._generator)
                return
            if job is _WAKE:
                self._run_quick(self._generator)
                continue
            self._taken()
            if self._stopping:  # queued before stop(): answered, not run
                job.push(JobFailed(EngineDown(message=self._down_message())))
                continue
            if job.decode is not None:
                engine.admit(job)
            else:
                self._run(job, self._generator)
            self._run_quick(self._generator)

    def _admit_waiting(self, engine: Engine) -> None:
        """Queued decode jobs join the rows while there is room; an exclusive job holds back the rest until
        the rows have finished."""
        while self._held is None and not self._stopping and not engine.full:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self._jobs.put(None)
                return
            if job is _WAKE:  # quick jobs are served between steps
                continue
            if job.decode is None:  # still counted as waiting until it runs
                self._held = job
                return
            self._taken()
            engine.admit(job)

    def _recover(self, exc: Exception) -> bool:
        """After a failure of the serving loop: end every in-flight job with `EngineRestarted`, reset the target
        (its cache may be half-written) and the rows, and reload the model when failures repeat. False when
        the engine cannot go on (the reload failed)."""
        cause = f"{type(exc).__name__}: {exc}"[:_CAUSE_CHARS]
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < _CRASH_WINDOW_S] + [now]
        reload = len(self._crashes) >= _CRASHES_BEFORE_RELOAD
        _log.error("engine.crashed", error=cause, restarts=self.restarts + 1, reload=reload, exc_info=exc)
        message = f"the inference engine failed and restarted ({cause}); send the request again"
        failure = EngineRestarted(message=message)
        if self._engine is not None:
            self._engine.abort(failure)
        if self._running is not None:
            self._running.push(JobFailed(failure))
            self._running = None
        self.restarts += 1
        self.last_restart = Restart(at=time.time(), cause=cause, reloaded=reload)
        try:
            if reload:
                self._crashes = []
                generator = self._factory()
                self._serving(generator)
                self._generator = generator
            assert self._generator is not None
            self._generator.model.target.reset(0)
            self._engine = self._make_engine(self._generator)
        except BaseException as err:
            self.load_error = err
            _log.error("engine.restart_failed", error=str(err), exc_info=err)
            return False
        _log.warning("engine.restarted", restarts=self.restarts, reloaded=reload)
        return True

    def _serving(self, generator: GenerationService) -> None:
        if self._on_serve is None:
            return
        try:
            self._on_serve(generator)
        except Exception as exc:  # a fact that cannot be measured must not stop the model being served
            _log.warning("engine.on_serve_failed", error=str(exc))

    def _run_quick(self, generator: GenerationService) -> None:
        while True:
            try:
                job = self._quick.get_nowait()
            except queue.Empty:
                return
            self._taken()
            if self._stopping:
                job.push(JobFailed(EngineDown(message=self._down_message())))
                continue
            self._run(job, generator, between=False)

    def _run(self, job: EngineJob[Any], generator: GenerationService, *, between: bool = True) -> None:
        """An iterator job, alone on the engine's service (quick jobs still run between its items)."""
        if job.cancelled:
            job.push(JobEnded())
            return
        assert job.work is not None
        items: Iterator[Any] | None = None
        outer, self._running = self._running, job
        try:
            items = job.work(generator)
            for item in items:
                job.push(JobItem(item))
                if job.cancelled:
                    break
                if between:
                    self._run_quick(generator)
        except Exception as exc:  # a failed request must never take the engine down
            job.push(JobFailed(exc))
            return
        finally:
            self._running = outer
            close = getattr(items, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as exc:  # its output is complete: a failure on the way out is logged
                    _log.warning("engine.close_failed", error=str(exc))
        job.push(JobEnded())

    @staticmethod
    def _flush_prefix_cache(generator: GenerationService) -> None:
        """At shutdown, spill the prefix cache's in-memory entries to disk (when a directory is set)."""
        cache = generator.prefix_cache
        if cache is None:
            return
        try:
            written = cache.flush()
        except Exception as exc:  # a full disk must not turn a clean shutdown into a crash
            _log.warning("prefix_cache.flush_failed", error=str(exc))
            return
        if written:
            _log.info("prefix_cache.flushed", entries=written)

    def _make_engine(self, generator: GenerationService) -> Engine:
        """The step engine over the service's target: its batched rows where the target and mode have them,
        else one request at a time on the target itself."""
        target = generator.model.target
        rows: RowsBackend | None = None
        if self._max_batch > 1 and self._rows is not None and forkable(generator):
            rows = self._rows(target, speculates(generator))
            if rows is None:
                _log.info("engine.batching_off", reason="the target's caches have no batched form", mode=generator.mode)
        return Engine(
            rows or SerialRows(target),
            generator,
            max_batch=self._max_batch if rows is not None else 1,
            observe_forwards=True,
        )

    def side_by_side(self, services: Sequence[GenerationService]) -> SideBySide:
        """A private step engine whose rows decode requests of `services` (modes over the served model) together,
        each task admitted with its own service (`Engine.admit(task, service)`); or why they cannot.

        Runs on this thread inside an exclusive job (a race), while the server's own rows are idle: the private
        engine opens its own batched rows over the same target and closes them when its tasks end.
        """
        if self._max_batch < 2 or self._rows is None:
            return SideBySide(None, "the server decodes one request at a time (max batch 1)")
        if not services:
            return SideBySide(None, "nothing to decode")
        target = services[0].model.target
        for service in services:
            if service.model.target is not target:
                return SideBySide(None, f"mode {service.mode} decodes another model")
            if not forkable(service):
                return SideBySide(None, f"mode {service.mode} cannot give each row its own draft source")
        speculative = any(speculates(s) for s in services)
        rows = self._rows(target, speculative)
        if rows is None:
            kind = "speculative decoding" if speculative else "decoding"
            return SideBySide(None, f"the target's caches have no batched form for {kind}")
        return SideBySide(Engine(rows, services[0], max_batch=self._max_batch, report_steps=False))

    def _drain(self) -> None:
        """Answer every queued job once the thread is ending, so no caller waits forever."""
        down = EngineDown(message=self._down_message())
        if self._held is not None:
            self._held.push(JobFailed(down))
            self._held = None
        if self._engine is not None:
            self._engine.abort(down)
        for lane in (self._jobs, self._quick):
            while True:
                try:
                    job = lane.get_nowait()
                except queue.Empty:
                    break
                if isinstance(job, EngineJob):
                    job.push(JobFailed(down))
