"""Draft-cap policies: a fixed cap, or one chosen online from measured curves, acceptance and round times."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from mlx_dspark.domain.costmodel.acceptance import EwmaAcceptance, EwmaContinuation
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.tokens import SamplingParams


@attrs.frozen(kw_only=True)
class CapDecision:
    """A change of draft cap (or of draft source), reported as a telemetry event."""

    old: int
    new: int
    reason: str


class CapPolicy(Protocol):
    """Chooses how many drafts to propose in the next round."""

    def cap(self, depth: int) -> int: ...

    def observe(
        self, drafted: int, accepted: int, seconds: float, depth: int, cap: int | None = None
    ) -> CapDecision | None:
        """One round's outcome: `drafted` of the `cap` drafts allowed (None: the cap last handed out)."""
        ...


@attrs.define
class FixedCap:
    """Always the same cap (0 = plain decoding)."""

    value: int

    def cap(self, depth: int) -> int:
        return self.value

    def observe(
        self, drafted: int, accepted: int, seconds: float, depth: int, cap: int | None = None
    ) -> CapDecision | None:
        return None


@attrs.define
class RoundTimeCorrection:
    """Observed ÷ predicted round seconds, per verify width, as an EWMA.

    Calibration can be off at run time (other load, thermal limits, real traffic on an MoE, a deeper
    context than calibrated), so the policy rescales the measured curve by what rounds really took.
    Widths never observed take the ratio of the nearest observed widths (linear in between), so one
    observed width rescales the whole curve uniformly and changes no decision by itself.
    """

    alpha: float = 0.2
    ratios: dict[int, float] = attrs.Factory(dict)

    def record(self, width: int, observed_s: float, predicted_s: float) -> None:
        if predicted_s <= 0 or observed_s <= 0:
            return
        ratio = observed_s / predicted_s
        old = self.ratios.get(width)
        self.ratios[width] = ratio if old is None else old + self.alpha * (ratio - old)

    def factor(self, width: int) -> float:
        if not self.ratios:
            return 1.0
        if width in self.ratios:
            return float(self.ratios[width])
        xs = sorted(self.ratios)
        if width < xs[0]:
            return self.ratios[xs[0]]
        if width > xs[-1]:
            return self.ratios[xs[-1]]
        hi = next(x for x in xs if x > width)
        lo = max(x for x in xs if x < width)
        t = (width - lo) / (hi - lo)
        return self.ratios[lo] + t * (self.ratios[hi] - self.ratios[lo])


def corrected_rate(
    curves: CostCurves,
    cap: int,
    acceptance: Sequence[float],
    correction: RoundTimeCorrection,
    depth: int = 0,
    continuation: Sequence[float] = (),
) -> float:
    """Expected tokens per second at `cap`, with the round time rescaled by observed ÷ predicted.

    `continuation` (`EwmaContinuation`) says how often the source drafts on at each position: a round of cap
    `cap` then drafts d < cap with some probability and costs a round of d. Empty: every block fills its cap.
    """

    def seconds_at(drafted: int) -> float:
        return curves.round_seconds(drafted, depth) * correction.factor(drafted + 1)

    tokens, seconds = 1.0, 0.0
    reach = 1.0  # P(drafts 0..i-1 are made)
    held = 1.0  # P(drafts 0..i are all accepted | made)
    for i in range(cap):
        go = continuation[min(i, len(continuation) - 1)] if continuation else 1.0
        made = reach * go
        if made < reach:
            seconds += (reach - made) * seconds_at(i)  # the round stops after i drafts
        held *= acceptance[min(i, len(acceptance) - 1)] if acceptance else 0.0
        tokens += made * held
        reach = made
    seconds += reach * seconds_at(cap)
    if seconds <= 0:
        return float("inf")
    return tokens / seconds


def _prior_acceptance(policy: MeasuredCap) -> EwmaAcceptance:
    return EwmaAcceptance(positions=max(policy.max_cap, 1))


def _full_blocks(policy: MeasuredCap) -> EwmaContinuation:
    return EwmaContinuation(positions=max(policy.max_cap, 1))


