"""The engine: one thread owns all MLX work; async callers submit jobs and read their results from queues.

HTTP handlers never touch the model. Each job is a function of the engine's GenerationService returning an
iterator; its items travel to the caller's asyncio queue through `loop.call_soon_threadsafe`. Cancelling a
job (client disconnect) closes its iterator at the next item, which stops the decode loop.

The queue is bounded (`max_queue` jobs waiting; one more is refused with `Overloaded`). Quick jobs (token
counting) run on the same thread between two items of the running job, so they never wait for a whole
generation and the tokenizer is only ever used from this thread.

The thread supervises itself: an error that escapes the serving loop (a bug; a failed request never does)
ends every in-flight job at once with `EngineRestarted`, resets the target and serves on with the model still
loaded; repeated failures within a minute reload the model. `restarts` and `last_restart` say what happened.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Generic, TypeVar

import attrs
import structlog

from mlx_dspark.application.batching import BatchBackendFactory, BatchScheduler, batchable
from mlx_dspark.application.generation import GenerationService
from mlx_dspark.domain.errors import CapacityExceeded, Overloaded

T = TypeVar("T")
Work = Callable[[GenerationService], Iterator[T]]
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

_ITEM, _ERROR, _END = "item", "error", "end"
_WAKE = object()  # puts the idle engine thread to work on the quick lane


class EngineJob(Generic[T]):
    """One submitted job as seen from the event loop: iterate it, or cancel it."""

    def __init__(self, work: Work[T], loop: asyncio.AbstractEventLoop, *, exclusive: bool = False) -> None:
        self.work = work
        self.exclusive = exclusive  # runs alone on the engine's own service, never in a batch lane
        self._loop = loop
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.finished = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the job at its next item (safe from any thread, idempotent)."""
        self._cancelled.set()

    def _push(self, kind: str, value: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))
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
        if timeout is None:
            kind, value = await self._queue.get()
        else:
            kind, value = await asyncio.wait_for(self._queue.get(), timeout)
        if kind == _END:
            self.finished = True
            raise StopAsyncIteration
        if kind == _ERROR:
            self.finished = True
            raise value
        result: T = value
        return result

    async def __aiter__(self) -> AsyncIterator[T]:
        while True:
            try:
                yield await self.next()
            except StopAsyncIteration:
                return


