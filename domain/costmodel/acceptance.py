"""Acceptance statistics: per-position conditional acceptance and mean accepted tokens per round."""

from __future__ import annotations

import math

import attrs


@attrs.define
class AcceptanceStats:
    """Counts over rounds of one request (or one calibration run).

    Conditional acceptance at position i is accepts[i] / tries[i], where position i is tried only when
    every earlier draft was accepted. Mean accepted per round counts the bonus token and never the token
    produced by prefill (that one comes from no round).
    """

    tries: list[int] = attrs.Factory(list)
    accepts: list[int] = attrs.Factory(list)
    rounds: int = 0
    drafted: int = 0
    committed: int = 0

    def record(self, drafted: int, accepted: int, committed: int) -> None:
        """Add one round: `drafted` proposals, `accepted` of them taken, `committed` tokens emitted."""
        self.rounds += 1
        self.drafted += drafted
        self.committed += committed
        needed = drafted
        while len(self.tries) < needed:
            self.tries.append(0)
            self.accepts.append(0)
        for i in range(min(drafted, accepted + 1)):
            self.tries[i] += 1
            if i < accepted:
                self.accepts[i] += 1

    def conditional(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepts, self.tries)]

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per round, bonus included, prefill token excluded."""
        return self.committed / self.rounds if self.rounds else 0.0


@attrs.define
class EwmaAcceptance:
    """Exponentially weighted per-position conditional acceptance for online cap decisions.

    Only position 0 starts from `prior`. A deeper position starts from the estimate of the one before it:
    positions past the cap in force are never tried, and a flat prior there (below what a draft model
    accepts once its first drafts hold) kept the cap short for a whole request. An EWMA keeps (1 − α)^n of
    its starting value after n outcomes, so that share follows the position before as it learns.
    """

    prior: float = 0.7
    alpha: float = 0.1
    positions: int = 16
    inherit: bool = True  # deeper positions start from the position before, not from `prior`
    values: list[float] = attrs.field(init=False)
    seen: list[int] = attrs.field(init=False)  # outcomes recorded per position

    def __attrs_post_init__(self) -> None:
        self.values = [self.prior] * self.positions
        self.seen = [0] * self.positions

    def record(self, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, accepted + 1, self.positions)):
            hit = 1.0 if i < accepted else 0.0
            self.values[i] += self.alpha * (hit - self.values[i])
            self.seen[i] += 1

    def tried(self) -> int:
        """Leading positions with at least one outcome (position i is tried only once i − 1 was)."""
        return next((i for i, n in enumerate(self.seen) if n == 0), self.positions)

    def estimate(self) -> list[float]:
        if not self.inherit:
            return list(self.values)
        out: list[float] = []
        for i, (value, n) in enumerate(zip(self.values, self.seen, strict=True)):
            if i:  # swap the (1 − α)^n share of the prior for the estimate of the position before
                value += (1.0 - self.alpha) ** n * (out[-1] - self.prior)
            out.append(min(1.0, max(0.0, value)))
        return out

    def lower(self, z: float = 1.0) -> list[float]:
        """The estimate less `z` standard errors per position: an EWMA weighs about (2 - α) / α outcomes
        (fewer while it has seen fewer; the prior counts as one), so a noisy estimate cannot carry a choice
        that wins only on the margin."""
        window = (2.0 - self.alpha) / self.alpha
        out = []
        for value, seen in zip(self.estimate(), self.seen, strict=True):
            n = min(float(seen), window) + 1.0
            out.append(max(0.0, value - z * math.sqrt(value * (1.0 - value) / n)))
        return out


@attrs.define
class DecayedAcceptance:
    """Per-position conditional acceptance from exponentially decayed counts (a batch's pooled estimate).

    Each position keeps hits and tries that decay by 1 − 1/window per outcome recorded there, plus
    `prior_weight` pseudo-tries at `prior`. The estimate follows about the last `window` outcomes, the prior
    washes out after a few, and the standard error shrinks with the outcomes really seen (an EWMA's stays as
    wide as its short window, which keeps a cautious bound far below a drafter that does win).
    """

    prior: float = 0.7
    prior_weight: float = 1.0
    window: float = 64.0
    positions: int = 16
    hits: list[float] = attrs.field(init=False)
    tries: list[float] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.hits = [0.0] * self.positions
        self.tries = [0.0] * self.positions

    def record(self, drafted: int, accepted: int) -> None:
        keep = 1.0 - 1.0 / self.window
        for i in range(min(drafted, accepted + 1, self.positions)):
            self.hits[i] = self.hits[i] * keep + (1.0 if i < accepted else 0.0)
            self.tries[i] = self.tries[i] * keep + 1.0

    def estimate(self) -> list[float]:
        w = self.prior_weight
        return [(h + w * self.prior) / (t + w) for h, t in zip(self.hits, self.tries, strict=True)]

    def lower(self, z: float = 1.0) -> list[float]:
        """The estimate less `z` standard errors per position (the prior counts as `prior_weight` outcomes)."""
        out = []
        for value, tries in zip(self.estimate(), self.tries, strict=True):
            n = tries + self.prior_weight
            out.append(max(0.0, value - z * math.sqrt(value * (1.0 - value) / n)))
        return out


@attrs.define
class EwmaContinuation(EwmaAcceptance):
    """How far a source drafts when its cap allows more: per position i, the chance that draft i is made given
    draft i − 1 was (position 0: that the round drafts at all), as an EWMA starting at 1.

    A draft model's confidence stop ends a block early, a lookup proposes only as far as its match goes: a
    round of cap k then costs the drafts really made, not k. Only positions the cap allowed are counted, so a
    block that ended at its cap says nothing about going further. A source that always fills its cap keeps
    every value at 1, and the cost model reduces to full blocks. It is `EwmaAcceptance`'s estimate over another
    outcome: position i is tried when the cap allowed it and draft i − 1 was made, and holds when draft i was.
    """

    prior: float = 1.0

    def record(self, drafted: int, cap: int) -> None:
        """One round: `drafted` drafts made where `cap` were allowed."""
        super().record(cap, drafted)
