"""Draft-cap policies: a fixed cap, or one chosen online from measured curves and observed acceptance."""

from __future__ import annotations

from typing import Protocol

import attrs
from mlx_dspark.domain.costmodel.acceptance import EwmaAcceptance
from mlx_dspark.domain.costmodel.curves import CostCurves, best_cap


@attrs.frozen(kw_only=True)
class CapDecision:
    """A change of draft cap, reported as a telemetry event."""

    old: int
    new: int
    reason: str


class CapPolicy(Protocol):
    """Chooses how many drafts to propose in the next round."""

    def cap(self, depth: int) -> int: ...

    def observe(self, drafted: int, accepted: int, seconds: float, depth: int) -> CapDecision | None: ...


@attrs.define
class FixedCap:
    """Always the same cap (0 = plain decoding)."""

    value: int

    def cap(self, depth: int) -> int:
        return self.value

    def observe(self, drafted: int, accepted: int, seconds: float, depth: int) -> CapDecision | None:
        return None


@attrs.define
class MeasuredCap:
    """Best cap under the cost model, re-decided as acceptance is observed.

    When the model says speculation cannot win (best cap 0) it pauses, and every `probe_every` rounds
    it drafts one round at `probe_cap` so that acceptance keeps being measured and speculation can resume.
    """

    curves: CostCurves
    max_cap: int
    acceptance: EwmaAcceptance = attrs.Factory(EwmaAcceptance)
    probe_every: int = 16
    probe_cap: int = 2
    _current: int = attrs.field(init=False, default=-1)
    _paused_rounds: int = attrs.field(init=False, default=0)

    def _decide(self, depth: int) -> int:
        return best_cap(self.curves, self.acceptance.estimate(), self.max_cap, depth)

    def cap(self, depth: int) -> int:
        if self._current < 0:
            self._current = self._decide(depth)
        if self._current == 0 and self.max_cap > 0:
            self._paused_rounds += 1
            if self._paused_rounds >= self.probe_every:
                self._paused_rounds = 0
                return min(self.probe_cap, self.max_cap)
        return self._current

    def observe(self, drafted: int, accepted: int, seconds: float, depth: int) -> CapDecision | None:
        if drafted > 0:
            self.acceptance.record(drafted, accepted)
        new = self._decide(depth)
        if new == self._current:
            return None
        old, self._current = self._current, new
        if new == 0:
            reason = "pause: speculation cannot win at the observed acceptance"
        elif old == 0:
            reason = "resume: observed acceptance makes speculation pay"
        else:
            reason = "re-optimized from observed acceptance"
        return CapDecision(old=old, new=new, reason=reason)
