"""Continuous batching for plain decoding: many engine jobs share one batched target forward per step.

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
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import attrs
import structlog

from mlx_dspark.application.generation import GenerationService
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.drafting.selection import FixedSelector
from mlx_dspark.domain.events import BatchStepped
from mlx_dspark.domain.ports import RollbackKind, TargetModel
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.outcome import Acceptance

_GREEDY = SamplingParams()
TELEMETRY_ID = "batch"  # the request id the scheduler's BatchStepped events carry (they belong to no request)
_log = structlog.get_logger("mlx_dspark.batching")


class BatchBackend(Protocol):
    """A target's batched plain-decoding form (adapters/mlx/batched_target.py)."""

    @property
    def width(self) -> int: ...

    def feed(self, row: int, tokens: Sequence[int]) -> None:
        """Queue prompt tokens of `row` (starting the row)."""
        ...

    def extend_step(self, row: int) -> bool:
        """Prefill the next chunk of a piece before the prompt's end; True once the queued tokens are in."""
        ...

    def prefill_step(self, row: int, sampling: SamplingParams, uniform: float) -> int | None:
        """Prefill the next chunk of the prompt's end; after the last one, the first token (the row joins)."""
        ...

    def step(
        self, anchors: dict[int, int], sampling: dict[int, SamplingParams], uniforms: dict[int, float]
    ) -> dict[int, int]: ...

    def close(self, row: int) -> None: ...

    def adopt(self, row: int) -> None:
        """Move the serial target's cached rows into the batch as `row` (the serial target keeps its copy)."""
        ...


BatchBackendFactory = Callable[[TargetModel], BatchBackend | None]


def batchable(generator: GenerationService) -> bool:
    """Whether requests of this service decode plainly (speculative and auto modes run serially)."""
    selector = generator.selector
    return isinstance(selector, FixedSelector) and selector.source is None


class _Cancelled(Exception):
    """Raised inside a lane whose job was cancelled while it waited for the scheduler."""


@attrs.define
class _Call:
    kind: str  # "extend" | "prefill" | "step" (batched rows); "solo" | "solo-prefill" | "solo-verify" (serial)
    tokens: list[int]
    sampling: SamplingParams
    uniform: float
    run: Callable[[], Any] | None = None  # the serial target call of a solo row


class RowTarget:
    """The TargetModel port of one row: plain decoding only, every forward done by the scheduler.

    A row admitted alone is solo: it runs on the serial target (today's path, prefix reuse included) until
    another row needs the batch; then the scheduler moves its cached rows into the batch (`to_batched`).
    """

    def __init__(self, lane: Lane, vocab_size: int, solo: TargetModel | None = None) -> None:
        self._lane = lane
        self.vocab_size = vocab_size
        self.solo = solo
        self._ids: list[int] = []
        self._anchor: int | None = None

    def to_batched(self) -> None:
        """The row now lives in the batch; its cached ids are the serial target's."""
        assert self.solo is not None
        self._ids = list(self.solo.cached_ids)
        self.solo = None

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
        solo = self.solo
        if solo is not None:
            kept: int = self._solo(lambda: solo.reset(keep, capture=capture))
            return kept
        if self._ids:
            raise RuntimeError("a batched row decodes one request")
        return 0

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
        if len(block):
            raise RuntimeError("batched rows decode plainly (no drafts)")
        if self._anchor is not None:
            raise RuntimeError("verify while the previous verify awaits its commit")
        solo = self.solo
        if solo is not None:
            call = _Call(
                "solo-verify",
                [anchor],
                sampling,
                uniforms[0],
                lambda: solo.verify(anchor, block, sampling, uniforms, ahead=ahead),
            )
        else:
            call = _Call("step", [anchor], sampling, uniforms[0])
        self._anchor = anchor
        result = self._lane.call(call)
        if isinstance(result, Acceptance):  # still solo: the serial target holds the pending verify
            return result
        return Acceptance(accepted=0, next_token=result)

    def commit(self, keep_rows: int) -> None:
        if self.solo is not None:
            solo = self.solo
            self._anchor = None
            self._solo(lambda: solo.commit(keep_rows))
            return
        anchor, self._anchor = self._anchor, None
        if anchor is None:
            raise RuntimeError("commit without a verify")
        if keep_rows:
            self._ids.append(anchor)
        else:  # the loop is finishing: the row's cache holds one row too many, so it must not step again
            self._lane.spent = True

    def take_features(self) -> None:
        return None

    # Prefix-cache hooks: a solo row is the serial target; a batched row has no state to save (yet).

    @property
    def state_tag(self) -> str:
        return self.solo.state_tag if self.solo is not None else ""  # "": no states while batched

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
        if solo is None:
            raise RuntimeError("a batched row has no state to save")
        return self._solo(solo.save_state)

    def load_state(self, state: Any, keep: int) -> int:
        solo = self.solo
        if solo is None:
            raise RuntimeError("a batched row cannot load a state")
        loaded: int = self._solo(lambda: solo.load_state(state, keep))
        return loaded


