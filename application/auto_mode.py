"""Use case: `--mode auto` picks the draft source for a (target, drafter) pair by measurement.

A short race on built-in prompts decides at first use (stored with the calibration); online, a
switching source keeps per-source observed throughput and moves to another source between requests
when it is measurably faster. Every source is verified by the target, so any choice is lossless.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from mlx_dspark.application.calibration import CalibrationPlan, Progress, curves_for, drafter_identity
from mlx_dspark.application.data import load_prompts
from mlx_dspark.application.decode_loop import decode
from mlx_dspark.application.ports import CalibrationStore, LoadedModel
from mlx_dspark.domain.costmodel.calibration import Calibration, CalibrationKey
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.costmodel.draft_cap import CapDecision, CapPolicy, FixedCap, MeasuredCap
from mlx_dspark.domain.drafting.block import EMPTY_BLOCK, DraftBlock, DraftContext
from mlx_dspark.domain.events import Finished
from mlx_dspark.domain.ports import Clock, DraftSource
from mlx_dspark.domain.tokens import SamplingParams, StopRule

if TYPE_CHECKING:
    from mlx_dspark.application.bootstrap import Services

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
    policy: CapPolicy
    rate: float  # EWMA of observed decode tokens/s, seeded from the race


class SwitchingDraftSource:
    """A draft source that delegates to one candidate per request and may switch between requests.

    Per candidate it keeps an EWMA of observed throughput (seeded with the race result). At each new
    request it takes the best one; a candidate not measured for `explore_every` requests runs once so a
    stale estimate can recover. Switching only at request boundaries keeps feature-reading drafters whole.
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
    ) -> None:
        if not candidates:
            raise ValueError("no candidates")
        self._candidates = {
            name: _Candidate(
                source=src,
                policy=policies[name]() if src is not None else FixedCap(0),
                rate=float(rates.get(name, 0.0)),
            )
            for name, src in candidates.items()
        }
        self._explore_every = explore_every
        self._alpha = alpha
        self._margin = margin
        self.current = max(self._candidates, key=lambda n: self._candidates[n].rate)
        self._requests = 0
        self._seen = dict.fromkeys(self._candidates, 0)  # request index of each candidate's last measurement
        self._tokens = 0
        self._seconds = 0.0
        self._switch: str | None = None

    @property
    def name(self) -> str:
        return "auto"

    @property
    def max_block(self) -> int:
        return max((c.source.max_block for c in self._candidates.values() if c.source is not None), default=0)

    @property
    def uses_features(self) -> bool:
        return any(c.source is not None and c.source.uses_features for c in self._candidates.values())

    def rates(self) -> dict[str, float]:
        """Current throughput estimates per candidate."""
        return {name: c.rate for name, c in self._candidates.items()}

    def _fold(self) -> None:
        if self._seconds > 0 and self._tokens > 0:
            cand = self._candidates[self.current]
            observed = self._tokens / self._seconds
            cand.rate = observed if cand.rate <= 0 else cand.rate + self._alpha * (observed - cand.rate)
        self._tokens, self._seconds = 0, 0.0

    def begin(self, prompt: Sequence[int]) -> None:
        self._fold()
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
        if chosen != self.current:
            self._switch = (
                f"{why}: source {self.current} → {chosen} "
                f"(estimated {cands[chosen].rate:.1f} vs {cands[self.current].rate:.1f} tok/s)"
            )
            self.current = chosen
        src = cands[self.current].source
        if src is not None:
            src.begin(prompt)

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        src = self._candidates[self.current].source
        if src is None or cap <= 0:
            return EMPTY_BLOCK
        if not src.uses_features and ctx.features is not None:
            ctx = attrs.evolve(ctx, features=None)
        cap = min(cap, src.max_block)
        return src.propose(ctx, cap, sampling, uniforms[:cap])

    # -- the cap-policy side, called through SwitchingCap --------------------------------------------------

    def cap(self, depth: int) -> int:
        return self._candidates[self.current].policy.cap(depth)

    def observe(self, drafted: int, accepted: int, seconds: float, depth: int) -> CapDecision | None:
        self._tokens += accepted + 1
        self._seconds += seconds
        cand = self._candidates[self.current]
        decision = cand.policy.observe(drafted, accepted, seconds, depth)
        if self._switch is not None:
            reason, self._switch = self._switch, None
            cap = cand.policy.cap(depth) if decision is None else decision.new
            old = decision.old if decision is not None else cap
            extra = f"; {decision.reason}" if decision is not None else ""
            return CapDecision(old=old, new=cap, reason=reason + extra)
        return decision


