"""Use case: warm a served model before its first request, where the device compiles kernels on first use.

On a GPU (Metal, CUDA) each kernel variant a round needs is compiled the first time it runs: the drafter's
forward and chain, the verify at each width, the acceptance, the sampler. The first speculative request of a
process paid all of it (measured on the H200: 4.4 tok/s against 168 warm, DSpark). `warm_up` runs a few short
requests per draft source at every cap, greedy and seeded, before the engine reports ready, so a user's first
request runs warm. On the CPU backend nothing is compiled on first use and the runtime says so: `auto` skips it.

Auto mode also comes back to drafters it left many rounds ago, whose first round then catches up on every row
since at once; on the GPUs measured, a process's first such round stalled for 20-90 s inside its dispatch (where
MLX compiles kernels) while warmed per-cap rounds did not. So auto's warm-up adds, per feature-reading drafter, one
request that decodes plainly for `CATCH_UP_ROUNDS` rounds and then hands over to the drafter.

A warm-up request goes through its own GenerationService over the same target and the mode's source objects,
with no telemetry, a fixed cap and no prefix cache, so it changes nothing a later request sees: no cached
prefix, no learned rate of auto mode, no calibration. The target's live rows it leaves behind are reset by the
next request (it shares no prefix with them beyond chance, and reuse is exact either way).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import attrs
import structlog

from mlx_dspark.application.engine import NoTelemetry
from mlx_dspark.application.generation import GenerationRequest, GenerationService
from mlx_dspark.application.settings import WARMUP_MODES
from mlx_dspark.domain.costmodel.draft_cap import CapPolicy, FixedCap
from mlx_dspark.domain.drafting.selection import PLAIN, FixedSelector, Selection
from mlx_dspark.domain.events import SourceSwitched, Usage
from mlx_dspark.domain.ports import DraftSource
from mlx_dspark.domain.tokens import SamplingParams

_log = structlog.get_logger("mlx_dspark.engine")
_PROMPT = 48  # tokens: past the first prefill chunk shapes of a short chat turn, cheap on any device
_SEED = 1234
MAX_CAP = 16  # the largest cap warmed (each source's own block at most): DFlash's 16-token block drafts 15
CATCH_UP_ROUNDS = 48  # plain rounds before a drafter takes over (the H200 stalled on a first catch-up after 40)
CATCH_UP = "catch-up"  # the cap field of a catch-up request in `WarmUp.covered`


@attrs.frozen(kw_only=True)
class WarmUp:
    """What a warm-up ran: requests, the (source, cap) pairs covered, and its wall seconds."""

    requests: int
    covered: tuple[tuple[str, int | str], ...]
    seconds: float


def wanted(setting: str, compiles_kernels: bool) -> bool:
    """Whether to warm up: `on`, `off`, or `auto` (where the device compiles kernels on first use)."""
    if setting not in WARMUP_MODES:
        raise ValueError(f"warmup must be one of {', '.join(WARMUP_MODES)}, got {setting!r}")
    return setting == "on" or (setting == "auto" and compiles_kernels)


def sources_of(generator: GenerationService) -> dict[str, DraftSource | None]:
    """The draft sources a served mode may run: a fixed mode's one, or every candidate of auto mode."""
    selector = generator.selector
    if isinstance(selector, FixedSelector):
        return {selector.mode: selector.source}
    candidates = getattr(selector, "sources", None)
    return dict(candidates()) if callable(candidates) else {}


