"""Use case: one prompt through plain decoding and each chosen mode, with a checked lossless verdict.

Lanes run one after another on the engine thread (they share the model); each streams its tokens as it
goes. The verdict compares greedy token ids with plain decoding's: identical, or the first divergence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from mlx_dspark.application.dashboard.modes import ModeSet
from mlx_dspark.application.generation import GenerationDone, GenerationRequest, GenerationService
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.tokens import SamplingParams

MAX_RACE_TOKENS = 512


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
class LaneVerdict:
    mode: str
    identical: bool
    divergence: int | None = None  # index of the first differing token
    expected: int | None = None  # plain decoding's token there (None: plain ended first)
    got: int | None = None  # this mode's token there (None: this mode ended first)
    context: str = ""  # the text both agree on just before the divergence
    speedup: float = 0.0  # this lane's decode tok/s over plain decoding's

    @property
    def summary(self) -> str:
        """One line a person reads first: "dspark 1.62x plain, identical"."""
        same = "identical" if self.identical else f"diverged at token {self.divergence}"
        return f"{self.mode} {self.speedup:.2f}x plain, {same}"


@attrs.frozen(kw_only=True)
class RaceVerdict:
    lanes: tuple[LaneVerdict, ...]

    @property
    def identical(self) -> bool:
        return all(v.identical for v in self.lanes)


RaceEvent = LaneText | LaneDone | RaceVerdict


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
    modes: ModeSet, served: GenerationService, prompt: str, lanes: Sequence[str], *, max_tokens: int = 64
) -> Iterator[RaceEvent]:
    """Run plain decoding, then each mode in `lanes`, greedily on `prompt` (chat template applied).

    Raises:
        InvalidRequest: an empty prompt, no lanes, or max_tokens out of range.
    """
    if not prompt.strip():
        raise InvalidRequest(message="the race needs a prompt", param="prompt")
    if not 1 <= max_tokens <= MAX_RACE_TOKENS:
        raise InvalidRequest(message=f"max_tokens must be in 1..{MAX_RACE_TOKENS}", param="max_tokens")
    chosen = [m for m in dict.fromkeys(lanes) if m != "baseline"]
    if not chosen:
        raise InvalidRequest(message="choose at least one mode to race against plain decoding", param="modes")
    generators = [("baseline", modes.get(served, "baseline"))] + [(m, modes.get(served, m)) for m in chosen]
    ids: dict[str, tuple[int, ...]] = {}
    tokenizer = served.model.tokenizer
    rates: dict[str, float] = {}
    for mode, gen in generators:
        request = GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
        for event in gen.stream(request):
            if isinstance(event, GenerationDone):
                r = event.result
                ids[mode] = r.token_ids
                rates[mode] = r.tokens_per_second
                yield LaneDone(
                    mode=mode,
                    tokens=r.generated_tokens,
                    tok_s=r.tokens_per_second,
                    mean_accepted=r.mean_accepted,
                    drafted=r.drafted,
                    accepted=r.accepted,
                    finish_reason=r.finish_reason.value,
                    seconds=r.prefill_s + r.decode_s,
                )
            else:
                yield LaneText(mode=mode, text=event.text, token_ids=event.token_ids)
    verdicts = []
    for mode in chosen:
        at, expected, got = compare(ids["baseline"], ids[mode])
        speedup = rates[mode] / rates["baseline"] if rates.get("baseline") else 0.0
        if at is None:
            verdicts.append(LaneVerdict(mode=mode, identical=True, speedup=speedup))
        else:
            context = tokenizer.decode(list(ids["baseline"][max(0, at - 8) : at]))
            verdicts.append(
                LaneVerdict(
                    mode=mode,
                    identical=False,
                    divergence=at,
                    expected=expected,
                    got=got,
                    context=context,
                    speedup=speedup,
                )
            )
    yield RaceVerdict(lanes=tuple(verdicts))


def as_json(event: RaceEvent) -> dict[str, Any]:
    if isinstance(event, LaneText):
        return {"type": "text", "mode": event.mode, "text": event.text, "token_ids": list(event.token_ids)}
    if isinstance(event, LaneDone):
        return {"type": "lane_done", **attrs.asdict(event)}
    return {
        "type": "verdict",
        "identical": event.identical,
        "lanes": [{**attrs.asdict(v), "summary": v.summary} for v in event.lanes],
    }
