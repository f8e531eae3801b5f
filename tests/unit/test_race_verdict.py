"""The race's verdict is computed from token ids: identical, or the first divergence with both tokens; its
speedups are the medians of each lane's solo runs, and a wide spread marks a lane noisy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from mlx_dspark.application.dashboard.race import (
    LaneDone,
    LanesLaidOut,
    LaneText,
    LaneTiming,
    LaneVerdict,
    RaceVerdict,
    as_json,
    compare,
    race,
)
from mlx_dspark.application.engine import SideBySide
from mlx_dspark.application.generation import GenerationDone, GenerationResult, TextChunk
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.tokens import FinishReason


def test_compare_finds_the_first_difference() -> None:
    assert compare([1, 2, 3], [1, 2, 3]) == (None, None, None)
    assert compare([1, 2, 3], [1, 9, 3]) == (1, 2, 9)
    assert compare([1, 2, 3], [1, 2]) == (2, 3, None)  # the candidate stopped early
    assert compare([1, 2], [1, 2, 7]) == (2, None, 7)  # the candidate went on past plain's end


@attrs.define
class _Tok:
    def decode(self, ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in ids)


@attrs.define
class _Model:
    tokenizer: _Tok = attrs.Factory(_Tok)


@attrs.define
class _Gen:
    """Replays fixed token ids as a generator's stream would (one delta per token, then the result); each run
    reports the next of its `tok_s` rates, as a clock would measure them."""

    ids: list[int]
    model: _Model = attrs.Factory(_Model)
    mode: str = "baseline"
    tok_s: float | list[float] = 1.0
    runs: int = 0

    def stream(self, request: Any) -> Iterator[Any]:
        rates = self.tok_s if isinstance(self.tok_s, list) else [self.tok_s]
        rate, self.runs = rates[self.runs % len(rates)], self.runs + 1
        for t in self.ids:
            yield TextChunk(text=f"t{t}", token_ids=(t,))
        fields = {f.name: 0 for f in attrs.fields(GenerationResult)}
        fields.update(
            text="",
            token_ids=tuple(self.ids),
            finish_reason=FinishReason.LENGTH,
            stop_sequence=None,
            mode=self.mode,
            generated_tokens=len(self.ids),
            mean_accepted=1.0,
            tokens_per_second=rate,
            prefill_s=0.5,
            decode_s=2.0,
        )
        yield GenerationDone(result=GenerationResult(**fields))

    def generate(self, request: Any) -> GenerationResult:
        *_, done = self.stream(request)
        return done.result  # type: ignore[no-any-return]


@attrs.define
class _Modes:
    lanes: dict[str, _Gen]

    def get(self, served: Any, mode: str) -> _Gen:
        return self.lanes[mode]


def test_a_diverging_lane_is_a_failure_with_its_position_and_context() -> None:
    plain = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    modes = _Modes(
        {"baseline": _Gen(plain, tok_s=20.0), "lookup": _Gen(plain, tok_s=32.4), "dflash": _Gen([*plain[:9], 99])}
    )
    events = list(race(modes, modes.lanes["baseline"], "go", ["lookup", "dflash"], max_tokens=10, repeats=1))  # type: ignore[arg-type]
    verdict = events[-1]
    assert isinstance(verdict, RaceVerdict) and not verdict.identical
    assert verdict.lanes == (
        LaneVerdict(mode="lookup", identical=True, speedup=32.4 / 20.0),
        LaneVerdict(mode="dflash", identical=False, divergence=9, expected=14, got=99,
                    context="t6 t7 t8 t9 t10 t11 t12 t13", speedup=1.0 / 20.0),
    )  # fmt: skip
    # The line a person reads first, and each lane's elapsed time.
    summaries = [v.summary for v in verdict.lanes]
    assert summaries == ["lookup 1.62x plain, identical", "dflash 0.05x plain, diverged at token 9"]
    assert as_json(verdict)["lanes"][0]["summary"] == "lookup 1.62x plain, identical"
    assert {e.seconds for e in events if isinstance(e, LaneDone)} == {2.5}
    lanes_seen = [e.mode for e in events if isinstance(e, LaneText)]
    assert lanes_seen[:10] == ["baseline"] * 10 and lanes_seen[10:20] == ["lookup"] * 10


def run(lanes: dict[str, _Gen], repeats: int, **kw: Any) -> list[Any]:
    modes = _Modes(lanes)
    return list(race(modes, lanes["baseline"], "go", [m for m in lanes if m != "baseline"], repeats=repeats, **kw))  # type: ignore[arg-type]


def test_repeats_give_each_lane_a_median_and_a_spread_and_mark_the_noisy_ones() -> None:
    plain = [5, 6, 7]
    lanes = {
        "baseline": _Gen(plain, tok_s=[20.0, 21.0, 20.5]),  # spread 1/20.5: quiet
        "lookup": _Gen(plain, tok_s=[30.0, 40.0, 32.0]),  # spread 10/32 = 31%: noisy
        "dspark": _Gen(plain, tok_s=[33.0, 33.0, 34.0]),
    }
    events = run(lanes, 3)
    timings = {e.mode: e for e in events if isinstance(e, LaneTiming)}
    assert timings["lookup"].samples == (30.0, 40.0, 32.0) and timings["lookup"].median == 32.0
    assert timings["lookup"].spread == pytest.approx(10 / 32) and timings["lookup"].noisy
    assert not timings["baseline"].noisy and not timings["dspark"].noisy
    assert as_json(timings["lookup"]) == {
        "type": "timing", "mode": "lookup", "samples": [30.0, 40.0, 32.0], "median": 32.0, "low": 30.0,
        "high": 40.0, "spread": pytest.approx(0.3125), "noisy": True,
    }  # fmt: skip
    verdict = events[-1]
    assert isinstance(verdict, RaceVerdict)
    # The speedup is the ratio of solo medians; the noise mark follows the verdict's usual line.
    assert [v.summary for v in verdict.lanes] == [
        "lookup 1.56x plain, identical, noisy: spread 31%",
        "dspark 1.61x plain, identical",
    ]
    assert as_json(verdict)["lanes"][0]["noisy"] is True


def test_a_noisy_plain_reference_marks_every_lane() -> None:
    plain = [5, 6]
    lanes = {"baseline": _Gen(plain, tok_s=[10.0, 13.0]), "lookup": _Gen(plain, tok_s=[20.0, 20.0])}
    (lane,) = run(lanes, 2)[-1].lanes
    assert lane.noisy and lane.summary == "lookup 1.74x plain, identical, noisy: spread 26%"


def test_lanes_that_cannot_share_a_batch_run_one_after_another_and_say_why() -> None:
    plain = [5, 6]
    lanes = {"baseline": _Gen(plain, tok_s=10.0), "lookup": _Gen(plain, tok_s=20.0)}
    events = run(lanes, 2, side_by_side=lambda services: SideBySide(None, "the target cannot batch"))
    assert events[0] == LanesLaidOut(side_by_side=False, reason="the target cannot batch")
    assert as_json(events[0])["text"] == "lanes run one after another: the target cannot batch"
    # The one-after-another run is each lane's first solo run: one more each makes the two repeats.
    assert [lanes["baseline"].runs, lanes["lookup"].runs] == [2, 2]


@pytest.mark.parametrize("repeats", [0, 6])
def test_repeats_are_bounded(repeats: int) -> None:
    with pytest.raises(InvalidRequest, match="repeats"):
        run({"baseline": _Gen([1]), "lookup": _Gen([1])}, repeats)
