"""Use case: one prompt through plain decoding and each chosen mode, with a checked lossless verdict and timing
that knows when it is noise.

The lanes decode side by side, as rows of one batch on a private step engine over the served model
(`EngineThread.side_by_side`), each streaming its tokens as it goes; where the target cannot batch them they
run one after another, and the stream says why. Side by side the lanes share the device, so their tok/s are
not solo speeds: each lane is then timed alone `repeats` times, and the verdict's "N× plain" compares the
medians; a lane whose samples (or plain decoding's) spread wider than `NOISE_SPREAD` of the median is marked
noisy. The verdict compares greedy token ids with plain decoding's: identical, or the first divergence.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import attrs

from mlx_dspark.application.dashboard.modes import ModeSet
from mlx_dspark.application.engine import Engine, JobEnded, JobEvent, JobFailed, JobItem, SideBySide, StepJob
from mlx_dspark.application.generation import (
    GenerationDone,
    GenerationJob,
    GenerationRequest,
    GenerationResult,
    GenerationService,
    TextChunk,
)
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.tokens import SamplingParams

MAX_RACE_TOKENS = 512
MAX_REPEATS = 5
NOISE_SPREAD = 0.15  # (fastest - slowest) / median of a lane's solo runs above which its figure is noise

Batcher = Callable[[Sequence[GenerationService]], SideBySide]  # EngineThread.side_by_side


@attrs.frozen(kw_only=True)
class LanesLaidOut:
    """How the lanes decode: side by side in one batch, or one after another (and why)."""

    side_by_side: bool
    reason: str = ""

    @property
    def text(self) -> str:
        return "lanes run side by side" if self.side_by_side else f"lanes run one after another: {self.reason}"


@attrs.frozen(kw_only=True)
class RaceStatus:
    text: str


@attrs.frozen(kw_only=True)
class LaneText:
    mode: str
    text: str
    token_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class LaneDone:
    mode: str
    tokens: int
    tok_s: float
    mean_accepted: float
    drafted: int
    accepted: int
    finish_reason: str
    seconds: float = 0.0  # the lane's wall time, prefill included


@attrs.frozen(kw_only=True)
class LaneTiming:
    """A lane's decode tok/s over its solo runs."""

    mode: str
    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0

    @property
    def spread(self) -> float:
        """(fastest - slowest) / median: 0 for one sample."""
        median = self.median
        return (max(self.samples) - min(self.samples)) / median if median else 0.0

    @property
    def noisy(self) -> bool:
        return self.spread > NOISE_SPREAD


@attrs.frozen(kw_only=True)
class LaneVerdict:
    mode: str
    identical: bool
    divergence: int | None = None  # index of the first differing token
    expected: int | None = None  # plain decoding's token there (None: plain ended first)
    got: int | None = None  # this mode's token there (None: this mode ended first)
    context: str = ""  # the text both agree on just before the divergence
    speedup: float = 0.0  # this lane's median solo tok/s over plain decoding's
    spread: float = 0.0  # the wider relative spread of this lane's and plain decoding's solo runs
    noisy: bool = False  # that spread is above NOISE_SPREAD: the speedup is not to be trusted

    @property
    def summary(self) -> str:
        """One line a person reads first: "dspark 1.62x plain, identical" (", noisy: spread 23%")."""
        same = "identical" if self.identical else f"diverged at token {self.divergence}"
        noise = f", noisy: spread {self.spread:.0%}" if self.noisy else ""
        return f"{self.mode} {self.speedup:.2f}x plain, {same}{noise}"


@attrs.frozen(kw_only=True)
class RaceVerdict:
    lanes: tuple[LaneVerdict, ...]

    @property
    def identical(self) -> bool:
        return all(v.identical for v in self.lanes)


RaceEvent = LanesLaidOut | RaceStatus | LaneText | LaneDone | LaneTiming | RaceVerdict