@attrs.define
class SwitchingCap:
    """The per-request cap policy of a SwitchingDraftSource (its state lives in the source)."""

    source: SwitchingDraftSource

    def cap(self, depth: int) -> int:
        return self.source.cap(depth)

    def observe(self, drafted: int, accepted: int, seconds: float, depth: int) -> CapDecision | None:
        return self.source.observe(drafted, accepted, seconds, depth)


@attrs.frozen(kw_only=True)
class AutoChoice:
    """What `--mode auto` runs.

    Attributes:
        mode: the winning candidate's name ("dspark", "dflash", "lookup", or the plain one, e.g. "baseline").
        source: the draft source to give the GenerationService (a SwitchingDraftSource when online switching is
            on and there is more than one candidate), or None for plain decoding.
        cap_policy_factory: the per-request cap policy factory (None = plain decoding).
        rates: measured decode tokens/s per candidate (the race).
        curves: calibrated cost curves per candidate.
        from_cache: whether the race result came from the calibration store.
    """

    mode: str
    source: DraftSource | None
    cap_policy_factory: CapPolicyFactory | None
    rates: Mapping[str, float]
    curves: Mapping[str, CostCurves]
    from_cache: bool


def race_key(model: LoadedModel, candidates: Mapping[str, DraftSource | None], bits: int | None) -> CalibrationKey:
    """The store key of a race: the target plus every candidate's identity."""
    names = ",".join(sorted(f"{name}={drafter_identity(name, src)}" for name, src in candidates.items()))
    return CalibrationKey(target=model.identity, drafter=f"race:{names}", drafter_bits=bits)


def choose_source(
    services: Services, model: LoadedModel, candidates: Mapping[str, DraftSource | None], **options: Any
) -> AutoChoice:
    """`measure_and_choose` with the store and clock of `services` (what `application/modes.py` calls)."""
    return measure_and_choose(services.calibration, model, candidates, services.clock, **options)


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
        store: the calibration store (`services.calibration`).
        model: the loaded target.
        candidates: mode name → loaded draft source; a name mapped to None (e.g. "baseline") is plain decoding.
        clock: monotonic time (`services.clock`).
        drafter_bits: drafter quantization, part of the cache key.
        max_draft: the parsed `--max-draft` (None = auto).
        force: re-measure curves and re-run the race (`mlx-dspark calibrate`).
        online: wrap the candidates in a SwitchingDraftSource that may switch between requests.
        race_tokens: tokens generated per race prompt.
        race_prompts: token ids to race on (default: three built-in prompts, one per class).
        plan: calibration effort.
        progress: status-line callback.

    Returns:
        The choice; `source` and `cap_policy_factory` go straight into GenerationService.
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
    if online and len(cands) > 1:
        switching = SwitchingDraftSource(cands, policies, rates)
        return AutoChoice(
            mode=winner,
            source=switching,
            cap_policy_factory=lambda: SwitchingCap(switching),
            rates=rates,
            curves=curves,
            from_cache=from_cache,
        )
    source = cands[winner]
    return AutoChoice(
        mode=winner,
        source=source,
        cap_policy_factory=policies[winner] if source is not None else None,
        rates=rates,
        curves=curves,
        from_cache=from_cache,
    )


def measured_cap_factory(
    services: Services,
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
    curves = curves_for(
        services.calibration, model, {mode: source}, services.clock, drafter_bits=drafter_bits, progress=progress
    )
    return cap_policy_factory(None, curves[mode], source.max_block)
