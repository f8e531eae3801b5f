"""Use case: `--mode auto` picks the draft source for a (target, drafter) pair by measurement.

A short race on built-in prompts decides at first use (stored with the calibration); online, the
AutoSelector keeps per-source observed throughput and moves to another source when it is measurably
faster: between requests, and within one when the running source loses on the user's own prompt.
Every round is verified by the target, so any choice is lossless.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

import attrs

from mlx_dspark.application.calibration import CalibrationPlan, Progress, curves_for, drafter_identity
from mlx_dspark.application.data import load_prompts
from mlx_dspark.application.decode_loop import decode
from mlx_dspark.application.ports import CalibrationStore, LoadedModel
from mlx_dspark.domain.costmodel.calibration import Calibration, CalibrationKey
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.costmodel.draft_cap import CapPolicy, FixedCap, MeasuredCap
from mlx_dspark.domain.drafting.selection import FixedSelector, Selection, SourceSelector, SourceSwitcher
from mlx_dspark.domain.events import Finished, SourceSwitched, Usage
from mlx_dspark.domain.ports import Clock, DraftSource
from mlx_dspark.domain.tokens import SamplingParams, StopRule

CapPolicyFactory = Callable[[], CapPolicy]
RACE_PROMPTS = ("chat-03", "code-02", "math-05")


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
) -> dict[str, float]:
    """Measured decode tokens per second of each candidate on `prompts` (greedy, a short warm-up each).

    Returns:
        Mode name → decode tokens per second (0.0 when it generated nothing).
    """
    rates: dict[str, float] = {}
    stop = StopRule(max_tokens=max_tokens, eos_ids=frozenset())  # full length: equal work for every source
    total = max(len(candidates) * (len(prompts) + 1), 1)
    done = 0
    for name, source in candidates.items():
        tokens, seconds = 0, 0.0
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
            done += 1
            if progress is not None:
                progress(f"race {name}", done / total)
        rates[name] = tokens / seconds if seconds > 0 else 0.0
    model.target.reset(0)
    return rates


@attrs.define
class _Candidate:
    source: DraftSource | None
    policy: CapPolicy | None  # kept across requests, so a MeasuredCap keeps what it learned
    rate: float  # EWMA of observed decode tokens/s, seeded from the race


class AutoSelector:
    """`--mode auto` online: picks a candidate per request, and may hand over within a request.

    Per candidate it keeps an estimate of decode throughput (seeded with the race, folded as an EWMA of
    what each request observed) and one cap policy for the candidate's whole life, so a MeasuredCap keeps
    what it learned (it also pauses a losing source by itself: a paused round is a plain one).

    Between requests: the best estimate runs; a candidate not measured for `explore_every` requests runs
    once so a stale estimate can recover. Within a request: once the running candidate has `min_rounds`
    rounds on this prompt, if another candidate's estimate beats what it observes by `margin`, the
    request moves there from the next round (plain decoding included); the loser's estimate becomes what
    it observed on this prompt, so it is not chosen back on a stale number. Each switch is a
    SourceSwitched event. The target verifies every round, so no switch changes the output.
    """

    def __init__(
        self,
        candidates: Mapping[str, DraftSource | None],
        policies: Mapping[str, CapPolicyFactory],
        rates: Mapping[str, float],
        *,
        explore_every: int = 8,
        alpha: float = 0.3,
        margin: float = 0.05,
        min_rounds: int = 6,
        in_request: bool = True,
    ) -> None:
        if not candidates:
            raise ValueError("no candidates")
        self._candidates = {
            name: _Candidate(
                source=src, policy=policies[name]() if src is not None else None, rate=float(rates.get(name, 0.0))
            )
            for name, src in candidates.items()
        }
        self._explore_every = explore_every
        self._alpha = alpha
        self._margin = margin
        self._min_rounds = min_rounds
        self._in_request = in_request
        self.current = max(self._candidates, key=lambda n: self._candidates[n].rate)
        self._requests = 0
        self._seen = dict.fromkeys(self._candidates, 0)  # request index of each candidate's last measurement

    @property
    def mode(self) -> str:
        return "auto"

    def rates(self) -> dict[str, float]:
        """Current throughput estimates per candidate."""
        return {name: c.rate for name, c in self._candidates.items()}

    def _selection(self, name: str, switched: SourceSwitched | None, switcher: SourceSwitcher | None) -> Selection:
        cand = self._candidates[name]
        return Selection(name=name, source=cand.source, policy=cand.policy, switched=switched, switcher=switcher)

    def _fold(self, name: str, observed: float, alpha: float) -> None:
        cand = self._candidates[name]
        cand.rate = observed if cand.rate <= 0 else cand.rate + alpha * (observed - cand.rate)

    def _best_other(self, name: str) -> str | None:
        others = [n for n in self._candidates if n != name]
        return max(others, key=lambda n: self._candidates[n].rate) if others else None

    def select(self, prompt: Sequence[int]) -> Selection:
        self._requests += 1
        self._seen[self.current] = self._requests - 1
        cands = self._candidates
        best = max(cands, key=lambda n: cands[n].rate)
        chosen, why = self.current, ""
        if best != self.current and cands[best].rate > cands[self.current].rate * (1 + self._margin):
            chosen, why = best, "switch"
        elif self._explore_every > 0:
            # Re-measure the stalest other candidate once its estimate is `explore_every` requests old.
            stale = [n for n in cands if n != self.current and self._requests - self._seen[n] > self._explore_every]
            if stale:
                chosen, why = min(stale, key=lambda n: self._seen[n]), "explore"
        switched = None
        if chosen != self.current:
            switched = SourceSwitched(
                old=self.current,
                new=chosen,
                reason=f"{why}: estimated {cands[chosen].rate:.1f} vs {cands[self.current].rate:.1f} tok/s",
            )
            self.current = chosen
        switcher = _RequestSwitcher(self, chosen) if self._in_request else None
        return self._selection(chosen, switched, switcher)

    def finished(self, selection: Selection, usage: Usage) -> None:
        if isinstance(selection.switcher, _RequestSwitcher):
            selection.switcher.close()
        elif usage.decode_s > 0 and usage.generated_tokens > 1:
            self._fold(selection.name, (usage.generated_tokens - 1) / usage.decode_s, self._alpha)


class _RequestSwitcher:
    """One request's view of an AutoSelector: observed throughput of the running candidate on this prompt."""

    def __init__(self, owner: AutoSelector, name: str) -> None:
        self._owner = owner
        self._name = name
        self._tokens = 0
        self._seconds = 0.0
        self._rounds = 0
        self._closed = False

    def after_round(self, name: str, committed: int, seconds: float) -> Selection | None:
        owner = self._owner
        self._name = name
        self._tokens += committed
        self._seconds += seconds
        self._rounds += 1
        if self._rounds < owner._min_rounds or self._seconds <= 0:
            return None
        observed = self._tokens / self._seconds
        best = owner._best_other(name)
        if best is None or owner._candidates[best].rate <= observed * (1 + owner._margin):
            return None
        estimate = owner._candidates[best].rate
        owner._fold(name, observed, 1.0)  # measured on this prompt: it replaces the estimate
        owner.current = best
        self._name, self._tokens, self._seconds, self._rounds = best, 0, 0.0, 0
        reason = (
            f"in request: {name} runs at {observed:.1f} tok/s on this prompt, "
            f"{best} is estimated at {estimate:.1f}"
        )
        return owner._selection(best, SourceSwitched(old=name, new=best, reason=reason), self)

    def close(self) -> None:
        """Fold the last stretch of the request into its candidate's estimate (once)."""
        if self._closed:
            return
        self._closed = True
        if self._rounds and self._seconds > 0 and self._tokens > 0:
            self._owner._fold(self._name, self._tokens / self._seconds, self._owner._alpha)


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
    return CalibrationKey(target=model.identity, drafter=f"race:{names}", drafter_bits=bits)


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
        rates = race(model, cands, policies, clock, prompts, max_tokens=race_tokens, progress=progress)
    # On a tie plain decoding wins: it needs no drafter memory.
    winner = max(cands, key=lambda n: (rates.get(n, 0.0), cands[n] is None))
    if not from_cache:
        clean = {n: (r if math.isfinite(r) else 0.0) for n, r in rates.items()}
        store.save(key, Calibration(race=clean, chosen=winner, created=time.time()))
    selector: SourceSelector
    if online and len(cands) > 1:
        selector = AutoSelector(cands, policies, rates)
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
