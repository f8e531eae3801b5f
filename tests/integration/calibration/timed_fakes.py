"""Fakes whose costs the test controls: a manual clock, a target that charges verify time by width and
depth, draft sources that charge per proposal, and a byte-level tokenizer over a small vocabulary."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.model import ChatMessages, TemplateVars, ToolSpecs
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.clock import FakeClock
from tests.fakes.drafts import ScriptedDraftSource
from tests.fakes.oracle import OracleTarget


class ManualClock(FakeClock):
    """Time moves only when a fake charges for work (plus an optional tiny tick per reading)."""

    def __init__(self, tick: float = 0.0) -> None:
        super().__init__(tick)

    def advance(self, seconds: float) -> None:
        self.t += seconds


class TimedTarget(OracleTarget):
    """An oracle target that charges `verify_cost(width, depth)` seconds per forward (prefill and verify)."""

    def __init__(
        self,
        clock: ManualClock,
        verify_cost: Callable[[int, int], float],
        vocab: int = 64,
        context: int = 2,
    ) -> None:
        super().__init__(vocab=vocab, context=context)
        self.clock = clock
        self.verify_cost = verify_cost

    def charge(self, width: int) -> None:
        self.clock.advance(self.verify_cost(width, len(self.rows)))


def timed_target(
    cost: Callable[[int, int], float] | None = None, vocab: int = 64
) -> tuple[ManualClock, TimedTarget]:
    """A fresh manual clock and a timed target charging on it (`flat(0.05)` unless given)."""
    clock = ManualClock()
    return clock, TimedTarget(clock, cost or flat(0.05), vocab=vocab)


class TimedSource(ScriptedDraftSource):
    """A scripted source that charges `draft_cost(cap)` seconds per proposal."""

    def __init__(
        self,
        oracle: TimedTarget,
        draft_cost: Callable[[int], float],
        right: Callable[[int, int], bool] = lambda r, i: True,
        block: int = 4,
        name: str = "scripted",
        features: bool = False,
    ) -> None:
        super().__init__(oracle, right, block=block, name=name)
        self._clock = oracle.clock
        self._cost = draft_cost
        self._features = features
        self.proposed_contexts: list[DraftContext] = []

    @property
    def uses_features(self) -> bool:
        return self._features

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        self.proposed_contexts.append(ctx)
        self._clock.advance(self._cost(cap))
        return super().propose(ctx, cap, sampling, uniforms)


class ByteTokenizer:
    """Bytes of the text modulo the vocabulary; no chat template."""

    def __init__(self, vocab: int = 64) -> None:
        self._vocab = vocab

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset()

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def chat_template(self) -> str | None:
        return None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [b % self._vocab for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(97 + (i % 26)) for i in ids)

    def render_chat(
        self, messages: ChatMessages, *, tools: ToolSpecs | None = None, template_kwargs: TemplateVars | None = None
    ) -> str:
        return "\n".join(str(m["content"]) for m in messages)


class ConstantTokenizer(ByteTokenizer):
    """A degenerate tokenizer: every text is one repeated id (calibration must not time that)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [7] * len(text)


def loaded(target: TimedTarget, tokenizer: Any = None, identity: str = "fake/target@rev1") -> LoadedModel:
    return LoadedModel(
        name="fake",
        identity=identity,
        target=target,
        tokenizer=tokenizer or ByteTokenizer(target.vocab_size),
        context_window=4096,
        family="fake",
    )


def flat(base: float = 0.05, per_depth: float = 0.0) -> Callable[[int, int], float]:
    """Verify cost that barely grows with width (a memory-bound accelerator)."""
    return lambda width, depth: base + 0.0005 * width + per_depth * depth


def linear(per_token: float = 0.05) -> Callable[[int, int], float]:
    """Verify cost proportional to width (reference BLAS on CPU): speculation cannot win."""
    return lambda width, depth: per_token * width


class MemoryStore:
    """The CalibrationStore port in memory, counting saves."""

    def __init__(self) -> None:
        self.entries: dict[Any, Any] = {}
        self.saves = 0

    def load(self, key: Any) -> Any:
        return self.entries.get(key)

    def save(self, key: Any, calibration: Any) -> None:
        self.saves += 1
        self.entries[key] = calibration