def _prompt(vocab: int) -> tuple[int, ...]:
    # Repetitive ids, so n-gram lookup finds continuations to draft as well.
    rng = random.Random(_SEED)
    motif = [rng.randrange(8, max(9, vocab)) for _ in range(6)]
    return tuple((motif * (_PROMPT // len(motif) + 1))[:_PROMPT])


def _requests(source: DraftSource | None, max_cap: int) -> Iterator[tuple[int, SamplingParams]]:
    if source is None:
        yield 0, SamplingParams()
        yield 0, SamplingParams(temperature=0.8, top_p=0.95, seed=_SEED)
        return
    top = _top_cap(source, max_cap)
    for cap in range(1, top + 1):
        yield cap, SamplingParams()
    yield top, SamplingParams(temperature=0.8, top_p=0.95, seed=_SEED)


def _top_cap(source: DraftSource, max_cap: int) -> int:
    """The largest cap warmed for `source`: its own block, `max_cap` at most."""
    return max(1, min(max_cap, source.max_block))


def _fixed(cap: int) -> Callable[[], CapPolicy]:
    return lambda: FixedCap(cap)


def warm_up(generator: GenerationService, *, max_cap: int = MAX_CAP) -> WarmUp:
    """Run the served mode's rounds once at every cap up to `max_cap` (each source's own block at most)."""
    start = time.perf_counter()
    model = generator.model
    prompt = _prompt(model.target.vocab_size)
    covered: dict[tuple[str, int | str], None] = {}  # in order, each once (the seeded request repeats the top cap)
    count = 0
    named = sources_of(generator)
    for name, source in named.items():
        for cap, sampling in _requests(source, max_cap):
            service = GenerationService(
                model,
                clock=generator.clock,
                telemetry=NoTelemetry(),
                source=source,
                mode=name if source is not None else PLAIN,
                cap_policy_factory=None if source is None else _fixed(cap),
            )
            # The prefill's token, then a budget of cap + 1: the first round runs at the full cap (the budget
            # never lets a round draft past what is left), the rounds after it at what remains.
            service.generate(
                GenerationRequest(
                    prompt=prompt,
                    max_tokens=cap + 2,
                    sampling=sampling,
                    chat_template=False,
                    prefix_cache=True,  # the service has no cache: only the target's live rows are reused
                    request_id=f"warmup-{name}-{cap}",
                )
            )
            count += 1
            covered[(name, cap)] = None
    if len(named) > 1:  # auto: a drafter it comes back to catches up on many rows in one round
        for name, source in named.items():
            if source is None or not source.uses_features:
                continue
            top = _top_cap(source, max_cap)
            catch_up = GenerationService(
                model, clock=generator.clock, telemetry=NoTelemetry(), selector=_CatchUp(name, source, top)
            )
            catch_up.generate(
                GenerationRequest(
                    prompt=prompt,
                    max_tokens=CATCH_UP_ROUNDS + 2 * (top + 1),  # the plain rounds, then two of the drafter's
                    chat_template=False,
                    prefix_cache=True,
                    request_id=f"warmup-{name}-{CATCH_UP}",
                )
            )
            count += 1
            covered[(name, CATCH_UP)] = None
    return WarmUp(requests=count, covered=tuple(covered), seconds=time.perf_counter() - start)


class SwitchAfter:
    """A SourceSwitcher that moves the request once, after `rounds` rounds."""

    def __init__(self, rounds: int, then: Selection) -> None:
        self._left, self._then = rounds, then

    def after_round(self, name: str, committed: int, seconds: float, **_: object) -> Selection | None:
        self._left -= 1
        return self._then if self._left == 0 else None


@attrs.frozen
class _CatchUp:
    """The selector of one warm-up request: plain decoding, then `source` at `cap` after CATCH_UP_ROUNDS rounds
    (the request records features from the start, as an auto request does, so the drafter's first round takes
    them all)."""

    name: str
    source: DraftSource
    cap: int

    @property
    def mode(self) -> str:
        return "auto"

    def select(self, prompt: object, sampling: SamplingParams | None = None) -> Selection:
        moved = SourceSwitched(old=PLAIN, new=self.name, reason="warm-up: a drafter catching up")
        then = Selection(name=self.name, source=self.source, policy=FixedCap(self.cap), switched=moved)
        return Selection(name=PLAIN, source=None, switcher=SwitchAfter(CATCH_UP_ROUNDS, then))

    def finished(self, selection: Selection, usage: Usage) -> None:
        return None


class WarmingServe:
    """The engine thread's `on_serve` hook: warm each model it is about to serve (at load and at every switch,
    before it reports ready), then hand the service on to `then`.

    Args:
        enabled: whether to warm up (`wanted` of the setting and the runtime).
        then: the next hook (the dashboard's), run after the warm-up.
        max_cap: the largest cap to warm (each source's own block at most).
    """

    def __init__(self, enabled: bool, then: Callable[[GenerationService], None], *, max_cap: int = MAX_CAP) -> None:
        self.enabled = enabled
        self._then = then
        self._max_cap = max_cap
        self.last: WarmUp | None = None

    def __call__(self, generator: GenerationService) -> None:
        if self.enabled:
            try:
                self.last = warm_up(generator, max_cap=self._max_cap)
                _log.info(
                    "engine.warmed_up",
                    mode=generator.mode,
                    requests=self.last.requests,
                    seconds=round(self.last.seconds, 3),
                )
            except Exception as exc:  # a warm-up is an optimisation: the model is served either way
                _log.warning("engine.warm_up_failed", error=str(exc))
        self._then(generator)
