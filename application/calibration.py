"""Use case: measure this machine's cost curves through the ports (verify per width, drafter per cap,
context slope, round overhead) and cache them in the calibration store.

Timed blocks always come from realistic text (the built-in prompts through the model's tokenizer): a
repeated token id flatters MoE verify, whose cost depends on how many experts the tokens route to.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

import attrs

from mlx_dspark.application.data import sample_text
from mlx_dspark.application.engine import decode
from mlx_dspark.application.ports import CalibrationStore, LoadedModel, Tokenizer
from mlx_dspark.domain.costmodel.calibration import Calibration, CalibrationKey
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.events import Finished, RoundFinished
from mlx_dspark.domain.ports import Clock, DraftSource, StoppingDraftSource, TargetModel
from mlx_dspark.domain.tokens import SamplingParams, StopRule

Progress = Callable[[str, float], None]
"""Called with a short status line and the fraction done (0..1); the CLI renders it."""

GREEDY = SamplingParams()
K = TypeVar("K", bound=Hashable)
MIN_DISTINCT = 8  # a stream with fewer distinct ids is not realistic traffic


@attrs.frozen(kw_only=True)
class CalibrationPlan:
    """How much to measure; the defaults take a few seconds on the default model on CPU.

    Attributes:
        depth: context rows in the cache while timing.
        deep_depth: the second depth for the per-context-token slope.
        warmup: untimed calls before each measured series (shape compilation, caches).
        repeats: timed calls per point; the median is kept.
        overhead_tokens: tokens of plain decoding used to measure round overhead.
        dense_widths: every width up to this is measured; above it, every 4th and the last.
    """

    depth: int = 64
    deep_depth: int = 320
    warmup: int = 1
    repeats: int = 3
    overhead_tokens: int = 8
    dense_widths: int = 12


@attrs.frozen(kw_only=True)
class VerifyProfile:
    """Target-only measurements shared by every draft source of one target.

    Attributes:
        verify_s: seconds per verify of each width, normalized to context depth 0.
        slope_s_per_token: extra verify seconds per context token.
        overhead_s: host seconds per round outside draft and verify.
    """

    verify_s: Mapping[int, float]
    slope_s_per_token: float
    overhead_s: float


def realistic_stream(tokenizer: Tokenizer | None, vocab_size: int, length: int) -> list[int]:
    """At least `length` varied token ids: the built-in text through the tokenizer, padded if short.

    Args:
        tokenizer: the model's tokenizer, or None.
        vocab_size: ids must be below this.
        length: how many ids are needed.

    Returns:
        Token ids with at least MIN_DISTINCT distinct values (never one repeated id).
    """
    text = sample_text()
    ids: list[int] = []
    if tokenizer is not None:
        ids = [t for t in tokenizer.encode(text, add_special_tokens=False) if 0 <= t < vocab_size]
    if len(set(ids)) < min(MIN_DISTINCT, vocab_size):
        ids = []  # a degenerate encoding is no better than none
    # Pad (or replace) with a deterministic, well-mixed walk over the vocabulary.
    state = 0x9E3779B9
    while len(ids) < length:
        state = (state * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        ids.append((state >> 33) % vocab_size)
    return ids


def measured_widths(max_width: int, dense: int = 12) -> list[int]:
    """Widths to time: all up to `dense`, then every 4th, and always `max_width` (interpolated between)."""
    widths = list(range(1, min(max_width, dense) + 1))
    widths += list(range(dense + 4, max_width, 4))
    if max_width not in widths:
        widths.append(max_width)
    return sorted(set(widths))


def _interleaved_medians(
    clock: Clock,
    calls: Mapping[K, Callable[[int], None]],
    warmup: int,
    repeats: int,
    steps: _Steps,
    label: Callable[[K], str],
    *,
    weight: float = 1.0,
) -> dict[K, float]:
    """The median seconds of each call, its repeats taken in turns (all keys once, then all again).

    Timing one width's repeats back to back lets a passing load on a shared host land on that width alone:
    a 1.5B calibration once timed its 1-row verify at 0.170 s against 0.252 s in every other run, and the
    cap policy, seeing drafts that looked dear beside so cheap a step, paused speculation. In turns, a load
    spike costs every width one sample and the medians drop it. `weight`: the progress steps a key is worth.
    """
    share = weight / max(warmup + repeats, 1)  # of one progress step per key
    samples: dict[K, list[float]] = {k: [] for k in calls}
    for i in range(warmup + repeats):
        for key, fn in calls.items():
            t0 = clock.now()
            fn(i)
            if i >= warmup:
                samples[key].append(clock.now() - t0)
            steps.tick(label(key), share)
    return {k: float(statistics.median(v)) if v else 0.0 for k, v in samples.items()}


class _Steps:
    """Counts timed steps for the progress line (a step may be done in parts: `weight`)."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.done, self.progress = max(total, 1), 0.0, progress

    def tick(self, label: str, weight: float = 1.0) -> None:
        self.done += weight
        if self.progress is not None:
            self.progress(label, min(self.done / self.total, 1.0))


