"""The race's lanes decode side by side, as rows of one batch over a tiny float32 model: their text interleaves
before any lane is done and every lane's tokens are plain decoding's; where the target cannot batch them, the
lanes run one after another and the stream says why."""

from __future__ import annotations

import asyncio
import functools
import itertools
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.rows import mlx_rows
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.dashboard.race import (
    LaneDone,
    LanesLaidOut,
    LaneText,
    LaneTiming,
    RaceVerdict,
    race,
)
from mlx_dspark.application.engine import EngineThread
from mlx_dspark.application.generation import GenerationRequest, GenerationService
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.model import LoadedModel
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.tiny_models import tiny_model
from tests.integration.drafters import helpers

PROMPT = "abcabcabcabcab"
BLOCK = 4


class Tokenizer:
    """Each id reads back as its own bracketed number (no merges: every committed token is text at once)."""

    chat_template = None
    eos_ids: frozenset[int] = frozenset()

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % self.vocab for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


@attrs.define
class Modes:
    """The dashboard's ModeSet over fixed services."""

    by_mode: dict[str, GenerationService]

    def get(self, served: Any, mode: str) -> GenerationService:
        return self.by_mode[mode]


@functools.cache
def _dspark_dir() -> Path:
    return helpers.write_dspark(Path(tempfile.mkdtemp(prefix="race-dspark-")) / "d", helpers.tiny_target("qwen3", 2))


def lanes(model: Any, family: str, vocab: int, *, dspark: bool) -> dict[str, GenerationService]:
    """Plain decoding, lookup and (on the drafters' own target) DSpark, all over one target."""
    target = MlxTargetModel(model, prefill_chunk=4)
    loaded = LoadedModel(
        name="tiny", identity=f"tiny-{family}", target=target, tokenizer=Tokenizer(vocab), context_window=4096,
        family=family,
    )  # fmt: skip
    clock, telemetry = FakeClock(), RecordingTelemetrySink()

    def mode(name: str, source: Any) -> GenerationService:
        return GenerationService(
            loaded,
            clock=clock,
            telemetry=telemetry,
            source=source,
            mode=name,
            cap_policy_factory=lambda: FixedCap(BLOCK),
        )

    out = {"baseline": GenerationService(loaded, clock=clock, telemetry=telemetry)}
    out["lookup"] = mode("lookup", LookupDraftSource(block=BLOCK, min_n=1, max_n=3))
    if dspark:
        drafter = load_drafter("dspark", str(_dspark_dir()), model, target=target, bits=0, confidence_threshold=0.0)
        out["dspark"] = mode("dspark", drafter)
    return out


def run_race(by_mode: dict[str, GenerationService], max_batch: int, **kw: Any) -> list[Any]:
    """The race as the server runs it: an exclusive job on the engine thread, its lanes from the engine's batch."""
    engine = EngineThread(lambda: by_mode["baseline"], max_batch=max_batch, rows=mlx_rows)
    engine.start()
    assert engine.wait_ready(30)
    modes = Modes(by_mode)
    chosen = [m for m in by_mode if m != "baseline"]

    async def main() -> list[Any]:
        job = engine.submit(
            lambda g: race(modes, g, PROMPT, chosen, side_by_side=engine.side_by_side, **kw),  # type: ignore[arg-type]
            exclusive=True,
        )
        return [e async for e in job]

    try:
        return asyncio.run(main())
    finally:
        engine.stop(timeout=10)


def streamed(events: list[Any]) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for e in events:
        if isinstance(e, LaneText):
            out[e.mode] = out.get(e.mode, ()) + e.token_ids
    return out


