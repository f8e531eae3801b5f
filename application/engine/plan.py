"""The batch's speculation plan: per width, whether rows draft and at which cap, from the calibrated curves.

While two or more rows share the batch, this plan sets the cap of every row whose policy adapts
(`--max-draft auto`; 0 means plain batched steps, lossless), since a row's round is then one shared tick and
its solo cost model would misread it. A fixed `--max-draft N` is obeyed at every width, and a seeded row keeps
its own (modelled) caps, so its sampled output stays its solo one. The rule itself is the domain's
(`domain/costmodel/batch.py`); this module keeps its state: the pooled acceptance, probes while speculation is
off, the observed ÷ predicted tick corrections, what drafting rows together costs. Each decision that changes
the width or the cap is a `BatchSpeculation` event.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import attrs

from mlx_dspark.domain.costmodel.acceptance import DecayedAcceptance
from mlx_dspark.domain.costmodel.batch import BatchDraftCost, BatchPlan, TickCorrection, batch_tick_seconds, plan_batch
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.costmodel.draft_cap import CapDecision, CapPolicy, FixedCap
from mlx_dspark.domain.events import BatchSpeculation
from mlx_dspark.domain.ports import TelemetrySink

_EXPLORE_EVERY = 16  # while speculating, one plain tick in this many (with observed forwards)
_PROBE_CAP = 2  # drafts per row on a probe tick while the batch decodes plainly
_PROBE_BACKOFF_MAX = 16  # the wait between probes grows to at most this many times `probe_every`
TELEMETRY_ID = "batch"  # the request id of the batch's own events (they belong to no request)


class Gate:
    """The plan's cap for the next round of every adaptive row; None: each row's own policy decides (a lone
    row, or no calibrated curves)."""

    def __init__(self) -> None:
        self.cap: int | None = None


@attrs.define
class GatedCap:
    """A row's adaptive cap policy, overruled by the batch's plan while the batch decides."""

    inner: CapPolicy
    gate: Gate
    max_cap: int
    planned: bool = False  # whether the batch's plan chose this row's last cap

    def cap(self, depth: int) -> int:
        self.planned = self.gate.cap is not None
        if self.gate.cap is None:
            return self.inner.cap(depth)
        return min(self.gate.cap, self.max_cap)

    def observe(
        self, drafted: int, accepted: int, seconds: float, depth: int, cap: int | None = None
    ) -> CapDecision | None:
        # A batched round's seconds are a shared tick's (every row's drafts, one wide forward): they say nothing
        # about this row's solo round, so the row's own model learns only from its solo rounds. The gate may
        # have changed since the round's cap was chosen (the batch shrank to one): what counts is who chose it.
        if self.planned:
            return None
        return self.inner.observe(drafted, accepted, seconds, depth, cap)


class WidthPlan:
    """The plan's state over the engine's life.

    Args:
        telemetry: receives the BatchSpeculation decisions.
        curves: the calibrated cost curves (default: those of the first adaptive cap policy gated; without
            curves every row keeps its own cap policy).
        probe_every: while speculation is off, one tick in this many lets rows draft again, so the pooled
            acceptance stays current; each probe that leaves it off doubles the wait (up to
            `_PROBE_BACKOFF_MAX` times), since at high width a probe tick costs several plain ones.
        observed: ticks are timed (the engine's clock): the plan corrects the model by what ticks of each
            (width, cap) really take, and explores one plain tick in a while.
    """

    def __init__(
        self,
        telemetry: TelemetrySink,
        *,
        curves: CostCurves | None = None,
        probe_every: int = 16,
        observed: bool = False,
    ) -> None:
        self._telemetry = telemetry
        self.gate = Gate()
        self.curves = curves
        self._max_cap = 0
        self.acceptance = DecayedAcceptance()  # every row's drafts pooled (re-sized to the cap)
        self._probe_every = probe_every
        self._probe_wait = probe_every  # off ticks until the next probe (grows while probes say "off")
        self._probed = False  # whether the tick just decided was a probe
        self._observed = observed
        self.correction = TickCorrection()  # observed ÷ predicted ticks, by width and cap
        self.draft_cost = BatchDraftCost()  # what drafting rows together costs, by width
        self._off_ticks = 0
        self._on_ticks = 0
        self._announced: tuple[int, int] | None = None  # the last reported (width, cap)
        # The latest decisions that changed the width or the cap, in order (also emitted as telemetry).
        self.decisions: collections.deque[BatchPlan] = collections.deque(maxlen=256)

    def gated(self, inner: CapPolicy) -> CapPolicy:
        """A row's adaptive cap policy under the plan (its curves become the plan's); a fixed one as is."""
        if isinstance(inner, FixedCap):  # --max-draft N: obeyed at every width
            return inner
        curves = getattr(inner, "curves", None)
        if self.curves is None and isinstance(curves, CostCurves):
            self.curves = curves
        max_cap = int(getattr(inner, "max_cap", 1))
        self._max_cap = max(self._max_cap, max_cap)
        return GatedCap(inner, self.gate, max_cap)

    @property
    def deciding(self) -> bool:
        """Whether the plan sets the rows' caps now (rows then hold their sources: a tick is no source's own)."""
        return self.gate.cap is not None

    def record(self, drafted: int, accepted: int) -> None:
        """One row's round: `drafted` tokens offered, `accepted` kept."""
        self.acceptance.record(drafted, accepted)

    def drafting(self, greedy: int, width: int, together: bool) -> float | None:
        """A tick's drafting in one-row drafts when `greedy` of its `width` rows draft together (None: one each)."""
        if greedy < 2 or not together:
            return None
        return self.draft_cost.rows(greedy) + (width - greedy)

    def tick(self, width: int, cap: int, depth: int, seconds: float, draft_rows: float | None) -> None:
        """A whole tick (every row's draft, the forward, every job's own work) against the model's uncorrected
        tick: what the next decisions rescale by."""
        if self.curves is None:
            return
        predicted = batch_tick_seconds(self.curves, width, cap, depth, draft_rows=draft_rows)
        self.correction.record(width, cap, seconds, predicted)

    def decide(self, width: int, depth: int, draft_rows: float | None) -> None:
        """Set the cap of the next round of `width` rows (the gate)."""
        if self.curves is None or self._max_cap < 1:
            if self._announced is None and self._max_cap:
                self._announce(
                    BatchPlan(width=width, cap=self._max_cap, plain_tok_s=0.0, speculative_tok_s=0.0), "uncalibrated"
                )
            self.gate.cap = None
            return
        if self.acceptance.positions < self._max_cap:
            self.acceptance = DecayedAcceptance(positions=self._max_cap)
        if width <= 1:  # alone, the row's own cap policy decides (it runs the same cost model)
            self.gate.cap = None
            return
        plan = plan_batch(
            self.curves,
            # One standard error below the pooled estimate: at widths where speculation wins by a few percent
            # at best, an estimate from a handful of noisy ticks must not switch it on.
            self.acceptance.lower(),
            width,
            self._max_cap,
            depth=depth,
            correction=self.correction if self._observed else None,
            draft_rows=draft_rows,
            cap_acceptance=self.acceptance.estimate(),
        )
        if (width, plan.cap) != self._announced:
            self._announce(plan, "calibrated")
        if plan.speculate:
            self._off_ticks = 0
            self._on_ticks += 1
            self._probe_wait = self._probe_every
            self._probed = False
            # Observing forwards: one plain tick in a while keeps the plain forward's own cost measured.
            explore = self._observed and self._on_ticks % _EXPLORE_EVERY == 0
            self.gate.cap = 0 if explore else plan.cap
            return
        if self._probed:  # the probe's rounds are in and speculation stays off: wait longer for the next
            self._probe_wait = min(self._probe_wait * 2, self._probe_every * _PROBE_BACKOFF_MAX)
        self._off_ticks += 1
        probe = self._probe_every > 0 and self._off_ticks >= self._probe_wait
        if probe:
            self._off_ticks = 0
        self._probed = probe
        # A probe tick measures acceptance (and a drafting forward's cost); it is not a decision.
        self.gate.cap = min(_PROBE_CAP, self._max_cap) if probe else 0

    def _announce(self, plan: BatchPlan, reason: str) -> None:
        self._announced = (plan.width, plan.cap)
        self.decisions.append(plan)
        event = BatchSpeculation(
            width=plan.width,
            speculate=plan.speculate,
            cap=plan.cap,
            plain_tok_s=plan.plain_tok_s,
            speculative_tok_s=plan.speculative_tok_s,
            reason=reason,
        )
        self._telemetry.emit(TELEMETRY_ID, event)


GatedFactory = Callable[[CapPolicy], CapPolicy]