def compare(reference: Sequence[int], candidate: Sequence[int]) -> tuple[int | None, int | None, int | None]:
    """(first differing index, reference token there, candidate token there); all None when identical."""
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return i, a, b
    if len(reference) == len(candidate):
        return None, None, None
    i = min(len(reference), len(candidate))
    return i, (reference[i] if i < len(reference) else None), (candidate[i] if i < len(candidate) else None)


def race(
    modes: ModeSet,
    served: GenerationService,
    prompt: str,
    lanes: Sequence[str],
    *,
    max_tokens: int = 64,
    repeats: int = 2,
    side_by_side: Batcher | None = None,
) -> Iterator[RaceEvent]:
    """Race plain decoding and each mode in `lanes` greedily on `prompt` (chat template applied): side by side
    where `side_by_side` gives a batch for them (else one after another), then each lane alone `repeats` times.

    Raises:
        InvalidRequest: an empty prompt, no lanes, or max_tokens or repeats out of range.
    """
    if not prompt.strip():
        raise InvalidRequest(message="the race needs a prompt", param="prompt")
    if not 1 <= max_tokens <= MAX_RACE_TOKENS:
        raise InvalidRequest(message=f"max_tokens must be in 1..{MAX_RACE_TOKENS}", param="max_tokens")
    if not 1 <= repeats <= MAX_REPEATS:
        raise InvalidRequest(message=f"repeats must be in 1..{MAX_REPEATS}", param="repeats")
    chosen = [m for m in dict.fromkeys(lanes) if m != "baseline"]
    if not chosen:
        raise InvalidRequest(message="choose at least one mode to race against plain decoding", param="modes")
    generators = {"baseline": modes.get(served, "baseline")} | {m: modes.get(served, m) for m in chosen}

    def request() -> GenerationRequest:
        return GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))

    batch = side_by_side(list(generators.values())) if side_by_side is not None else None
    engine = batch.engine if batch is not None else None
    reason = batch.reason if batch is not None else "the engine offered no batch"
    yield LanesLaidOut(side_by_side=engine is not None, reason=reason)
    results: dict[str, GenerationResult] = {}
    samples: dict[str, list[float]] = {mode: [] for mode in generators}
    if engine is not None:
        with contextlib.closing(_together(engine, generators, request)) as together:  # a cancelled race ends its rows
            for event in together:
                if isinstance(event, _Finished):
                    results[event.mode] = event.result
                    yield _done(event.mode, event.result)
                else:
                    yield event
    else:  # one after another: each run is a solo run, so it is also the first timing sample
        for mode, gen in generators.items():
            for item in gen.stream(request()):
                if isinstance(item, GenerationDone):
                    results[mode] = item.result
                    samples[mode].append(item.result.tokens_per_second)
                    yield _done(mode, item.result)
                else:
                    yield LaneText(mode=mode, text=item.text, token_ids=item.token_ids)
    # Round-robin, so a change in the machine's load touches every lane alike.
    for run in range(len(samples["baseline"]), repeats):
        for mode, gen in generators.items():
            yield RaceStatus(text=f"timing each lane alone: {mode}, run {run + 1} of {repeats}")
            samples[mode].append(gen.generate(request()).tokens_per_second)
    timings = {mode: LaneTiming(mode=mode, samples=tuple(s)) for mode, s in samples.items()}
    yield from timings.values()
    yield RaceVerdict(lanes=tuple(_verdict(mode, results, timings, served) for mode in chosen))


def _verdict(
    mode: str, results: dict[str, GenerationResult], timings: dict[str, LaneTiming], served: GenerationService
) -> LaneVerdict:
    plain, lane = timings["baseline"], timings[mode]
    speedup = lane.median / plain.median if plain.median else 0.0
    spread = max(lane.spread, plain.spread)
    timed = LaneVerdict(mode=mode, identical=True, speedup=speedup, spread=spread, noisy=lane.noisy or plain.noisy)
    reference = results["baseline"].token_ids
    at, expected, got = compare(reference, results[mode].token_ids)
    if at is None:
        return timed
    context = served.model.tokenizer.decode(list(reference[max(0, at - 8) : at]))
    return attrs.evolve(timed, identical=False, divergence=at, expected=expected, got=got, context=context)