def test_lanes_race_side_by_side_and_decode_exactly_as_plain() -> None:
    by_mode = lanes(helpers.tiny_target("qwen3", 2), "qwen3", helpers.VOCAB, dspark=True)
    events = run_race(by_mode, 4, max_tokens=24, repeats=2)
    assert events[0] == LanesLaidOut(side_by_side=True)
    # Before any lane is done, every lane has streamed text, and the lanes take turns (not one after another).
    first_done = next(i for i, e in enumerate(events) if isinstance(e, LaneDone))
    order = [e.mode for e in events[:first_done] if isinstance(e, LaneText) and e.token_ids]
    assert set(order) == {"baseline", "lookup", "dspark"}
    turns = sum(a != b for a, b in itertools.pairwise(order))
    assert turns >= 2 * len(by_mode), order
    # Lossless: every lane streamed plain decoding's tokens, which are the plain request's own decoded alone.
    ids = streamed(events)
    request = GenerationRequest(prompt=PROMPT, max_tokens=24, sampling=SamplingParams(temperature=0.0))
    alone = by_mode["baseline"].generate(request).token_ids
    assert ids == {mode: alone for mode in by_mode} and len(alone) == 24
    verdict = events[-1]
    assert isinstance(verdict, RaceVerdict) and verdict.identical
    assert [v.mode for v in verdict.lanes] == ["lookup", "dspark"]
    # Then each lane alone, twice: the verdict's speedups come from those medians.
    timings = {e.mode: e for e in events if isinstance(e, LaneTiming)}
    assert set(timings) == set(by_mode) and all(len(t.samples) == 2 for t in timings.values())
    for v in verdict.lanes:
        assert v.speedup == timings[v.mode].median / timings["baseline"].median


def test_a_recurrent_target_runs_speculative_lanes_one_after_another_and_says_why() -> None:
    by_mode = lanes(tiny_model("qwen3_5", seed=0), "qwen3_5", 192, dspark=False)
    events = run_race(by_mode, 4, max_tokens=12, repeats=1)
    assert events[0] == LanesLaidOut(
        side_by_side=False, reason="the target's caches have no batched form for speculative decoding"
    )
    assert events[0].text.startswith("lanes run one after another: ")
    order = [e.mode for e in events if isinstance(e, LaneText)]
    assert order == sorted(order, key=["baseline", "lookup"].index)  # plain's lane ends before lookup's starts
    verdict = events[-1]
    assert isinstance(verdict, RaceVerdict) and verdict.identical
    assert [len(e.samples) for e in events if isinstance(e, LaneTiming)] == [1, 1]  # each lane's one run, solo


def test_one_request_at_a_time_runs_the_lanes_one_after_another() -> None:
    by_mode = lanes(helpers.tiny_target("qwen3", 2), "qwen3", helpers.VOCAB, dspark=False)
    events = run_race(by_mode, 1, max_tokens=8, repeats=1)
    assert events[0] == LanesLaidOut(
        side_by_side=False, reason="the server decodes one request at a time (max batch 1)"
    )
    assert isinstance(events[-1], RaceVerdict) and events[-1].identical


def test_a_race_closed_mid_way_ends_its_rows() -> None:
    """A client that leaves closes the race's iterator: the lanes still decoding end and their rows close."""
    by_mode = lanes(helpers.tiny_target("qwen3", 2), "qwen3", helpers.VOCAB, dspark=False)
    thread = EngineThread(lambda: by_mode["baseline"], max_batch=4, rows=mlx_rows)  # its batches, not its thread
    made: list[Any] = []

    def side_by_side(services: Sequence[GenerationService]) -> Any:
        made.append(thread.side_by_side(services))
        return made[-1]

    events = race(Modes(by_mode), by_mode["baseline"], PROMPT, ["lookup"], max_tokens=24, side_by_side=side_by_side)  # type: ignore[arg-type]
    seen = set()
    for event in events:
        if isinstance(event, LaneText) and event.token_ids:
            seen.add(event.mode)
        if seen == {"baseline", "lookup"}:
            break
    engine = made[0].engine
    assert engine.active == 2
    events.close()
    assert engine.active == 0
