"""Which source runs the next round of an auto request: measured gain per round, pauses, re-probes.

Every candidate (plain decoding included) is judged by what its rounds did on this prompt: tokens per
round ÷ seconds per round. A source's *gain* is that rate over plain decoding's (tokens per plain step:
1 ÷ the plain step's seconds), so plain's gain is 1 by definition and a gain below 1 loses. The rule:

- The *home* candidate runs; after `judge_after` measured rounds it is compared with the others.
- One probe at a time, and after each one `backoff` rounds of home before the next re-probe (a first
  look at a never-measured candidate does not wait).
- A paused candidate is re-probed for `probe_rounds` rounds once its backoff has run out (in rounds,
  and in seconds: as many of its own rounds' seconds, so a slow candidate's probes stay a small share
  of the request's time). A probe behind home ends there; one ahead of it but within the noise measures
  on, up to `max_probe_rounds`. A probe that beats home by `margin` becomes home (the old home is paused
  like a loser); one that does not is paused again with its backoff doubled (quadrupled when it did less
  than half of home; up to `max_backoff`), so a loser costs a few short probes, spaced exponentially.
  `carried` hands the waits left and the grown backoffs to the next request.
- Home moves at once (through a probe) when another candidate's last measurement beats it by `margin`,
  and a home source whose cap policy pauses it (the calibrated cost model says it cannot win) leaves;
  a probe ignores that pause and is judged by what it measures.
- The first round of every stint is not measured: it pays the switch (a drafter catching up on the
  rows it missed, a plain step that had nothing queued), which is not the candidate's steady cost.

Candidates never measured on this prompt start paused with a backoff set by their prior (what earlier
requests or the race measured): plain decoding, an unknown prior or one at least about as good as
plain's is probed right after home's first judgment, a worse one after `backoff` rounds doubled for every
tenth it is below plain's (up to four backoffs), or after the wait an earlier request carried over, or
as soon as home measures below that prior. Pure bookkeeping over numbers: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs

SPREAD_FLOOR = 0.25  # the least relative spread of per-round rates assumed for plain decoding (timing alone)
# A drafting source's rounds commit 1..k+1 tokens: with the floor of plain decoding, two one-token rounds of a
# drafter that runs at 1.4x on average "proved" it a loser, and auto ran plain decoding on most held-out prompts.
DRAFT_SPREAD_FLOOR = 0.8


@attrs.frozen(kw_only=True)
class ArbiterConfig:
    """Knobs of the source rule (rounds, not seconds: the rule never reads a clock).

    Attributes:
        judge_after: measured rounds of home before it is compared with the others.
        probe_rounds: measured rounds a probe runs before it is judged; it goes on while the verdict is
            within the noise (a near tie costs little), up to `max_probe_rounds`.
        backoff: rounds before a paused candidate's first re-probe.
        max_backoff: the longest wait between two probes of one candidate.
        margin: a challenger must beat home's rate by this fraction (noise and switch costs).
        alpha: weight of the newest round in home's running estimate.
        z: standard errors a difference must exceed to count (per-round rates are noisy).
    """

    judge_after: int = 3
    probe_rounds: int = 2
    max_probe_rounds: int = 12
    backoff: int = 16
    max_backoff: int = 256
    margin: float = 0.05
    alpha: float = 0.25
    z: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.judge_after < 1 or self.probe_rounds < 1 or self.backoff < 1 or self.max_backoff < self.backoff:
            raise ValueError("judge_after, probe_rounds and backoff must be >= 1, max_backoff >= backoff")
        if self.max_probe_rounds < self.probe_rounds:
            raise ValueError("max_probe_rounds must be >= probe_rounds")
        if not 0 < self.alpha <= 1 or self.margin < 0:
            raise ValueError("need 0 < alpha <= 1 and margin >= 0")


@attrs.define
class Estimate:
    """A candidate's measured rounds: exponentially weighted tokens and seconds per round (their ratio is
    the rate) and the spread of per-round rates, for a standard error."""

    tokens: float = 0.0
    seconds: float = 0.0
    mean_rate: float = 0.0
    mean_square: float = 0.0
    rounds: int = 0
    weight: float = 0.0  # effective number of rounds behind the averages
    floor: float = SPREAD_FLOOR  # the least relative spread assumed (DRAFT_SPREAD_FLOOR for a drafting source)

    @property
    def rate(self) -> float | None:
        """Tokens per second, None before a measured round."""
        if self.rounds == 0 or self.seconds <= 0:
            return None
        return self.tokens / self.seconds

    @property
    def stderr(self) -> float:
        """Standard error of the rate (per-round rates vary: a round commits 1..k+1 tokens)."""
        if self.rounds < 2:
            return math.inf
        var = max(0.0, self.mean_square - self.mean_rate**2) * self.rounds / (self.rounds - 1)
        # A few equal rounds prove little: never assume less spread than SPREAD_FLOOR of the rate.
        var = max(var, (self.floor * self.mean_rate) ** 2)
        return math.sqrt(var / max(min(self.weight, self.rounds), 1.0))

    def add(self, tokens: int, seconds: float, alpha: float | None) -> None:
        """Fold one round in: `alpha` None = a plain mean of every round, else an EWMA of that weight."""
        r = tokens / seconds
        w = 1.0 / (self.rounds + 1) if alpha is None or self.rounds == 0 else max(alpha, 1.0 / (self.rounds + 1))
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.mean_rate += w * (r - self.mean_rate)
        self.mean_square += w * (r * r - self.mean_square)
        self.rounds += 1
        self.weight = self.rounds if alpha is None else min(self.rounds, (2 - alpha) / alpha)


@attrs.frozen(kw_only=True)
class Switch:
    """The rule moved the request: from the next round on, `new` runs."""

    old: str
    new: str
    reason: str


@attrs.define
class _Candidate:
    prior: float  # tok/s from before this request (0 = unknown)
    estimate: Estimate | None = None  # the latest stint's measurement
    seen: Estimate | None = None  # every round of this request, first rounds of stints included
    due: int = 0  # round index from which it may be probed
    due_s: float = 0.0  # and the request's seconds from which (a slow probe waits longer)
    held: int = 0  # its cap policy paused it: not even a better old measurement brings it back before this
    backoff: int = 0


class SourceArbiter:
    """The per-request rule over named candidates; `plain` names plain decoding (the gain reference).

    Args:
        names: the candidates (at least one).
        start: the candidate that runs first (home).
        priors: tok/s per candidate known before this request (race or earlier requests); they order
            the first probes and pick a fallback before anything is measured. Missing = unknown.
        plain: the name of plain decoding, if it is a candidate.
        carried: per candidate (rounds before its first probe, its backoff), from the request before
            (`carried`); a candidate missing here is placed by its prior.
        config: the knobs.
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        start: str,
        priors: Mapping[str, float] | None = None,
        plain: str | None = None,
        carried: Mapping[str, tuple[int, int]] | None = None,
        config: ArbiterConfig = ArbiterConfig(),
    ) -> None:
        if start not in names:
            raise ValueError(f"start {start!r} is not a candidate")
        self.config = config
        self.plain = plain if plain in names else None
        priors = priors or {}
        carried = carried or {}
        self._c = {n: _Candidate(prior=max(0.0, float(priors.get(n, 0.0)))) for n in dict.fromkeys(names)}
        # Priors are judged against plain decoding's (the reference), else against the first home's.
        ref = self._c[self.plain].prior if self.plain is not None and self._c[self.plain].prior > 0 else 0.0
        ref = ref or self._c[start].prior
        for name, cand in self._c.items():
            cand.backoff = config.backoff
            if name in carried:
                wait, backoff = carried[name]
                cand.due = max(0, int(wait))
                cand.backoff = max(config.backoff, min(int(backoff), config.max_backoff))
            elif 0 < cand.prior < ref * (1 - config.margin):
                # A known worse prior waits a backoff, doubled for every tenth it is below plain's, at
                # most four backoffs (a prior from other prompts may be wrong here).
                tenths = min(int((1 - cand.prior / ref) * 10), 2)
                cand.due = min(config.backoff << tenths, config.max_backoff)
                cand.backoff = cand.due  # and so does its next wait once it has lost a probe
            else:
                cand.due = 0  # unknown, or about as good as plain: a look right after home's first judgment
        if self.plain is not None:
            self._c[self.plain].due = 0  # every gain is relative to it, and measuring it never loses to it
        self.home = start
        self.running = start
        self._round = 0
        self._quiet = 0  # no new probe before this round (one probe at a time, spaced by a backoff)
        self._time = 0.0
        self._stint = 0  # rounds of `running` since it started (the first one is not measured)
        self._stint_estimate = self._fresh(self.running)
        self.rounds: dict[str, int] = dict.fromkeys(self._c, 0)
        self.switches = 0

    # ---- reading

    def rate(self, name: str) -> float | None:
        """The latest measured tok/s of `name` on this prompt (None if never measured)."""
        est = self._c[name].estimate
        return est.rate if est is not None else None

    def gain(self, name: str) -> float | None:
        """Measured rate ÷ plain decoding's measured rate (None until both are measured)."""
        if self.plain is None:
            return None
        mine, base = self.rate(name), self.rate(self.plain)
        if mine is None or base is None or base <= 0:
            return None
        return mine / base

    def measured(self) -> dict[str, float]:
        """tok/s of every candidate that ran on this prompt, over all its rounds (a probe cut short by
        the end of the request included): what the next request's priors learn from."""
        out = {}
        for name, cand in self._c.items():
            rate = self.rate(name)
            if rate is None and cand.seen is not None:
                rate = cand.seen.rate
            if rate is not None:
                out[name] = rate
        return out

    def close(self) -> None:
        """The request ended. A probe cut short by the end is judged on every round it ran (its first
        included): behind home, it is paused like any loser, so a probe that keeps landing at the end of
        short requests does not run in every one of them."""
        if not self.probing:
            return
        seen, home = self._c[self.running].seen, self.rate(self.home)
        if seen is not None and seen.rate is not None and home is not None and seen.rate < home:
            self._pause(self.running, factor=self._factor(self.running, self.home))
            self.running = self.home

    def carried(self) -> dict[str, tuple[int, int]]:
        """For the next request, per source but home: (the rounds still left before its next probe, its
        backoff), so probes stay spaced across short requests, and a wait runs out even when no single
        request is long enough for it."""
        home = self._c[self.home].estimate
        per_round = home.seconds if home is not None and home.rounds else 0.0
        out = {}
        for name, c in self._c.items():
            if name in (self.home, self.plain):
                continue
            wait = max(0, c.due - self._round)
            if per_round > 0 and c.due_s > self._time:  # the wait in seconds, as rounds of home
                wait = max(wait, math.ceil((c.due_s - self._time) / per_round))
            out[name] = (wait, c.backoff)
        return out

    @property
    def probing(self) -> bool:
        """Whether the running candidate is on probation (home waits to take over again)."""
        return self.running != self.home

    # ---- the rule

    def record(self, name: str, tokens: int, seconds: float) -> None:
        """One round of `name` committed `tokens` (a stop token included) in `seconds`."""
        self._round += 1
        self._time += max(seconds, 0.0)
        self.rounds[name] = self.rounds.get(name, 0) + 1
        if name != self.running:  # the caller ran another candidate: follow it as home
            self.home = name
            self._start(name, fresh=False)
        self._stint += 1
        if seconds > 0:
            cand = self._c[name]
            cand.seen = cand.seen or self._fresh(name)
            cand.seen.add(tokens, seconds, None)
        if self._stint > 1 and seconds > 0:
            est = self._stint_estimate
            # A probe is a plain mean of its few rounds; home is a running EWMA.
            est.add(tokens, seconds, None if self.probing else self.config.alpha)
            self._c[name].estimate = est

    def decide(self, *, paused: bool = False) -> Switch | None:
        """After `record`: what runs from the next round (None = the same).

        Args:
            paused: the running source's cap policy has just paused it (at the observed acceptance
                and round times the calibrated cost model says it cannot beat plain decoding). Home
                leaves at once; a probe is judged by its measurement alone (measured beats modelled).
        """
        cfg = self.config
        running = self.running
        if paused and running != self.plain and not self.probing:
            self._pause(running)
            self._c[running].held = self._c[running].due
            nxt = self._best(exclude=running)
            if nxt is None:
                return None
            self.home = nxt
            return self._move(nxt, f"{running} paused by its cap policy: speculation cannot win here")
        measured = self._stint_estimate.rounds
        if self.probing:
            if measured < cfg.probe_rounds:
                return None
            verdict = self._versus(running, self.home)
            mine, home = self.rate(running), self.rate(self.home)
            settled = running == self.plain or measured >= 3 * cfg.probe_rounds
            if verdict is None and settled and mine is not None and home is not None and mine < home:
                # Behind home so far: a loser need not be proven one (it is re-probed); a drafter gets a
                # few more rounds first, its rounds vary too much for two to say.
                verdict = False
            if verdict is None and measured < cfg.max_probe_rounds:
                return None  # ahead of home but within the noise: measure on
            self._quiet = self._round + cfg.backoff
            if verdict is True or (verdict is None and self._ahead(running, self.home)):
                # The probe keeps running: only home moves (no switch), the old home waits a backoff.
                old = self.home
                self._pause(old, factor=self._factor(old, running))
                self._c[running].backoff = cfg.backoff
                self.home = running
                return None
            self._pause(running, factor=self._factor(running, self.home))
            return self._move(self.home, f"probe lost: {self._says(running, self.home)}")
        if measured < cfg.judge_after:
            return None
        # Home fell behind a candidate measured earlier (point estimates: the probe then confirms it).
        best = self._best(exclude=running, measured_only=True, unheld=True)
        if best is not None and self._ahead(best, running):
            return self._probe(best, f"measured faster earlier: {self._says(best, running)}")
        here = self.rate(running) or 0.0
        quiet = self._round < self._quiet
        due = [
            n
            for n, c in self._c.items()
            if n != running
            and (
                # due; a first look at a never-measured one does not wait for the quiet spell
                ((not quiet or c.estimate is None) and c.due <= self._round and c.due_s <= self._time)
                # never measured here, and its prior beats what home measures on this prompt
                or (c.estimate is None and c.prior > here * (1 + cfg.margin) and c.held <= self._round)
            )
        ]
        if due:
            # Never-measured candidates first (plain decoding before them: it is the reference), then by
            # what they are expected to do.
            pick = max(due, key=lambda n: (self._c[n].estimate is None, n == self.plain, self._score(n)))
            kind = "re-probe" if self._c[pick].estimate is not None else "first probe"
            return self._probe(pick, f"{kind} of {pick} ({self._says(running, running)} runs)")
        return None

    # ---- internals

    def _ahead(self, a: str, b: str) -> bool:
        """Whether `a`'s rate beats `b`'s by the margin (point estimates)."""
        ra, rb = self.rate(a), self.rate(b)
        return ra is not None and (rb is None or ra > rb * (1 + self.config.margin))

    def _versus(self, a: str, b: str) -> bool | None:
        """True: `a` beats `b` by the margin beyond the noise; False: it clearly does not; None: unclear."""
        ea, eb = self._c[a].estimate, self._c[b].estimate
        ra = ea.rate if ea is not None else None
        rb = eb.rate if eb is not None else None
        if ra is None:
            return False
        if rb is None or eb is None or ea is None:
            return True
        bar = rb * (1 + self.config.margin)
        spread = self.config.z * math.sqrt(ea.stderr**2 + (eb.stderr * (1 + self.config.margin)) ** 2)
        if ra - bar > spread:
            return True
        if bar - ra > spread:
            return False
        return None

    def _score(self, name: str) -> float:
        rate = self.rate(name)
        return rate if rate is not None else self._c[name].prior

    def _best(self, exclude: str, *, measured_only: bool = False, unheld: bool = False) -> str | None:
        """The best other candidate by measurement, else prior; plain decoding wins ties."""
        others = [
            n
            for n in self._c
            if n != exclude
            and (not measured_only or self.rate(n) is not None)
            and (not unheld or self._c[n].held <= self._round)
        ]
        if not others:
            return None
        return max(others, key=lambda n: (self._score(n), n == self.plain))

    def _says(self, a: str, b: str) -> str:
        def fmt(n: str) -> str:
            r = self.rate(n)
            return f"{n} {r:.1f} tok/s" if r is not None else f"{n} unmeasured"

        return fmt(a) if a == b else f"{fmt(a)} vs {fmt(b)}"

    def _factor(self, loser: str, winner: str) -> int:
        """Backoff growth: a loser that did less than half of the winner is unlikely to flip soon."""
        lost, won = self.rate(loser), self.rate(winner)
        return 4 if lost is not None and won is not None and lost < won * 0.5 else 2

    def _wait(self, name: str, rounds: int) -> None:
        """No probe of `name` for `rounds` rounds, nor before that many of its own rounds' seconds."""
        cand = self._c[name]
        cand.due = self._round + rounds
        est = cand.estimate
        per_round = est.seconds if est is not None and est.rounds else 0.0
        cand.due_s = self._time + rounds * per_round

    def _pause(self, name: str, factor: int = 2) -> None:
        cand = self._c[name]
        self._wait(name, cand.backoff)
        cand.backoff = min(cand.backoff * factor, self.config.max_backoff)

    def _start(self, name: str, *, fresh: bool) -> None:
        self.running = name
        self._stint = 0
        kept = self._c[name].estimate
        # Home continues its estimate; a probe measures afresh (its old number stands until then).
        self._stint_estimate = attrs.evolve(kept) if (kept is not None and not fresh) else self._fresh(name)

    def _fresh(self, name: str) -> Estimate:
        return Estimate(floor=SPREAD_FLOOR if name == self.plain else DRAFT_SPREAD_FLOOR)

    def _probe(self, name: str, reason: str) -> Switch:
        old = self.running
        self._start(name, fresh=True)
        self.switches += 1
        return Switch(old=old, new=name, reason=reason)

    def _move(self, name: str, reason: str) -> Switch:
        old = self.running
        self._start(name, fresh=False)
        self.switches += 1
        return Switch(old=old, new=name, reason=reason)