def _verify_at(target: TargetModel, stream: Sequence[int], depth: int, width: int, offset: int) -> None:
    # Anchor = the token after the cached rows; drafts = the text that follows, shifted per repeat so
    # no two timed blocks are the same.
    anchor = stream[depth]
    block = DraftBlock(tokens=tuple(stream[depth + 1 + offset : depth + offset + width]), source="calibration")
    target.verify(anchor, block, GREEDY, [0.5] * width)
    target.commit(0)


def _verify_call(target: TargetModel, stream: Sequence[int], depth: int, width: int) -> Callable[[int], None]:
    return functools.partial(_verify_at, target, stream, depth, width)


@attrs.frozen(kw_only=True)
class RoundCosts:
    """Where the time of real decode-loop rounds goes (means per round).

    Attributes:
        source: the draft source's name, or "none" for plain decoding.
        rounds: rounds measured.
        round_s: wall seconds per round (the loop's decode time ÷ rounds).
        draft_s: seconds per round in the draft source's `propose` (feature hand-over included). A drafter
            that leaves its tokens queued on the device returns before they are computed: their compute
            then lands in verify_s, which waits for them.
        per_draft_s: draft_s per draft, over the rounds that drafted (the last may draft nothing).
        verify_s: seconds in the target's verify and commit (a queued draft's device time included).
        overhead_s: the rest of a round: round_s − draft_s − verify_s (host bookkeeping, events, acceptance).
        drafted: tokens drafted per round.
        committed: tokens committed per round.
    """

    source: str
    rounds: int
    round_s: float
    draft_s: float
    per_draft_s: float
    verify_s: float
    overhead_s: float
    drafted: float
    committed: float


def measure_rounds(
    target: TargetModel,
    stream: Sequence[int],
    clock: Clock,
    *,
    tokens: int,
    depth: int,
    source: DraftSource | None = None,
) -> RoundCosts:
    """Run the real decode loop (greedy, `tokens` new tokens after `depth` prompt tokens) and split its rounds.

    Args:
        target: the target; its cache is reset first.
        stream: realistic token ids (the prompt is its first `depth`).
        clock: monotonic time.
        tokens: tokens to generate (no EOS stops the run).
        depth: prompt length.
        source: the draft source (None = plain decoding); its full block every round.
    """
    rounds, drafting, draft, verify, drafted, committed, decode_s = 0, 0, 0.0, 0.0, 0, 0, 0.0
    stop = StopRule(max_tokens=max(tokens, 2), eos_ids=frozenset())
    for event in decode(target, list(stream[:depth]), GREEDY, stop, clock, source=source):
        if isinstance(event, RoundFinished):
            rounds += 1
            draft += event.draft_s
            drafting += event.drafted > 0
            verify += event.verify_s
            drafted += event.drafted
            committed += event.committed
        elif isinstance(event, Finished):
            decode_s = event.usage.decode_s
    n = max(rounds, 1)
    return RoundCosts(
        source=source.name if source is not None else "none",
        rounds=rounds,
        round_s=decode_s / n,
        draft_s=draft / n,
        per_draft_s=draft / max(drafting, 1),
        verify_s=verify / n,
        overhead_s=max(0.0, decode_s - draft - verify) / n,
        drafted=drafted / n,
        committed=committed / n,
    )


def measure_overhead(target: TargetModel, stream: Sequence[int], clock: Clock, tokens: int, depth: int) -> float:
    """Per-round host seconds outside verify and draft, from a short run of the real decode loop."""
    costs = measure_rounds(target, stream, clock, tokens=tokens, depth=depth)
    return costs.overhead_s if costs.rounds else 0.0