class EngineThread:
    """Owns the GenerationService and the one thread that runs it.

    Args:
        generator_factory: builds the GenerationService (loads the model) on the engine thread.
        max_queue: jobs that may wait (both lanes together) besides the running one.
        name: the thread's name.
        max_batch: requests decoded together (1: strictly one at a time).
        batch_backend: the target's batched form, when it has one (plain and fixed speculative modes).
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
        batch_backend: BatchBackendFactory | None = None,
        on_serve: Callable[[GenerationService], None] | None = None,
    ) -> None:
        self._factory = generator_factory
        self._on_serve = on_serve
        self._max_batch = max_batch
        self._batch_backend = batch_backend
        self._batcher: BatchScheduler | None = None
        self._jobs: queue.Queue[Any] = queue.Queue()  # EngineJob, _WAKE, or None (stop)
        self._quick: queue.SimpleQueue[EngineJob[Any]] = queue.SimpleQueue()
        self._max_queue = max_queue
        self._waiting = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._ready = threading.Event()
        self._generator: GenerationService | None = None
        self._held: EngineJob[Any] | None = None  # an exclusive job waiting for the batch to drain
        self.load_error: BaseException | None = None
        self._stopping = False
        self.restarts = 0
        self.last_restart: Restart | None = None
        self._crashes: list[float] = []  # monotonic times of recent failures (the reload rule's window)
        self._running: EngineJob[Any] | None = None  # the job `_run` serves now (ended at once on a failure)

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
        batcher, running = self._batcher, self._running
        jobs = ([running] if running is not None else []) + (batcher.jobs() if batcher is not None else [])
        for job in jobs:
            job._push(_ERROR, down)
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
            _log.info("engine.switched", model=new.model.name, mode=new.mode)
            yield new

        return self.submit(work, loop, exclusive=True)

    def submit(
        self,
        work: Work[T],
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        quick: bool = False,
        exclusive: bool = False,
    ) -> EngineJob[T]:
        """Queue `work` for the engine thread; `quick` work (short, no decoding) runs between two items.

        `exclusive` work (a model switch, a race, a timing, another mode's generation) waits until the
        batched rows before it have finished and then runs alone on the engine's service.

        Raises:
            EngineDown: the engine is not running.
            Overloaded: `max_queue` jobs are already waiting.
        """
        if not self.alive or self._stopping:
            raise EngineDown(message=self._down_message())
        job: EngineJob[T] = EngineJob(work, loop or asyncio.get_running_loop(), exclusive=exclusive)
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
        return job

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for the engine thread, both lanes (not counting the one running)."""
        return self._waiting

    def _taken(self) -> None:
        with self._lock:
            self._waiting -= 1

    def _main(self) -> None:
        try:
            try:
                generator = self._factory()
                self._serving(generator)
                self._generator = generator
            except BaseException as exc:
                self.load_error = exc
                _log.error("engine.load_failed", error=str(exc), exc_info=exc)
                return
            finally:
                self._ready.set()
            self._batcher = self._make_batcher(self._generator)
            _log.info(
                "engine.ready",
                model=self._generator.model.name,
                mode=self._generator.mode,
                max_batch=self._max_batch if self._batcher is not None else 1,
            )
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
        """Serve jobs until the stop marker."""
        assert self._generator is not None
        while True:
            job = self._held if self._held is not None else self._jobs.get()
            self._held = None
            if job is None:
                self._flush_prefix_cache(self._generator)
                return
            if job is not _WAKE:
                self._taken()
                if self._stopping:  # queued before stop(): answered, not run
                    job._push(_ERROR, EngineDown(message=self._down_message()))
                    continue
                if self._batcher is not None and not job.exclusive:
                    self._batcher.run(job, self._take, lambda: self._stopping, self._quick_between)
                else:
                    served = self._generator
                    self._run(job, served)
                    if self._generator is not served:  # a switch: batch the new service's target
                        self._batcher = self._make_batcher(self._generator)
            self._run_quick(self._generator)

    def _recover(self, exc: Exception) -> bool:
        """After a failure of the serving loop: end every in-flight job with `EngineRestarted`, reset the target
        (its cache may be half-written) and the batch, and reload the model when failures repeat. False when
        the engine cannot go on (the reload failed)."""
        cause = f"{type(exc).__name__}: {exc}"[:_CAUSE_CHARS]
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < _CRASH_WINDOW_S] + [now]
        reload = len(self._crashes) >= _CRASHES_BEFORE_RELOAD
        _log.error("engine.crashed", error=cause, restarts=self.restarts + 1, reload=reload, exc_info=exc)
        message = f"the inference engine failed and restarted ({cause}); send the request again"
        failure = EngineRestarted(message=message)
        if self._batcher is not None:
            self._batcher.abort(failure)
        if self._running is not None:
            self._running._push(_ERROR, failure)
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
            self._batcher = self._make_batcher(self._generator)
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
                job._push(_ERROR, EngineDown(message=self._down_message()))
                continue
            self._run(job, generator, between=False)

    def _run(self, job: EngineJob[Any], generator: GenerationService, *, between: bool = True) -> None:
        if job.cancelled:
            job._push(_END, None)
            return
        items: Iterator[Any] | None = None
        outer, self._running = self._running, job
        try:
            items = job.work(generator)
            for item in items:
                job._push(_ITEM, item)
                if job.cancelled:
                    break
                if between:
                    self._run_quick(generator)
        except Exception as exc:  # a failed request must never take the engine down
            job._push(_ERROR, exc)
            return
        finally:
            self._running = outer
            close = getattr(items, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as exc:  # its output is complete: a failure on the way out is logged
                    _log.warning("engine.close_failed", error=str(exc))
        job._push(_END, None)

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

    def _make_batcher(self, generator: GenerationService) -> BatchScheduler | None:
        if self._max_batch < 2 or self._batch_backend is None or not batchable(generator):
            return None
        backend = self._batch_backend(generator.model.target)
        if backend is None:  # e.g. quantized KV caches: served one at a time
            _log.info("engine.batching_off", reason="the target's caches have no batched form")
            return None
        if not batchable(generator, backend):
            _log.info("engine.batching_off", reason="this target batches plain decoding only", mode=generator.mode)
            return None
        return BatchScheduler(
            backend,
            generator,
            max_batch=self._max_batch,
            push=lambda job, kind, value: job._push(kind, value),
            observe_forwards=True,
        )

    def _quick_between(self) -> None:
        if self._generator is not None:
            self._run_quick(self._generator)

    def _take(self) -> EngineJob[Any] | None:
        """A queued job for the batch, or None when none waits (the stop marker stays queued).

        An exclusive job is held back (and nothing after it is taken) until the batch drains.
        """
        while self._held is None:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return None
            if job is None:
                self._jobs.put(None)
                return None
            if job is _WAKE:  # quick jobs are served between ticks
                continue
            if job.exclusive:  # still counted as waiting until it runs
                self._held = job
                return None
            self._taken()
            if self._stopping:
                job._push(_ERROR, EngineDown(message=self._down_message()))
                continue
            result: EngineJob[Any] = job
            return result
        return None

    def _drain(self) -> None:
        """Answer every queued job once the thread is ending, so no caller waits forever."""
        if self._held is not None:
            self._held._push(_ERROR, EngineDown(message=self._down_message()))
            self._held = None
        for lane in (self._jobs, self._quick):
            while True:
                try:
                    job = lane.get_nowait()
                except queue.Empty:
                    break
                if isinstance(job, EngineJob):
                    job._push(_ERROR, EngineDown(message=self._down_message()))