class Lane:
    """One job's thread, run strictly in turns with the scheduler."""

    def __init__(self, row: int, job: Any, push: Callable[[Any, str, Any], None]) -> None:
        self.row = row
        self.job = job
        self.call_pending: _Call | None = None
        self.done = False
        self.spent = False
        self.fed: _Call | None = None  # the prompt piece the backend holds for this row
        self.service: GenerationService | None = None  # set before the first resume
        self.target: RowTarget | None = None
        self._push = push
        self._result: int | BaseException | None = None
        self._go = threading.Event()
        self._parked = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"mlx-dspark-row-{row}", daemon=True)

    # In the lane's thread.

    def call(self, request: _Call) -> Any:
        if self.spent:
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
        try:
            items = self.job.work(self.service)
            for item in items:
                self._push(self.job, "item", item)
                if self.job.cancelled:
                    break
        except _Cancelled:
            pass
        except Exception as exc:  # a failed row must never disturb the others
            self._push(self.job, "error", exc)
            return
        finally:
            close = getattr(items, "close", None)
            try:
                if close is not None:
                    close()
            finally:
                self.done = True
                self.call_pending = None
                self._parked.set()
        self._push(self.job, "end", None)

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
        generator: the engine's service; each lane gets a copy of it over its own RowTarget.
        max_batch: rows decoded together.
        push: delivers a job's item / error / end to its caller (the engine's queue plumbing).
    """

    def __init__(
        self,
        backend: BatchBackend,
        generator: GenerationService,
        *,
        max_batch: int,
        push: Callable[[Any, str, Any], None],
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._backend = backend
        self._generator = generator
        self._max_batch = max_batch
        self._push = push
        self._lanes: list[Lane] = []
        self._next_row = 0
        self.steps = 0  # batched forwards
        self.widest = 0
        self.migrations = 0  # solo rows moved into the batch

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

    def _report(self, width: int, prefilling: int) -> None:
        self._generator.telemetry.emit(TELEMETRY_ID, BatchStepped(width=width, prefilling=prefilling))

    def _admit(self, job: Any) -> None:
        if job.cancelled:
            self._push(job, "end", None)
            return
        row = self._next_row
        self._next_row += 1
        lane = Lane(row, job, self._push)
        serial = self._generator.model.target
        lane.target = RowTarget(lane, serial.vocab_size, solo=None if self._lanes else serial)
        lane.service = self._generator.on_target(lane.target)
        self._lanes.append(lane)
        lane.resume()  # runs until its prefill call (or its end)
        self._settle(lane)

    def _settle(self, lane: Lane) -> None:
        """A lane that ended or was cancelled leaves the batch now."""
        if lane.done:
            self._backend.close(lane.row)
            self._lanes.remove(lane)
        elif lane.job.cancelled and lane.call_pending is not None:
            self._backend.close(lane.row)
            lane.resume(_Cancelled())
            self._settle(lane)

    def _tick(self) -> None:
        solo, prefilled, width = self._tick_rows()
        if width or solo or prefilled:
            self._report(width or solo, prefilled)

    def _tick_rows(self) -> tuple[int, int, int]:
        """One tick; returns (solo rows decoded, rows that ran a prompt chunk, width of the batched step)."""
        solo = prefilled = 0
        for lane in list(self._lanes):
            self._settle(lane)
        for lane in [
            lane for lane in self._lanes if lane.call_pending is not None and lane.call_pending.kind.startswith("solo")
        ]:
            call = lane.call_pending
            assert call is not None and call.run is not None and lane.target is not None
            if call.kind == "solo-verify" and len(self._lanes) > 1:  # another row wants the batch: move in
                self._backend.adopt(lane.row)
                lane.target.to_batched()
                call.kind = "step"
                self.migrations += 1
                continue
            solo += call.kind == "solo-verify"
            prefilled += call.kind == "solo-prefill"
            try:
                result = call.run()
            except Exception as exc:
                lane.resume(exc)
            else:
                lane.resume(result)
            self._settle(lane)
        prefilling = [
            lane
            for lane in self._lanes
            if lane.call_pending is not None and lane.call_pending.kind in ("extend", "prefill")
        ]
        for lane in prefilling:  # one chunk each per tick, interleaved with the decode step
            call = lane.call_pending
            assert call is not None
            if lane.fed is not call:
                self._backend.feed(lane.row, call.tokens)
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
        stepping = [lane for lane in self._lanes if lane.call_pending is not None and lane.call_pending.kind == "step"]
        if not stepping:
            return solo, prefilled, 0
        if len(stepping) != self._backend.width:  # every row in the batch waits for its token between steps
            raise RuntimeError(f"{len(stepping)} rows asked for a step of a batch of {self._backend.width}")
        calls = {lane.row: lane.call_pending for lane in stepping}
        try:
            tokens = self._backend.step(
                {r: c.tokens[0] for r, c in calls.items() if c is not None},
                {r: c.sampling for r, c in calls.items() if c is not None},
                {r: c.uniform for r, c in calls.items() if c is not None},
            )
        except Exception as exc:  # the shared forward failed: every row in it fails, the engine goes on
            _log.error("batching.step_failed", error=str(exc), rows=len(stepping))
            for lane in stepping:
                self._backend.close(lane.row)
                lane.resume(exc)
                self._settle(lane)
            return solo, prefilled, 0
        self.steps += 1
        self.widest = max(self.widest, len(stepping))
        for lane in stepping:
            lane.resume(tokens[lane.row])
            self._settle(lane)
        return solo, prefilled, len(stepping)