def measure_verify(
    target: TargetModel,
    stream: Sequence[int],
    clock: Clock,
    *,
    max_width: int,
    context_window: int,
    plan: CalibrationPlan = CalibrationPlan(),
    steps: _Steps | None = None,
) -> VerifyProfile:
    """Verify seconds per width at two context depths, normalized to depth 0, plus round overhead.

    Args:
        target: the target; its cache is reset before and after.
        stream: realistic token ids, at least deep_depth + max_width + warmup + repeats long.
        clock: monotonic time.
        max_width: the widest verify to time (the largest block + 1).
        context_window: the target's context length (depths are kept inside it).
        plan: how much to measure.
        steps: progress counter.
    """
    steps = steps or _Steps(0, None)
    spare = plan.warmup + plan.repeats + 2
    depth = max(1, min(plan.depth, context_window - max_width - spare, len(stream) - max_width - spare))
    deep = min(plan.deep_depth, context_window - max_width - spare, len(stream) - max_width - spare)
    widths = measured_widths(max_width, plan.dense_widths)

    # Plain decoding first: it warms the model up and gives the round overhead.
    overhead = measure_overhead(target, stream, clock, plan.overhead_tokens, depth)
    steps.tick("round overhead")

    edges = sorted({1, max_width})

    def deep_series() -> dict[int, float]:
        target.reset(0)
        target.prefill(list(stream[:deep]), GREEDY, 0.5)
        return _interleaved_medians(
            clock,
            {w: _verify_call(target, stream, deep, w) for w in edges},
            plan.warmup,
            plan.repeats,
            steps,
            lambda w: f"context slope (width {w})",
            weight=0.5,
        )

    # The deep points are timed twice, before and after the shallow ones, and the faster of each kept: timed
    # once, a load passing over them alone read as a slope 100x too steep (the 1.5B: 2.4e-3 s a context token
    # against 2e-5), which took half of every verify's cost off the curve and put it on the context.
    before = deep_series() if deep > depth else {}
    target.reset(0)
    target.prefill(list(stream[:depth]), GREEDY, 0.5)
    shallow = _interleaved_medians(
        clock,
        {w: _verify_call(target, stream, depth, w) for w in widths},
        plan.warmup,
        plan.repeats,
        steps,
        lambda w: f"verify width {w}/{max_width}",
    )
    slope = 0.0
    if deep > depth:
        after = deep_series()
        slopes = [(min(before[w], after[w]) - shallow[w]) / (deep - depth) for w in edges]
        slope = max(0.0, statistics.median(slopes))
    target.reset(0)
    # The curve is stored at depth 0; round_seconds adds slope × depth back. Never let a noisy slope
    # eat more than half of a measured point.
    verify_s = {w: max(s - slope * depth, s / 2) for w, s in shallow.items()}
    return VerifyProfile(verify_s=verify_s, slope_s_per_token=slope, overhead_s=overhead)


def measure_drafter(
    target: TargetModel,
    source: DraftSource,
    stream: Sequence[int],
    clock: Clock,
    *,
    max_cap: int,
    depth: int,
    plan: CalibrationPlan = CalibrationPlan(),
    steps: _Steps | None = None,
) -> dict[int, float]:
    """Seconds of one `propose` per cap (median of repeats) on a context of `depth` realistic tokens, every block
    run to its cap (a source that can stop early is measured without its stop: a random context leaves a draft
    model unsure, and its stop would make every cap cost one draft)."""
    if isinstance(source, StoppingDraftSource):
        source = source.without_stop()
    steps = steps or _Steps(0, None)
    depth = max(1, min(depth, len(stream) - 2))
    prompt = list(stream[:depth])
    target.reset(0)
    source.begin(prompt)
    target.prefill(prompt, GREEDY, 0.5)
    features = [target.take_features() if source.uses_features else None]
    history = list(stream[: depth + 1])

    def propose(cap: int, _repeat: int) -> None:
        # Target features go to the drafter once (they describe rows it has not seen yet).
        ctx = DraftContext(anchor=history[-1], position=depth, history=history, features=features[0])
        features[0] = None
        # Read the tokens: a draft may still be running on the device when propose returns.
        _ = source.propose(ctx, cap, GREEDY, [0.5] * cap).tokens

    out = _interleaved_medians(
        clock,
        {cap: functools.partial(propose, cap) for cap in measured_widths(max_cap, 12)},
        plan.warmup,
        plan.repeats,
        steps,
        lambda cap: f"drafter {source.name} cap {cap}/{max_cap}",
    )
    target.reset(0)
    return out


def calibrate_sources(
    model: LoadedModel,
    sources: Mapping[str, DraftSource | None],
    clock: Clock,
    *,
    plan: CalibrationPlan = CalibrationPlan(),
    progress: Progress | None = None,
) -> dict[str, CostCurves]:
    """Cost curves of each draft source on `model`, sharing one set of verify measurements.

    Args:
        model: the loaded target (its tokenizer supplies the realistic token stream).
        sources: mode name → draft source (None = plain decoding, curves with no drafter cost).
        clock: monotonic time.
        plan: how much to measure.
        progress: receives a status line and the fraction done.

    Returns:
        Mode name → CostCurves.
    """
    caps = {name: (src.max_block if src is not None else 0) for name, src in sources.items()}
    max_width = max([*caps.values(), 1]) + 1
    stream = realistic_stream(model.tokenizer, model.target.vocab_size, plan.deep_depth + max_width + 16)
    n_verify = 1 + len(measured_widths(max_width, plan.dense_widths)) + 2
    n_draft = sum(len(measured_widths(c, 12)) for c in caps.values() if c > 0)
    steps = _Steps(n_verify + n_draft, progress)
    profile = measure_verify(
        model.target, stream, clock, max_width=max_width, context_window=model.context_window, plan=plan, steps=steps
    )
    out: dict[str, CostCurves] = {}
    for name, src in sources.items():
        draft_s: dict[int, float] = {}
        if src is not None and caps[name] > 0:
            draft_s = measure_drafter(
                model.target, src, stream, clock, max_cap=caps[name], depth=plan.depth, plan=plan, steps=steps
            )
        out[name] = CostCurves(
            verify_s=dict(profile.verify_s),
            draft_s=draft_s,
            slope_s_per_token=profile.slope_s_per_token,
            overhead_s=profile.overhead_s,
        )
    if progress is not None:
        progress("calibrated", 1.0)
    return out