def _done(mode: str, r: GenerationResult) -> LaneDone:
    return LaneDone(
        mode=mode,
        tokens=r.generated_tokens,
        tok_s=r.tokens_per_second,
        mean_accepted=r.mean_accepted,
        drafted=r.drafted,
        accepted=r.accepted,
        finish_reason=r.finish_reason.value,
        seconds=r.prefill_s + r.decode_s,
    )


@attrs.frozen
class _Finished:
    mode: str
    result: GenerationResult


@attrs.define(eq=False)
class _Lane:
    """One lane as the private engine's task: its mode's request, its events kept until the race reads them."""

    mode: str
    service: GenerationService
    request: GenerationRequest
    events: list[JobEvent] = attrs.Factory(list)
    cancelled: bool = False
    ended: bool = False

    def start(self, service: GenerationService, emit: Callable[[Any], None]) -> StepJob:
        return GenerationJob(service, self.request, emit)

    def push(self, event: JobEvent) -> None:
        self.events.append(event)

    def cancel(self) -> None:
        self.cancelled = True


def _together(
    engine: Engine, generators: dict[str, GenerationService], request: Callable[[], GenerationRequest]
) -> Generator[LaneText | _Finished, None, None]:
    """Every lane as a row of `engine`'s batch (lanes beyond its width join as others end), their text as it
    comes. Closing the iterator cancels the lanes still decoding and closes their rows."""
    lanes = [_Lane(mode, gen, request()) for mode, gen in generators.items()]
    waiting = list(lanes)
    try:
        while waiting or engine.active:
            while waiting and not engine.full:
                lane = waiting.pop(0)
                engine.admit(lane, lane.service)
            if engine.active:
                engine.step()
            for lane in lanes:
                events, lane.events = lane.events, []
                for event in events:
                    yield from _read(lane, event)
    finally:
        for lane in lanes:
            lane.cancelled = True
        if engine.active:
            engine.step()  # a step ends cancelled rows first and closes them


def _read(lane: _Lane, event: JobEvent) -> Iterator[LaneText | _Finished]:
    if isinstance(event, JobFailed):
        raise event.error
    if isinstance(event, JobEnded):
        lane.ended = True
        return
    assert isinstance(event, JobItem)
    item = event.value
    if isinstance(item, GenerationDone):
        yield _Finished(lane.mode, item.result)
    elif isinstance(item, TextChunk):
        yield LaneText(mode=lane.mode, text=item.text, token_ids=item.token_ids)


def as_json(event: RaceEvent) -> dict[str, Any]:
    if isinstance(event, LanesLaidOut):
        return {"type": "layout", "side_by_side": event.side_by_side, "reason": event.reason, "text": event.text}
    if isinstance(event, RaceStatus):
        return {"type": "status", "text": event.text}
    if isinstance(event, LaneText):
        return {"type": "text", "mode": event.mode, "text": event.text, "token_ids": list(event.token_ids)}
    if isinstance(event, LaneDone):
        return {"type": "lane_done", **attrs.asdict(event)}
    if isinstance(event, LaneTiming):
        return {
            "type": "timing",
            "mode": event.mode,
            "samples": list(event.samples),
            "median": event.median,
            "low": min(event.samples, default=0.0),
            "high": max(event.samples, default=0.0),
            "spread": event.spread,
            "noisy": event.noisy,
        }
    return {
        "type": "verdict",
        "identical": event.identical,
        "lanes": [{**attrs.asdict(v), "summary": v.summary} for v in event.lanes],
    }
