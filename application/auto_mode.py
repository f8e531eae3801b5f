"""Use case: `--mode auto` picks the draft source for a (target, drafter) pair by measurement.

A short race on built-in prompts gives the first estimates (stored with the calibration); online, the
AutoSelector runs every request under a ForecastArbiter (the domain's rule), which forecasts each
candidate's rate on the user's own prompt (seconds per round from a cost book every request teaches,
tokens per round measured where it is free: lookup's rounds replayed on the committed tokens) and moves
the request to the best forecast between rounds. Every round is verified by the target, so any choice is
lossless.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import attrs

from mlx_dspark.application.calibration import CalibrationPlan, Progress, curves_for, drafter_identity
from mlx_dspark.application.data import load_prompts
from mlx_dspark.application.engine import decode
from mlx_dspark.application.ports import CalibrationStore, LoadedModel
from mlx_dspark.domain.costmodel.calibration import Calibration, CalibrationKey
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.costmodel.draft_cap import CapDecision, CapPolicy, FixedCap, MeasuredCap, repeatable
from mlx_dspark.domain.costmodel.forecast import CostBook, ForecastArbiter, ForecastConfig
from mlx_dspark.domain.drafting.lookup import ShadowLookup
from mlx_dspark.domain.drafting.selection import FixedSelector, Selection, SourceSelector, SourceSwitcher
from mlx_dspark.domain.events import Finished, SourceSwitched, Usage
from mlx_dspark.domain.ports import Clock, DraftSource
from mlx_dspark.domain.tokens import SamplingParams, StopRule

CapPolicyFactory = Callable[[], CapPolicy]
RACE_PROMPTS = ("chat-03", "code-02", "math-05")
DEFAULT_RULE = ForecastConfig()
PROBE_CAP = 2  # drafts per round of a source whose cap policy has paused it but which auto probes


def cap_policy_factory(max_draft: int | None, curves: CostCurves | None, max_block: int) -> CapPolicyFactory:
    """A fresh cap policy per request: FixedCap for `--max-draft N`, MeasuredCap for "auto".

    Args:
        max_draft: the parsed `--max-draft` (None = auto, see `modes.parse_max_draft`).
        curves: the source's calibrated curves (needed for auto; without them auto drafts the full block).
        max_block: the source's largest block.
    """
    fixed = max_draft
    if fixed is not None:
        cap = min(fixed, max_block)
        return lambda: FixedCap(cap)
    if curves is None:
        return lambda: FixedCap(max_block)
    return lambda: MeasuredCap(curves=curves, max_cap=max_block)


def race_prompt_ids(model: LoadedModel, ids: Sequence[str] = RACE_PROMPTS) -> list[list[int]]:
    """Token ids of a few built-in prompts (one per class), through the chat template when there is one."""
    prompts = [p for p in load_prompts("chat,code,math").prompts if p.id in ids]
    tok = model.tokenizer
    out = []
    for p in prompts:
        if tok.chat_template:
            text = tok.render_chat([{"role": "user", "content": p.prompt}])
            out.append(tok.encode(text, add_special_tokens=False))
        else:
            out.append(tok.encode(p.prompt))
    return [ids_ for ids_ in out if ids_]


def race(
    model: LoadedModel,
    candidates: Mapping[str, DraftSource | None],
    policies: Mapping[str, CapPolicyFactory],
    clock: Clock,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 32,
    progress: Progress | None = None,
    curves: Mapping[str, CostCurves] | None = None,
) -> dict[str, float]:
    """Decode tokens per second of each candidate on `prompts` (greedy, a short warm-up each).

    With `curves`, a candidate that has them is rated at the calibrated seconds of its rounds (tokens per
    round ÷ the curves' round time at its mean drafts per round) instead of the wall clock: acceptance is
    what the race learns. The curves time every width after a warm-up, while a race on a device that
    compiles kernels on first use (a GPU) charged each new shape to whichever candidate met it first.

    Returns:
        Mode name → decode tokens per second (0.0 when it generated nothing).
    """
    rates: dict[str, float] = {}
    stop = StopRule(max_tokens=max_tokens, eos_ids=frozenset())  # full length: equal work for every source
    total = max(len(candidates) * (len(prompts) + 1), 1)
    done = 0
    for name, source in candidates.items():
        tokens, seconds, rounds, drafted = 0, 0.0, 0, 0
        for i, prompt in enumerate([prompts[0], *prompts]):
            policy = policies[name]() if source is not None else None
            usage = None
            # The first run is a short warm-up (this source's shapes); the rest are timed.
            limit = stop if i > 0 else StopRule(max_tokens=min(4, max_tokens), eos_ids=frozenset())
            for event in decode(model.target, prompt, SamplingParams(), limit, clock, source=source, cap_policy=policy):
                if isinstance(event, Finished):
                    usage = event.usage
            if i > 0 and usage is not None:  # the first run only warms up
                tokens += max(usage.generated_tokens - 1, 0)
                seconds += usage.decode_s
                rounds += usage.rounds
                drafted += usage.drafted
            done += 1
            if progress is not None:
                progress(f"race {name}", done / total)
        cost = (curves or {}).get(name)
        if cost is not None and rounds > 0:
            rates[name] = (tokens / rounds) / max(cost.round_seconds(round(drafted / rounds)), 1e-9)
        else:
            rates[name] = tokens / seconds if seconds > 0 else 0.0
    model.target.reset(0)
    return rates


@attrs.define
class _Candidate:
    source: DraftSource | None
    rate: float  # EWMA of observed decode tokens/s, seeded from the race
    race: float  # what the race measured (the fixed prior of seeded requests)
    accept: float = 0.0  # tokens per round over earlier requests (0 = never measured)
    drafted: float = 0.0  # and drafts per round
    evidence: float = 0.0  # the rounds `accept` rests on (at most MAX_EVIDENCE: it keeps moving)


# What a prior of tokens per round weighs, in rounds: the race's, when a drafter is first measured (about one
# short request: a few rounds on a hard opening must not overturn what every race prompt said), and at most
# (so a long run of requests still moves it).
RACE_EVIDENCE = 16
MAX_EVIDENCE = 64


class AutoSelector:
    """`--mode auto` online: adapts within each request on the user's own prompt.

    Every request gets a `ForecastArbiter` (domain/costmodel/forecast.py) over all candidates, plain
    decoding included. It forecasts each candidate's rate on this prompt: seconds per round from the
    selector's `CostBook` (seeded with the calibrated curves, taught by every measured round of every
    request), tokens per round from the running source's rounds, from lookup's rounds replayed on the
    committed tokens (`ShadowLookup`: no lookup round has to run to know it), and for a drafter not
    running from its prior scaled by how the running drafter does against its own. The request runs the
    best forecast, moving when another's beats the running source's estimate by the margin; the running
    source's cap policy (a MeasuredCap on the calibrated curves) may move it too. Between requests the
    selector keeps each candidate's measured rate (an EWMA seeded with the race) and tokens per round (averages
    weighed by the rounds behind them, a drafter's first seeded with what its race rate implies; a drafter
    that did not run on a prompt moves by the factor the ones that ran beat their own priors there); the
    next request's priors are those tokens per round at the cost book's seconds, and it starts on the best
    of them (one prompt's winner says little of the next). Cap policies are fresh per request, as in fixed
    modes.

    Seeded sampling must repeat token for token, and the uniforms a round draws depend on which source
    runs it, so a seeded request decides on modelled costs instead of wall time: a cost book that only
    holds the calibrated curves, fresh cap policies fed those same seconds, and the race as its fixed
    prior. Greedy and unseeded requests decide on wall time. The target verifies every round, so no
    choice changes greedy output. Each move is a SourceSwitched event.
    """

    def __init__(
        self,
        candidates: Mapping[str, DraftSource | None],
        policies: Mapping[str, CapPolicyFactory],
        rates: Mapping[str, float],
        *,
        curves: Mapping[str, CostCurves] | None = None,
        config: ForecastConfig = DEFAULT_RULE,
        alpha: float = 0.5,
        in_request: bool = True,
    ) -> None:
        if not candidates:
            raise ValueError("no candidates")
        self._factories = dict(policies)
        self._candidates = {
            name: _Candidate(
                source=src,
                rate=float(rates.get(name, 0.0)),
                race=float(rates.get(name, 0.0)),
            )
            for name, src in candidates.items()
        }
        self._curves = dict(curves or {})
        self._config = config
        self._alpha = alpha
        self._in_request = in_request
        self.costs = CostBook(self._seed_seconds)
        self._winner = self._best_by(lambda c: c.race)
        self._last = self.current  # the source the last request ended on

    @property
    def mode(self) -> str:
        return "auto"

    @property
    def plain(self) -> str | None:
        """The name of plain decoding among the candidates (None if it is not one)."""
        return next((n for n, c in self._candidates.items() if c.source is None), None)

    def rates(self) -> dict[str, float]:
        """Current throughput estimates per candidate."""
        return {name: c.rate for name, c in self._candidates.items()}

    @property
    def current(self) -> str:
        """The candidate the next (unseeded) request starts on: the best prior (plain decoding wins ties)."""
        priors = self.priors()
        return max(priors, key=lambda n: (priors[n], self._candidates[n].source is None))

    def priors(self) -> dict[str, float]:
        """What the next request expects of each candidate, tok/s: tokens per round over earlier requests
        at the cost book's seconds for that many drafts (so a source found slow is known slow at once),
        else the measured rate (the race's until a request ran it); plain decoding from the cost book."""
        out = {}
        for name, c in self._candidates.items():
            if c.source is None and self.plain_known():
                out[name] = 1.0 / self.costs.seconds(name, 0)
            elif c.accept > 0:
                out[name] = c.accept / self.costs.seconds(name, round(c.drafted))
            else:
                out[name] = c.rate
        return out

    def plain_known(self) -> bool:
        """Whether plain decoding's step has a cost beyond the race (curves, or a measured step)."""
        plain = self.plain
        return plain is not None and (plain in self._curves or self.costs.knows(plain))

    def _seed_seconds(self, name: str, drafted: int) -> float:
        """A round's seconds before any was measured: the calibrated curves (the source's own; for a source
        without curves a verify of its width on plain decoding's), else one plain step at the race's rate."""
        own = self._curves.get(name)
        if own is not None:
            return own.round_seconds(drafted)
        plain = self.plain
        base = self._curves.get(plain) if plain is not None else None
        if base is not None:
            return base.round_seconds(0) + base.verify(drafted + 1) - base.verify(1)
        rate = self._candidates[plain].race if plain is not None else 0.0
        return 1.0 / rate if rate > 0 else 1.0

    def _best_by(self, key: Callable[[_Candidate], float]) -> str:
        # On a tie plain decoding wins: it needs no drafter.
        return max(self._candidates, key=lambda n: (key(self._candidates[n]), self._candidates[n].source is None))

    def _selection(
        self,
        name: str,
        policy: CapPolicy | None,
        switched: SourceSwitched | None,
        switcher: SourceSwitcher | None,
        lane: _Lane | None = None,
    ) -> Selection:
        source = self._candidates[name].source if lane is None else lane.sources[name]
        return Selection(name=name, source=source, policy=policy, switched=switched, switcher=switcher)

    def sources(self) -> dict[str, DraftSource | None]:
        """Every candidate's draft source (None: plain decoding)."""
        return {name: c.source for name, c in self._candidates.items()}

    def lane_view(
        self,
        wrap: Callable[[DraftSource], DraftSource],
        *,
        policy: Callable[[CapPolicy], CapPolicy] | None = None,
        hold: Callable[[], bool] | None = None,
    ) -> LaneAutoSelector:
        """This selector for one batched request, everything it learns shared with this selector.

        Args:
            wrap: each candidate's source → the request's own (a per-request fork).
            policy: wraps each fresh cap policy (the batch's plan overrules it while rows share the batch).
            hold: while it says so, the request stays on its source and its rounds teach the arbiter nothing
                (a shared batched tick is not the source's own round).
            A seeded request takes neither: it decides on modelled costs, so its schedule stays its solo one.
        """
        lane = _Lane({n: None if s is None else wrap(s) for n, s in self.sources().items()}, policy, hold)
        return LaneAutoSelector(self, lane)

    def _fresh_policy(self, name: str) -> CapPolicy | None:
        """A new cap policy for one request, as fixed modes get. One kept across requests learned a low
        acceptance on hard prompts and then drafted 1-2 tokens a round on easy ones: a cap never drafted
        past never measures those positions again."""
        return self._factories[name]() if self._candidates[name].source is not None else None

    def _seed_acceptance(self, name: str, drafted: float) -> None:
        """Before a drafter's first measured request is folded in: the tokens per round its race rate implies
        (the race rated it at its curves' seconds for its drafts a round), worth RACE_EVIDENCE rounds. A race
        on the wall clock (no curves) says nothing this exact about tokens per round: nothing is seeded."""
        cand = self._candidates[name]
        curves = self._curves.get(name)
        if cand.evidence > 0 or cand.accept > 0 or cand.source is None or cand.race <= 0 or curves is None:
            return
        cand.accept = cand.race * curves.round_seconds(round(drafted))
        cand.drafted = drafted
        cand.evidence = RACE_EVIDENCE

    def _fold(self, name: str, observed: float) -> None:
        cand = self._candidates[name]
        cand.rate = observed if cand.rate <= 0 else cand.rate + self._alpha * (observed - cand.rate)

    def select(self, prompt: Sequence[int], sampling: SamplingParams | None = None) -> Selection:
        return self.select_with(prompt, sampling, None)

    def select_with(self, prompt: Sequence[int], sampling: SamplingParams | None, lane: _Lane | None) -> Selection:
        """`select` for one batched request (`lane`: its own sources, policy wrapper and hold; None: `select`)."""
        seeded = sampling is not None and sampling.seeded
        if seeded:
            start = self._winner
            priors = {n: c.race for n, c in self._candidates.items()}
            accept: dict[str, float] = {}
            costs = CostBook(self._seed_seconds, frozen=True)
        else:
            priors = self.priors()
            start = self.current
            accept = {n: c.accept for n, c in self._candidates.items()}
            costs = self.costs
        switched = None
        if start != self._last:
            switched = SourceSwitched(
                old=self._last,
                new=start,
                reason=f"between requests: {start} estimated at {priors[start]:.1f} tok/s",
            )
        self._last = start
        if not self._in_request or len(self._candidates) < 2:
            policy = self._fresh_policy(start)
            if policy is not None and lane is not None and lane.policy is not None and not seeded:
                policy = lane.policy(policy)
            return self._selection(start, policy, switched, None, lane)
        sources = lane.sources if lane is not None else self.sources()
        # Sources whose rounds can be replayed on the committed tokens (lookup) are forecast, never run to learn.
        shadows: dict[str, ShadowLookup] = {}
        for n, src in sources.items():
            replay = getattr(src, "shadow", None)
            if callable(replay):
                shadows[n] = replay()
        arbiter = ForecastArbiter(
            list(self._candidates),
            start=start,
            priors=priors,
            acceptance=accept,
            plain=self.plain,
            shadowed=shadows,
            costs=costs,
            config=self._config,
        )
        switcher = _RequestSwitcher(self, arbiter, shadows, sampling=sampling, lane=lane)
        return switcher.selection(start, switched)

    def finished(self, selection: Selection, usage: Usage) -> None:
        if isinstance(selection.switcher, _RequestSwitcher):
            selection.switcher.close()
            self._last = usage.source
        elif usage.decode_s > 0 and usage.generated_tokens > 1:
            self._fold(selection.name, (usage.generated_tokens - 1) / usage.decode_s)


class _AutoCap:
    """A candidate's cap policy inside one auto request.

    It drafts at least `floor` whenever its source runs (a paused MeasuredCap would otherwise run plain
    rounds under the source's name, without plain decoding's pipelining: in auto a pause moves the
    request instead) and tells the switcher when the policy has just decided to pause.
    """

    def __init__(self, inner: CapPolicy, floor: int) -> None:
        self.inner = inner
        self._floor = floor
        self.paused = False

    def cap(self, depth: int) -> int:
        cap = self.inner.cap(depth)
        if getattr(self.inner, "planned", False):  # a cap the batch's plan chose stands, 0 included
            return cap
        return cap if cap > 0 else self._floor

    def observe(
        self, drafted: int, accepted: int, seconds: float, depth: int, cap: int | None = None
    ) -> CapDecision | None:
        decision = self.inner.observe(drafted, accepted, seconds, depth, cap)
        self.paused = decision is not None and decision.new == 0
        return decision


class _RequestSwitcher:
    """One request's SourceSwitcher: feeds each round (and lookup's replayed ones) to the arbiter and
    hands the request over."""

    def __init__(
        self,
        owner: AutoSelector,
        arbiter: ForecastArbiter,
        shadows: Mapping[str, ShadowLookup],
        *,
        sampling: SamplingParams | None,
        lane: _Lane | None = None,
    ) -> None:
        self._owner = owner
        self.arbiter = arbiter
        self._shadows = dict(shadows)
        self._sampling = sampling
        self._seeded = sampling is not None and sampling.seeded
        self._lane = lane
        self._closed = False
        self._caps: dict[str, _AutoCap] = {}

    def _cap(self, name: str) -> _AutoCap | None:
        cand = self._owner._candidates[name]
        if cand.source is None:
            return None
        if name not in self._caps:
            inner = self._owner._factories[name]()  # fresh per request, as fixed modes get
            if self._lane is not None and self._lane.policy is not None and not self._seeded:
                inner = self._lane.policy(inner)
            inner = repeatable(inner, self._sampling)  # a seeded request's policy learns modelled seconds
            self._caps[name] = _AutoCap(inner, min(PROBE_CAP, cand.source.max_block))
        return self._caps[name]

    def selection(self, name: str, switched: SourceSwitched | None) -> Selection:
        return self._owner._selection(name, self._cap(name), switched, self, self._lane)

    def after_round(
        self,
        name: str,
        committed: int,
        seconds: float,
        *,
        drafted: int = 0,
        depth: int = 0,
        history: Sequence[int] = (),
    ) -> Selection | None:
        if self._lane is not None and self._lane.hold is not None and not self._seeded and self._lane.hold():
            return None
        if self._seeded:
            seconds = self.arbiter.costs.seconds(name, drafted)
        cap = self._caps.get(name)
        paused = cap is not None and cap.paused
        if cap is not None:
            cap.paused = False
        self.arbiter.record(name, committed, seconds, drafted)
        if history:
            for shadowed, shadow in self._shadows.items():
                for tokens, drafts in shadow.advance(history, start=len(history) - committed):
                    self.arbiter.shadow(shadowed, tokens, drafts)
        move = self.arbiter.decide(paused=paused)
        if move is None:
            return None
        return self.selection(move.new, SourceSwitched(old=move.old, new=move.new, reason=move.reason))

    def close(self) -> None:
        """Carry what this request measured into the selector (once; not from a seeded request, whose
        seconds are modelled)."""
        if self._closed:
            return
        self._closed = True
        owner = self._owner
        if self._seeded:
            return
        measured = self.arbiter.measured()
        for name, rate in measured.items():
            owner._fold(name, rate)
        seen = self.arbiter.acceptance()
        for name, (_, drafted, _) in seen.items():
            owner._seed_acceptance(name, drafted)
        # How this prompt went for the drafters that ran on it, against their priors (lookup's replay says
        # how repetitive the text is, not how predictable: it does not count).
        ran = {n: v for n, v in seen.items() if n not in self.arbiter.shadowed}
        ratios = [
            tokens / owner._candidates[n].accept
            for n, (tokens, _, _) in ran.items()
            if tokens > 0 and owner._candidates[n].accept > 0
        ]
        for name, (tokens, drafted, rounds) in seen.items():
            # Weighed by rounds: a three-round look on a hard opening moves a prior a little, a whole answer
            # much (a per-request weight let the H200's first request, DSpark's 3 rounds at 1.2 tokens on a
            # hard opening, set its prior for good: auto then ran DFlash where fixed DSpark was 1.4x faster).
            cand = owner._candidates[name]
            w = rounds / (cand.evidence + rounds)
            cand.accept += w * (tokens - cand.accept)
            cand.drafted += w * (drafted - cand.drafted)
            cand.evidence = min(cand.evidence + rounds, MAX_EVIDENCE)
        if ratios:
            # A drafter that did not run here moves as the ones that did: else a drafter looked at only on
            # chat would keep a chat-sized prior against one measured only on code, and never run on code.
            factor = statistics.geometric_mean(ratios)
            rounds = sum(r for _, _, r in ran.values())
            for name, cand in owner._candidates.items():
                if name not in seen and cand.source is not None and cand.accept > 0:
                    w = rounds / (cand.evidence + rounds)
                    cand.accept += w * (cand.accept * factor - cand.accept)


@attrs.frozen
class _Lane:
    """One batched request's view: its own sources, its policy wrapper and its hold (see `lane_view`)."""

    sources: Mapping[str, DraftSource | None]
    policy: Callable[[CapPolicy], CapPolicy] | None = None
    hold: Callable[[], bool] | None = None


class LaneAutoSelector:
    """`--mode auto` for one request of a batch: the owner's rule and learned state over the lane's own view."""

    def __init__(self, owner: AutoSelector, lane: _Lane) -> None:
        self.owner = owner
        self._lane = lane

    @property
    def mode(self) -> str:
        return self.owner.mode

    def select(self, prompt: Sequence[int], sampling: SamplingParams | None = None) -> Selection:
        return self.owner.select_with(prompt, sampling, self._lane)

    def finished(self, selection: Selection, usage: Usage) -> None:
        self.owner.finished(selection, usage)


@attrs.frozen(kw_only=True)
class AutoChoice:
    """What `--mode auto` runs.

    Attributes:
        mode: the race winner's name ("dspark", "dflash", "lookup", or the plain one, e.g. "baseline").
        selector: what to give the GenerationService: an AutoSelector when online switching is on and
            there is more than one candidate, else a FixedSelector over the winner.
        rates: measured decode tokens/s per candidate (the race).
        curves: calibrated cost curves per candidate.
        from_cache: whether the race result came from the calibration store.
    """

    mode: str
    selector: SourceSelector
    rates: Mapping[str, float]
    curves: Mapping[str, CostCurves]
    from_cache: bool


def race_key(model: LoadedModel, candidates: Mapping[str, DraftSource | None], bits: int | None) -> CalibrationKey:
    """The store key of a race: the target plus every candidate's identity."""
    names = ",".join(sorted(f"{name}={drafter_identity(name, src)}" for name, src in candidates.items()))
    # "race2": rated on the calibrated curves (a race stored before timed the wall clock).
    return CalibrationKey(target=model.identity, drafter=f"race2:{names}", drafter_bits=bits)


def measure_and_choose(
    store: CalibrationStore,
    model: LoadedModel,
    candidates: Mapping[str, DraftSource | None],
    clock: Clock,
    *,
    drafter_bits: int | None = None,
    max_draft: int | None = None,
    force: bool = False,
    online: bool = True,
    race_tokens: int = 24,
    race_prompts: Sequence[Sequence[int]] | None = None,
    plan: CalibrationPlan | None = None,
    progress: Progress | None = None,
) -> AutoChoice:
    """Pick the fastest draft source for `model` by measurement (cached in the store).

    Args:
        store: the calibration store.
        model: the loaded target.
        candidates: mode name → loaded draft source; a name mapped to None (e.g. "baseline") is plain decoding.
        clock: monotonic time.
        drafter_bits: drafter quantization, part of the cache key.
        max_draft: the parsed `--max-draft` (None = auto).
        force: re-measure curves and re-run the race (`mlx-dspark calibrate`).
        online: an AutoSelector over the candidates that may switch between requests.
        race_tokens: tokens generated per race prompt.
        race_prompts: token ids to race on (default: three built-in prompts, one per class).
        plan: calibration effort.
        progress: status-line callback.

    Returns:
        The choice; its `selector` goes straight into GenerationService.
    """
    cands = dict(candidates)
    if not cands:
        cands = {"baseline": None}
    curves = curves_for(
        store,
        model,
        cands,
        clock,
        drafter_bits=drafter_bits,
        force=force,
        plan=plan or CalibrationPlan(),
        progress=progress,
    )
    policies = {
        name: cap_policy_factory(max_draft, curves.get(name), src.max_block if src is not None else 0)
        for name, src in cands.items()
    }
    key = race_key(model, cands, drafter_bits)
    stored = None if force else store.load(key)
    from_cache = stored is not None and stored.chosen in cands and set(stored.race) >= set(cands)
    if from_cache and stored is not None:
        rates = {name: stored.race[name] for name in cands}
    else:
        prompts = [list(p) for p in race_prompts] if race_prompts else race_prompt_ids(model)
        rates = race(model, cands, policies, clock, prompts, max_tokens=race_tokens, progress=progress, curves=curves)
    # On a tie plain decoding wins: it needs no drafter memory.
    winner = max(cands, key=lambda n: (rates.get(n, 0.0), cands[n] is None))
    if not from_cache:
        clean = {n: (r if math.isfinite(r) else 0.0) for n, r in rates.items()}
        store.save(key, Calibration(race=clean, chosen=winner, created=time.time()))
    selector: SourceSelector
    if online and len(cands) > 1:
        selector = AutoSelector(cands, policies, rates, curves=curves)
    else:
        selector = FixedSelector(winner, cands[winner], policies[winner] if cands[winner] is not None else None)
    return AutoChoice(mode=winner, selector=selector, rates=rates, curves=curves, from_cache=from_cache)


def measured_cap_factory(
    store: CalibrationStore,
    clock: Clock,
    model: LoadedModel,
    mode: str,
    source: DraftSource | None,
    *,
    max_draft: int | None = None,
    drafter_bits: int | None = None,
    progress: Progress | None = None,
) -> CapPolicyFactory | None:
    """The cap-policy factory of a fixed mode: `--max-draft N` → FixedCap, auto → MeasuredCap on cached curves.

    Measures the curves (a few seconds, once per machine/model/drafter/MLX version) when not stored.
    Returns None for plain decoding.
    """
    if source is None:
        return None
    if max_draft is not None:
        return cap_policy_factory(max_draft, None, source.max_block)
    curves = curves_for(store, model, {mode: source}, clock, drafter_bits=drafter_bits, progress=progress)
    return cap_policy_factory(None, curves[mode], source.max_block)