@attrs.frozen(kw_only=True)
class MachineCosts:
    """`doctor`'s measured cost lines on one loaded target.

    Attributes:
        verify_s: seconds of one verify per width (at the measurement depth).
        plain: real plain-decoding rounds (one step each).
        drafters: per draft source name, its real rounds (full block each).
    """

    verify_s: Mapping[int, float]
    plain: RoundCosts
    drafters: Mapping[str, RoundCosts]


def measure_costs(
    model: LoadedModel,
    sources: Mapping[str, DraftSource],
    clock: Clock,
    *,
    widths: Sequence[int] = (1, 2, 4, 8, 16),
    tokens: int = 12,
    depth: int = 64,
    plan: CalibrationPlan = CalibrationPlan(deep_depth=64, repeats=5),
    progress: Progress | None = None,
) -> MachineCosts:
    """Plain step cost, verify cost per width, and each source's real rounds (draft, verify, overhead).

    Each series gets one short untimed run first (first-shape compilation, caches).
    """
    target = model.target
    steps = _Steps(2 + 2 * len(sources), progress)
    stream = realistic_stream(model.tokenizer, target.vocab_size, max(depth, plan.deep_depth) + max(widths) + 16)
    profile = measure_verify(
        target, stream, clock, max_width=max(widths), context_window=model.context_window, plan=plan
    )
    steps.tick("verify cost")
    plain = measure_rounds(target, stream, clock, tokens=tokens, depth=depth)
    steps.tick("plain step")
    drafters: dict[str, RoundCosts] = {}
    for name, source in sources.items():
        measure_rounds(target, stream, clock, tokens=2, depth=depth, source=source)
        steps.tick(f"{name} warm-up")
        drafters[name] = measure_rounds(target, stream, clock, tokens=tokens, depth=depth, source=source)
        steps.tick(f"{name} rounds")
    target.reset(0)
    verify_s = {w: profile.verify_s[w] for w in widths if w in profile.verify_s}
    return MachineCosts(verify_s=verify_s, plain=plain, drafters=drafters)


def drafter_identity(kind: str, source: DraftSource | None) -> str:
    """A cache identity for a draft source: its own `identity` when the adapter has one, else kind + block."""
    if source is None:
        return "none"
    own = getattr(source, "identity", None)
    if isinstance(own, str) and own:
        return own
    return f"{kind}:{source.name}:block={source.max_block}"


def curves_for(
    store: CalibrationStore,
    model: LoadedModel,
    sources: Mapping[str, DraftSource | None],
    clock: Clock,
    *,
    drafter_bits: int | None = None,
    force: bool = False,
    plan: CalibrationPlan = CalibrationPlan(),
    progress: Progress | None = None,
) -> dict[str, CostCurves]:
    """Cached cost curves per source, measuring (all missing ones together) only when not stored.

    Args:
        store: the calibration store.
        model: the loaded target.
        sources: mode name → draft source (None = plain decoding).
        clock: monotonic time.
        drafter_bits: the drafters' quantization, part of the key.
        force: re-measure even when stored (`mlx-dspark calibrate`).
        plan: how much to measure.
        progress: status line callback.
    """
    keys = {
        name: CalibrationKey(target=model.identity, drafter=drafter_identity(name, src), drafter_bits=drafter_bits)
        for name, src in sources.items()
    }
    found: dict[str, CostCurves] = {}
    if not force:
        for name, key in keys.items():
            cal = store.load(key)
            if cal is not None and cal.curves is not None:
                found[name] = cal.curves
    missing = {name: src for name, src in sources.items() if name not in found}
    if missing:
        measured = calibrate_sources(model, missing, clock, plan=plan, progress=progress)
        for name, curves in measured.items():
            store.save(keys[name], Calibration(curves=curves, created=time.time()))
        found.update(measured)
    return {name: found[name] for name in sources}