@attrs.define
class MeasuredCap:
    """Best cap under the cost model, re-decided from observed acceptance and observed round times.

    When the model says speculation cannot win (best cap 0) it pauses, and every `probe_every` rounds
    it drafts one round at `probe_cap` so that acceptance keeps being measured and speculation can resume.
    While speculating it runs one plain round every `explore_every` rounds so the observed cost of the
    plain step (the baseline every cap is compared with) stays current. Probes and exploration rounds
    are scheduled measurements, not decisions; every decision (the first one included) comes back from
    `observe` as a CapDecision, which the decode loop yields as a CapChanged event.

    Attributes:
        curves: calibrated seconds per round on this machine.
        max_cap: the largest cap allowed (the source's block, or the user's --max-draft).
        acceptance: per-position conditional acceptance, starting from a prior.
        hysteresis: a new cap must beat the current one's expected rate by this fraction.

    Once rounds run, a decision reaches at most one position past both the cap in force and the deepest
    position tried: an untried position's estimate is borrowed from the one before, and a long block bet on
    borrowed estimates cost a draft model a whole wasted block (8 drafts, 4 % of a 64-token request on the
    1.5B). The first untried position is priced as if it held, so the cap still grows past estimates it only
    borrowed, one position at a time, each bet costing at most one draft.
    """

    curves: CostCurves
    max_cap: int
    acceptance: EwmaAcceptance = attrs.Factory(_prior_acceptance, takes_self=True)
    continuation: EwmaContinuation = attrs.Factory(_full_blocks, takes_self=True)
    correction: RoundTimeCorrection = attrs.Factory(RoundTimeCorrection)
    probe_every: int = 16
    probe_cap: int = 2
    explore_every: int = 32
    hysteresis: float = 0.02
    grow_by: int | None = 1  # positions a decision may reach past the cap in force and the deepest tried
    _current: int = attrs.field(init=False, default=-1)
    _announced: bool = attrs.field(init=False, default=False)
    _paused_rounds: int = attrs.field(init=False, default=0)
    _spec_rounds: int = attrs.field(init=False, default=0)
    _last: int = attrs.field(init=False, default=0)  # the cap last handed out

    def __attrs_post_init__(self) -> None:
        if self.max_cap < 0:
            raise ValueError("max_cap must be >= 0")

    def rate(self, cap: int, depth: int) -> float:
        """Expected tokens per second at `cap` under what has been observed so far."""
        return self._rates(depth, self._frontier())(cap)

    def _frontier(self) -> int | None:
        """The first untried position while the cap grows from it (None: unbounded, or no decision made yet)."""
        return None if self.grow_by is None or self._current < 0 else self.acceptance.tried()

    def _rates(self, depth: int, frontier: int | None = None) -> Callable[[int], float]:
        """Expected tokens per second by cap, the estimates read once (a decision prices every cap)."""
        acceptance, continuation = self.acceptance.estimate(), self.continuation.estimate()
        if frontier is not None and frontier < len(acceptance):
            acceptance[frontier] = 1.0  # priced as if it held, until tried: being wrong costs one draft, once
        return lambda cap: corrected_rate(self.curves, cap, acceptance, self.correction, depth, continuation)

    def _decide(self, depth: int) -> int:
        frontier = self._frontier()
        rate_of = self._rates(depth, frontier)
        best, best_rate = 0, rate_of(0)
        reach = self.max_cap
        if frontier is not None and self.grow_by is not None:
            reach = max(self._current, frontier) + self.grow_by
        for cap in range(1, min(self.max_cap, reach) + 1):
            rate = rate_of(cap)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = cap, rate
        # Stay put unless the winner is clearly better: rates are noisy and flapping costs a re-plan.
        if (
            0 <= self._current <= self.max_cap
            and best != self._current
            and best_rate <= rate_of(self._current) * (1 + self.hysteresis)
        ):
            return self._current
        return best

    def cap(self, depth: int) -> int:
        self._last = self._next_cap(depth)
        return self._last

    def _next_cap(self, depth: int) -> int:
        if self._current < 0:
            self._current = self._decide(depth)
        if self._current == 0:
            if self.max_cap > 0:
                self._paused_rounds += 1
                if self._paused_rounds >= self.probe_every:
                    self._paused_rounds = 0
                    return min(self.probe_cap, self.max_cap)
            return 0
        self._spec_rounds += 1
        if self.explore_every > 0 and self._spec_rounds % self.explore_every == 0:
            return 0
        return self._current

    def observe(
        self, drafted: int, accepted: int, seconds: float, depth: int, cap: int | None = None
    ) -> CapDecision | None:
        if drafted > 0:
            self.acceptance.record(drafted, accepted)
        allowed = self._last if cap is None else cap
        if allowed > 0:
            self.continuation.record(drafted, allowed)
        self.correction.record(drafted + 1, seconds, self.curves.round_seconds(drafted, depth))
        old = self._current if self._announced else self.max_cap
        new = self._decide(depth)
        self._current = new
        if not self._announced:
            # The first decision is reported against the default a policy-less loop would use (when it differs:
            # "cap 7 -> 7" said nothing).
            self._announced = True
            return (
                None
                if new == old
                else CapDecision(old=old, new=new, reason="initial: best cap under the calibrated curves")
            )
        if new == old:
            return None
        if new == 0:
            reason = "pause: speculation cannot win at the observed acceptance and round times"
        elif old == 0:
            reason = "resume: observed acceptance and round times make speculation pay"
        else:
            reason = "re-optimized from observed acceptance and round times"
        return CapDecision(old=old, new=new, reason=reason)


@attrs.define
class ModelledSeconds:
    """A cap policy fed each round's calibrated (modelled) seconds instead of its wall time.

    For a seeded request: a round draws as many uniforms as its cap asks, so caps that follow wall time would
    make the same seed give other tokens on a busier run or beside other requests in a batch.
    """

    inner: CapPolicy
    curves: CostCurves

    def cap(self, depth: int) -> int:
        return self.inner.cap(depth)

    def observe(
        self, drafted: int, accepted: int, seconds: float, depth: int, cap: int | None = None
    ) -> CapDecision | None:
        return self.inner.observe(drafted, accepted, self.curves.round_seconds(drafted, depth), depth, cap)


def repeatable(policy: CapPolicy, sampling: SamplingParams | None) -> CapPolicy:
    """`policy` for a request of `sampling`: a seeded request's calibrated policy learns from modelled seconds."""
    curves = getattr(policy, "curves", None)
    if sampling is not None and sampling.seeded and isinstance(curves, CostCurves):
        return ModelledSeconds(policy, curves)
    return policy
