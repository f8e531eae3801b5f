"""Which source runs the next round of an auto request: forecasts of every candidate's rate, not probes.

A request cannot afford to try every source on its own prompt: on a 128-token answer, probing three
losers for a few rounds each costs more than the best of them gains (auto ran at 0.87-0.93 of the best
fixed mode that way, on the CPU and the H200 alike). So auto forecasts what each candidate would do here
and runs the best forecast; a rate is tokens per round ÷ seconds per round, split into its two factors:

- *seconds per round* hardly depend on the prompt: the `CostBook` learns them per (source, drafts) as the
  median of the recent rounds any request ran, starting from the calibrated curves, and every forecast (the
  running source's too) takes its seconds from the book, so one stalled round misleads none;
- *tokens per round* do, and are measured where that is free: plain decoding commits one; n-gram lookup's
  rounds are replayed on the tokens actually committed (`drafting.lookup.ShadowLookup`: exact for greedy
  output, host work only); the running source's are its own rounds. A drafter not running is forecast
  from its prior (what earlier requests or the race measured), scaled by how the running drafter does
  against its own prior: prompts easy for one drafter are easy for the other. A drafter never measured
  on this prompt whose forecast comes near the running source's gets one first look (a prior averages
  other prompts; on code or math a drafter does far better than on chat), and so do plain decoding and
  lookup until their rounds were timed once in the process (the calibration may miss a pipelined step).
  A drafter measured here and then left keeps that measurement, which relaxes towards the prior
  (half-life `relax` rounds, doubled each time it loses again), so a request whose text changes
  character gets it back.

A switch needs a forecast `margin` ahead of the running source's estimate (a switch has a cost, and a
forecast an error), after `settle` measured rounds of the running stint; the first round of a stint counts
its tokens but not its seconds (it pays the switch). Tokens per round measured on this prompt are shrunk
towards the drafter's earlier prompts (`prior_rounds`): a look of a few rounds is a small sample.
Pure bookkeeping over numbers: no clock, no I/O.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence

import attrs


@attrs.frozen(kw_only=True)
class ForecastConfig:
    """Knobs of the rule (rounds, not seconds: the rule never reads a clock).

    Attributes:
        margin: a candidate's forecast must beat the running source's estimate by this fraction.
        settle: measured rounds of a stint before the running source is compared with the others.
        alpha: weight of the newest round in a running estimate.
        relax: rounds over which a left drafter's measurement goes halfway back to its prior.
        look: a drafter never measured on this prompt gets one first look (a stint of `settle` rounds)
            when its forecast is at least (1 - look) of the running source's estimate: a prior is an
            average over other prompts, and on code or math a drafter does far better than on chat.
        prior_rounds: a drafter's tokens per round measured on this prompt are shrunk towards what earlier
            prompts measured as if that were this many rounds of this prompt (0: no shrinkage).
    """

    margin: float = 0.2
    look: float = 0.3
    settle: int = 3
    alpha: float = 0.08
    relax: int = 64
    prior_rounds: float = 2.0

    def __attrs_post_init__(self) -> None:
        if (
            self.margin < 0
            or self.prior_rounds < 0
            or self.settle < 1
            or self.relax < 1
            or not 0 < self.alpha <= 1
            or not 0 <= self.look <= 1
        ):
            raise ValueError(
                "need margin >= 0, prior_rounds >= 0, settle >= 1, relax >= 1, 0 < alpha <= 1 and 0 <= look <= 1"
            )


class CostBook:
    """Seconds per round of each source by its number of drafts, learned from measured rounds.

    A width measured `known` times costs the median of its last `window` rounds; any other costs its seed
    (the calibrated curves' round seconds) times the median ratio of this source's recent rounds to their
    seeds, so a few rounds teach every width of that source. Medians, not averages: on a shared host one
    stalled round (a GPU host measured a whole 128-token request taking 20 s once) must not make a source
    look slow to every later request. `frozen` books never learn (a seeded request's schedule must not follow
    the wall clock).
    """

    def __init__(
        self, seed: Callable[[str, int], float], *, window: int = 15, known: int = 3, frozen: bool = False
    ) -> None:
        if window < 1 or known < 1:
            raise ValueError("need window >= 1 and known >= 1")
        self._seed = seed
        self._window = window
        self._known = known
        self._frozen = frozen
        self._rounds: dict[tuple[str, int], deque[float]] = {}
        self._ratios: dict[str, deque[float]] = {}

    def seconds(self, name: str, drafted: int) -> float:
        """The forecast seconds of one round of `name` drafting `drafted` tokens."""
        rounds = self._rounds.get((name, drafted))
        if rounds is not None and len(rounds) >= self._known:
            return statistics.median(rounds)
        ratios = self._ratios.get(name)
        return max(self._seed(name, drafted), 1e-9) * (statistics.median(ratios) if ratios else 1.0)

    def knows(self, name: str) -> bool:
        """Whether a round of `name` was measured."""
        return name in self._ratios

    def observe(self, name: str, drafted: int, seconds: float) -> None:
        """One measured round."""
        if self._frozen or not seconds > 0:
            return
        self._rounds.setdefault((name, drafted), deque(maxlen=self._window)).append(seconds)
        ratio = seconds / max(self._seed(name, drafted), 1e-9)
        self._ratios.setdefault(name, deque(maxlen=self._window)).append(ratio)


@attrs.frozen(kw_only=True)
class Switch:
    """The rule moved the request: from the next round on, `new` runs."""

    old: str
    new: str
    reason: str


@attrs.define
class _Estimate:
    tokens: float = 0.0
    seconds: float = 0.0
    drafted: float = 0.0
    rounds: int = 0
    at: int = 0  # the request round of its latest measurement

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, tokens: float, seconds: float, drafted: int, alpha: float, at: int) -> None:
        w = max(alpha, 1.0 / (self.rounds + 1))
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.drafted += w * (drafted - self.drafted)
        self.rounds += 1
        self.at = at


class ForecastArbiter:
    """The per-request rule over named candidates (see the module docstring).

    Args:
        names: the candidates.
        start: the candidate that runs first.
        priors: tok/s per candidate from before this request (race or earlier requests); 0 or missing =
            unknown (an unknown drafter is forecast at plain decoding's rate until it runs).
        acceptance: tokens per round per candidate from earlier requests (0 or missing = unknown): how a
            running drafter does here against its own scales the other drafters' priors.
        plain: the name of plain decoding, if it is a candidate (forecast from the cost book alone).
        shadowed: candidates whose rounds the caller replays (`shadow`) instead of running them.
        costs: the cost book, shared across requests (a seeded request passes a frozen copy).
        config: the knobs.
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        start: str,
        priors: Mapping[str, float] | None = None,
        acceptance: Mapping[str, float] | None = None,
        plain: str | None = None,
        shadowed: Collection[str] = (),
        costs: CostBook,
        config: ForecastConfig = ForecastConfig(),
    ) -> None:
        if start not in names:
            raise ValueError(f"start {start!r} is not a candidate")
        self.config = config
        self.names = list(dict.fromkeys(names))
        self.plain = plain if plain in self.names else None
        self.shadowed = frozenset(n for n in shadowed if n in self.names and n != self.plain)
        self.costs = costs
        self._prior = {n: max(0.0, float((priors or {}).get(n, 0.0))) for n in self.names}
        self._accept = {n: max(0.0, float((acceptance or {}).get(n, 0.0))) for n in self.names}
        self._est: dict[str, _Estimate] = {}
        self._relax = dict.fromkeys(self.names, config.relax)
        self.running = start
        self._stint = 0
        self._measured_in_stint = 0
        self._round = 0
        self.rounds: dict[str, int] = dict.fromkeys(self.names, 0)

    # ---- reading

    def plain_rate(self) -> float:
        """Plain decoding's forecast: one token per step of the cost book."""
        if self.plain is None:
            return 0.0
        return 1.0 / self.costs.seconds(self.plain, 0)

    def forecast(self, name: str) -> float:
        """tok/s `name` is expected to run at from the next round on, on this prompt."""
        if name == self.plain:
            return self.plain_rate()
        est = self._est.get(name)
        if name in self.shadowed or name == self.running:
            if est is not None and est.rounds:
                return self._rate(name, est)
            return self._prior_of(name)
        prior = self._scaled_prior(name)
        if est is None or not est.rounds:
            return prior
        # A left drafter's measurement relaxes towards its (scaled) prior.
        weight: float = 0.5 ** ((self._round - est.at) / self._relax[name])
        return weight * self._rate(name, est) + (1 - weight) * prior

    def measured(self) -> dict[str, float]:
        """tok/s of every candidate measured on this prompt (run or replayed): what the next request's
        priors learn from."""
        out = {n: e.rate for n, e in self._est.items() if e.rounds and e.seconds > 0}
        if self.plain is not None and self.rounds.get(self.plain, 0):
            out[self.plain] = self.plain_rate()
        return out

    def acceptance(self) -> dict[str, tuple[float, float, int]]:
        """(tokens, drafts) per round of every drafting candidate measured on this prompt (run or replayed), and
        how many rounds that rests on."""
        return {n: (e.tokens, e.drafted, e.rounds) for n, e in self._est.items() if e.rounds}

    def best(self, exclude: str | None = None) -> str:
        """The candidate with the best forecast now, `exclude` aside (plain decoding wins ties: it needs no
        drafter)."""
        return max((n for n in self.names if n != exclude), key=lambda n: (self.forecast(n), n == self.plain))

    # ---- the rule

    def record(self, name: str, tokens: int, seconds: float, drafted: int = 0) -> None:
        """One round of `name` committed `tokens` (a stop token included) in `seconds` after `drafted` drafts."""
        self._round += 1
        self.rounds[name] = self.rounds.get(name, 0) + 1
        if name != self.running:  # the caller ran another candidate: follow it
            self._begin(name)
        self._stint += 1
        timed = self._stint > 1 and seconds > 0  # the first round of a stint pays the switch: not its steady cost
        if timed:
            self.costs.observe(name, drafted, seconds)
        # A stint's first round counts its tokens too (the switch costs time, not acceptance) once the book has
        # timed this source's rounds: until then its seconds would be a seed, not a measurement. The seconds are
        # the book's (robust, and the modelled ones for a frozen book), not this round's.
        if name != self.plain and (timed or (self._stint == 1 and self.costs.knows(name))):
            cost = self.costs.seconds(name, drafted)
            self._est.setdefault(name, _Estimate()).add(tokens, cost, drafted, self.config.alpha, self._round)
        if timed:
            self._measured_in_stint += 1

    def shadow(self, name: str, tokens: int, drafted: int) -> None:
        """A replayed round of a shadowed candidate: its tokens, at the cost book's seconds."""
        if name not in self.shadowed or name == self.running:
            return
        seconds = self.costs.seconds(name, drafted)
        self._est.setdefault(name, _Estimate()).add(tokens, seconds, drafted, self.config.alpha, self._round)

    def decide(self, *, paused: bool = False) -> Switch | None:
        """After `record` (and this round's `shadow`s): what runs from the next round (None = the same).

        Args:
            paused: the running source's cap policy has just paused it (the calibrated cost model says
                it cannot beat plain decoding at the acceptance it sees): the request leaves it at once.
        """
        running = self.running
        if paused and running != self.plain:
            reason = f"{running} paused by its cap policy: speculation cannot win here"
            return self._switch(self.best(exclude=running), reason)
        if self._measured_in_stint < self.config.settle:
            return None
        best = self.best()
        here = self.forecast(running)
        if best != running and self.forecast(best) > here * (1 + self.config.margin):
            if running != self.plain and running not in self.shadowed:
                # It lost on this prompt: its measurement stays, relaxing back more slowly each time.
                self._relax[running] = min(self._relax[running] * 2, 64 * self.config.relax)
            return self._switch(best, f"forecast {self._says(best)} vs {self._says(running)}")
        unseen = [
            n
            for n in self.names
            if n != running and self._unseen(n) and self.forecast(n) >= here * (1 - self.config.look)
        ]
        if unseen:
            pick = max(unseen, key=self.forecast)
            return self._switch(pick, f"first look at {self._says(pick)} ({self._says(running)} runs)")
        return None

    # ---- internals

    def _unseen(self, name: str) -> bool:
        """Whether `name`'s rate is a guess: a drafter not run on this prompt, or plain decoding or a replayed
        source whose round was never timed in this process (their seconds are then the calibration's, which
        on a GPU can miss what a pipelined step really takes)."""
        if name == self.plain or name in self.shadowed:
            return not self.costs.knows(name) and not self.rounds.get(name, 0)
        return name not in self._est

    def _prior_of(self, name: str) -> float:
        return self._prior.get(name, 0.0) or self.plain_rate()

    def _scaled_prior(self, name: str) -> float:
        """A drafter's prior, scaled by how many tokens a round the running drafter commits here against
        what it committed on earlier prompts (acceptance, not speed: the two drafters' costs differ)."""
        prior = self._prior_of(name)
        run = self.running
        est = self._est.get(run)
        if run in (name, self.plain) or run in self.shadowed or est is None or not est.rounds:
            return prior
        own = self._accept.get(run, 0.0)
        return prior * (self._tokens(run, est) / own) if own > 0 and self._accept.get(name, 0.0) > 0 else prior

    def _rate(self, name: str, est: _Estimate) -> float:
        return self._tokens(name, est) / est.seconds if est.seconds > 0 else 0.0

    def _tokens(self, name: str, est: _Estimate) -> float:
        """Tokens per round of a drafter measured here, shrunk towards what earlier prompts measured by
        `prior_rounds` pseudo-rounds (a look of 3-4 rounds on a drafter whose rounds commit 1 to 8 tokens is a
        small sample)."""
        own = self._accept.get(name, 0.0)
        if name in self.shadowed or own <= 0:
            return est.tokens
        n = min(est.rounds, 1.0 / self.config.alpha)
        k = self.config.prior_rounds
        return (n * est.tokens + k * own) / (n + k)

    def _says(self, name: str) -> str:
        kind = " replayed" if name in self.shadowed else ""
        return f"{name} {self.forecast(name):.1f} tok/s{kind}"

    def _begin(self, name: str) -> None:
        self.running = name
        self._stint = 0
        self._measured_in_stint = 0

    def _switch(self, name: str, reason: str) -> Switch:
        old = self.running
        self._begin(name)
        return Switch(old=old, new=name, reason=reason)
