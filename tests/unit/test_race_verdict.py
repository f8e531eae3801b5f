"""The race's verdict is computed from token ids: identical, or the first divergence with both tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from mlx_dspark.application.dashboard.race import LaneDone, LaneVerdict, RaceVerdict, as_json, compare, race
from mlx_dspark.application.generation import GenerationDone, GenerationResult, TextChunk
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
    """Replays fixed token ids as a generator's stream would (one delta per token, then the result)."""

    ids: list[int]
    model: _Model = attrs.Factory(_Model)
    mode: str = "baseline"
    tok_s: float = 1.0

    def stream(self, request: Any) -> Iterator[Any]:
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
            tokens_per_second=self.tok_s,
            prefill_s=0.5,
            decode_s=2.0,
        )
        yield GenerationDone(result=GenerationResult(**fields))


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
    events = list(race(modes, modes.lanes["baseline"], "go", ["lookup", "dflash"], max_tokens=10))  # type: ignore[arg-type]
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
    lanes_seen = [e.mode for e in events if hasattr(e, "text")]
    assert lanes_seen[:10] == ["baseline"] * 10 and lanes_seen[10:20] == ["lookup"] * 10
