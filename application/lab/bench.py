"""Use case: `mlx-dspark bench` — warm runs of each mode on a fixed prompt set, the baseline measured in
the same run, a lossless check against it, and the report (data and its JSON document; the CLI renders
the table and the plot). With reference decoders (`--against mlx-lm`, `--against mlx-lm-draft`: mlx-lm's
plain decoding, its draft-model speculation at each draft length) each runs right after ours on every
prompt and each mode gets the paired ratio ours / reference against every one, headlined against the
fastest; `run_prefill_bench` times prefill alone at given lengths, ours against the reference.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from mlx_dspark.application.calibration import Progress, curves_for
from mlx_dspark.application.data import PromptSet
from mlx_dspark.application.generation import (
    GenerationRequest,
    GenerationResult,
    GenerationService,
    MonotonicClock,
)
from mlx_dspark.application.ports import CalibrationStore, LoadedModel, ReferenceDecoder, ReferenceRun
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.costmodel.prefill import prefill_bound_tok_s
from mlx_dspark.domain.drafting.selection import PLAIN, FixedSelector
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.ports import Clock, DraftSource, ForwardCostProbe
from mlx_dspark.domain.tokens import SamplingParams

BENCH_SCHEMA = "mlx-dspark/bench/5"  # 4: auto per class vs plain and the best fixed mode; 5: several references
BASELINE = PLAIN
AUTO = "auto"


class BenchRunner(Protocol):
    """What the bench needs of a mode: its model and a way to run one request (a GenerationService)."""

    @property
    def model(self) -> LoadedModel: ...

    def generate(self, request: GenerationRequest) -> GenerationResult: ...

    def encode_prompt(self, request: GenerationRequest) -> list[int]: ...


@attrs.frozen(kw_only=True)
class BenchRun:
    """One timed request."""

    mode: str
    prompt_id: str
    cls: str
    trial: int
    decode_tok_s: float
    e2e_tok_s: float
    ttft_s: float
    mean_accepted: float
    generated_tokens: int
    token_ids: tuple[int, ...]
    source: str = BASELINE  # the source that ran at the end of the request (auto may switch)
    prompt_tokens: int = 0
    prefill_tok_s: float = 0.0  # prompt tokens prefilled (none cached) ÷ time to the first token
    source_switches: int = 0  # auto: in-request moves between sources
    source_rounds: Mapping[str, int] = attrs.field(factory=dict)  # auto: rounds each source ran


@attrs.frozen(kw_only=True)
class ReferenceRatios:
    """One mode against one reference: medians over prompts and trials of ours ÷ the reference's, paired on
    the same prompt and trial (None where nothing pairs)."""

    decode: float | None
    prefill: float | None
    per_class: Mapping[str, float | None] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class ModeSummary:
    """Medians of one mode over every prompt and trial.

    Attributes:
        speedup: median decode tok/s ÷ the baseline's, both measured in this run (None without a baseline).
        lossless: every prompt's token ids equal the baseline's (None unless greedy with a baseline).
        mismatched: prompt ids whose output differs from the baseline's.
        per_class: median decode tok/s per prompt class.
        per_class_speedup: per class, median decode tok/s ÷ the baseline's on the same class.
        sources: how many runs ended on each draft source (auto's choices; one entry for a fixed mode).
        prefill_tok_s: median prefill tok/s.
        decode_vs_reference: median over prompts and trials of this mode's decode tok/s ÷ the headline
            reference's (the report's `reference`) on the same prompt and trial (None without a reference).
        prefill_vs_reference: the same ratio of prefill tok/s.
        per_class_vs_reference: decode_vs_reference per prompt class.
        first_divergence: per mismatched prompt, the index of the first token that differs from the baseline.
        vs_references: the paired ratios against every reference, by its name.
    """

    mode: str
    runs: int
    decode_tok_s: float
    e2e_tok_s: float
    ttft_s: float
    mean_accepted: float
    speedup: float | None
    lossless: bool | None
    mismatched: tuple[str, ...]
    per_class: Mapping[str, float]
    per_class_speedup: Mapping[str, float | None] = attrs.field(factory=dict)
    sources: Mapping[str, int] = attrs.field(factory=dict)
    prefill_tok_s: float = 0.0
    decode_vs_reference: float | None = None
    prefill_vs_reference: float | None = None
    per_class_vs_reference: Mapping[str, float | None] = attrs.field(factory=dict)
    first_divergence: Mapping[str, int] = attrs.field(factory=dict)
    vs_references: Mapping[str, ReferenceRatios] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class AutoVerdict:
    """Auto against plain decoding and against the best fixed mode on one prompt class (issue 11's
    protocol: per class, auto's median decode tok/s ÷ plain's and ÷ the best fixed mode's, same run).

    Attributes:
        cls: the prompt class.
        auto_tok_s, plain_tok_s: median decode tok/s on the class.
        best_mode: the fixed mode (plain decoding included) with the highest median on the class.
        best_tok_s: its median.
        vs_plain, vs_best: auto's median ÷ plain's, ÷ the best fixed mode's.
        switches: median in-request source switches of auto's runs on the class.
        rounds: auto's rounds on the class per source, summed.
    """

    cls: str
    auto_tok_s: float
    plain_tok_s: float
    best_mode: str
    best_tok_s: float
    vs_plain: float | None
    vs_best: float | None
    switches: float
    rounds: Mapping[str, int]


@attrs.frozen(kw_only=True)
class PrefillPoint:
    """Prefill alone at one prompt length (synthetic ids, cold cache, prefix cache off).

    Attributes:
        tokens: prompt length.
        ours_tok_s: median of ours.
        reference_tok_s: median of the reference's (None without one).
        ratio: median over trials of ours ÷ the reference's, paired per trial.
        same_first_token: both produced the same first (greedy) token in every trial.
        ours_s: our prefill seconds per trial; reference_s the reference's.
        bound_tok_s: the GEMM-bound limit at this length (the target's GEMM work at its best GEMM rate
            timed just before), None where the target cannot count it.
        of_bound: ours_tok_s ÷ bound_tok_s.
    """

    tokens: int
    ours_tok_s: float
    reference_tok_s: float | None
    ratio: float | None
    same_first_token: bool | None
    ours_s: tuple[float, ...]
    reference_s: tuple[float, ...] = ()
    bound_tok_s: float | None = None
    of_bound: float | None = None


@attrs.frozen(kw_only=True)
class BenchReport:
    """Everything the table, the JSON and the plot show."""

    model: str
    model_identity: str
    prompt_set: PromptSet
    trials: int
    max_tokens: int
    temperature: float
    modes: tuple[ModeSummary, ...]
    runs: tuple[BenchRun, ...]
    curves: Mapping[str, CostCurves] = attrs.field(factory=dict)
    environment: Mapping[str, Any] = attrs.field(factory=dict)
    # The headline reference (the fastest of `references` by median decode tok/s); each reference's runs are
    # the mode of its name.
    reference: str | None = None
    prefill: tuple[PrefillPoint, ...] = ()
    auto: tuple[AutoVerdict, ...] = ()  # per class, when auto ran beside plain decoding
    references: tuple[str, ...] = ()


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _prefill_rate(prompt_tokens: int, cached: int, prefill_s: float) -> float:
    return (prompt_tokens - cached) / prefill_s if prefill_s > 0 else 0.0


def run_bench(
    runners: Mapping[str, BenchRunner],
    prompts: PromptSet,
    *,
    trials: int = 3,
    max_tokens: int = 200,
    temperature: float = 0.0,
    seed: int = 0,
    warmup_tokens: int = 8,
    curves: Mapping[str, CostCurves] | None = None,
    environment: Mapping[str, Any] | None = None,
    progress: Callable[[str, float], None] | None = None,
    references: Sequence[ReferenceDecoder] = (),
    clock: Clock | None = None,
) -> BenchReport:
    """Run every mode on every prompt `trials` times and summarize.

    Each mode gets one untimed warm-up request; then, per trial and prompt, every mode runs back to back
    (the baseline first, the references right after it), so slow drift of the machine hits all alike.
    Every timed request starts from an empty target cache, so no run reuses another's prompt rows.

    Args:
        runners: mode name → GenerationService (or anything with `model`, `generate` and `encode_prompt`).
        prompts: the prompt set.
        trials: runs per prompt per mode (medians are over all of them).
        max_tokens: tokens per request.
        temperature: 0 = greedy (enables the lossless check).
        seed: sampling seed (the same for every mode).
        warmup_tokens: tokens of the warm-up request.
        curves: cost curves to include in the report (JSON and plot).
        environment: device/MLX facts to include in the report.
        progress: status-line callback (message, fraction done).
        references: other implementations' greedy decoding on the same model (need temperature 0), each
            reported as the mode of its name with every mode's paired ratio against it; the fastest one
            is the report's headline `reference`.
        clock: times the references (default: a monotonic clock).
    """
    if trials < 1:
        raise ValueError("trials must be >= 1")
    if references and temperature != 0:
        raise InvalidRequest(message="a reference decoder runs greedy only: use --temperature 0", param="against")
    ref_names = [r.name for r in references]
    taken = [n for n in ref_names if n in runners]
    if taken or len(set(ref_names)) != len(ref_names):
        raise ValueError(f"reference names must be distinct from each other and from the modes: {ref_names}")
    order = sorted(runners, key=lambda m: m != BASELINE)
    ref_clock = clock or MonotonicClock()
    sampling = SamplingParams(temperature=temperature, seed=seed)
    total = (len(order) + len(references)) * len(prompts.prompts) * trials
    done = 0
    runs: list[BenchRun] = []
    first = prompts.prompts[0]
    for mode in order:
        runners[mode].model.target.reset(0)
        runners[mode].generate(
            GenerationRequest(prompt=first.prompt, max_tokens=warmup_tokens, sampling=sampling, prefix_cache=False)
        )
    lead = runners[order[0]] if order else None
    if lead is not None:
        for reference in references:
            ids = lead.encode_prompt(GenerationRequest(prompt=first.prompt))
            reference.generate(
                lead.model, ids, max_tokens=warmup_tokens, eos_ids=lead.model.tokenizer.eos_ids, clock=ref_clock
            )

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(label, done / max(total, 1))

    for trial in range(trials):
        for p in prompts.prompts:
            request = GenerationRequest(prompt=p.prompt, max_tokens=max_tokens, sampling=sampling, prefix_cache=False)
            for mode in order:
                runner = runners[mode]
                # A cold prompt on a warm model: the same work for every mode and trial.
                runner.model.target.reset(0)
                r = runner.generate(request)
                runs.append(
                    BenchRun(
                        mode=mode,
                        prompt_id=p.id,
                        cls=p.cls,
                        trial=trial,
                        decode_tok_s=r.tokens_per_second,
                        e2e_tok_s=r.end_to_end_tokens_per_second,
                        ttft_s=r.time_to_first_token_s,
                        mean_accepted=r.mean_accepted,
                        generated_tokens=r.generated_tokens,
                        token_ids=r.token_ids,
                        source=r.source,
                        prompt_tokens=r.prompt_tokens,
                        prefill_tok_s=_prefill_rate(r.prompt_tokens, r.cached_prompt_tokens, r.prefill_s),
                        source_switches=r.source_switches,
                        source_rounds=dict(r.source_rounds),
                    )
                )
                tick(f"{mode} {p.id} trial {trial + 1}/{trials}")
                for reference in references if mode == order[0] else ():
                    runs.append(_reference_run(reference, runner, request, p.id, p.cls, trial, ref_clock))
                    tick(f"{reference.name} {p.id} trial {trial + 1}/{trials}")
    model = next(iter(runners.values())).model if runners else None
    ref_modes = ref_names if order else []
    modes = [*order[:1], *ref_modes, *order[1:]]
    headline = fastest(runs, ref_modes)
    fixed = [m for m in order if m != AUTO]
    return BenchReport(
        model=model.name if model else "",
        model_identity=model.identity if model else "",
        prompt_set=prompts,
        trials=trials,
        max_tokens=max_tokens,
        temperature=temperature,
        modes=summarize(runs, modes, greedy=sampling.greedy, references=ref_modes, headline=headline),
        runs=tuple(runs),
        curves=dict(curves or {}),
        environment=dict(environment or {}),
        reference=headline,
        references=tuple(ref_modes),
        auto=auto_verdicts(runs, fixed),
    )


def auto_verdicts(runs: Sequence[BenchRun], fixed: Sequence[str]) -> tuple[AutoVerdict, ...]:
    """Per class: auto's median decode tok/s against plain decoding's and the best fixed mode's (among
    `fixed`, plain included), all from the same run; empty unless auto and plain decoding both ran."""
    auto = [r for r in runs if r.mode == AUTO]
    if not auto or not any(r.mode == BASELINE for r in runs):
        return ()
    out = []
    for cls in sorted({r.cls for r in auto}):
        med = {m: _median([r.decode_tok_s for r in runs if r.mode == m and r.cls == cls]) for m in fixed}
        mine = _median([r.decode_tok_s for r in auto if r.cls == cls])
        best = max(med, key=lambda m: (med[m], m == BASELINE))
        rounds: Counter[str] = Counter()
        for r in auto:
            if r.cls == cls:
                rounds.update(r.source_rounds)
        out.append(
            AutoVerdict(
                cls=cls,
                auto_tok_s=mine,
                plain_tok_s=med[BASELINE],
                best_mode=best,
                best_tok_s=med[best],
                vs_plain=mine / med[BASELINE] if med[BASELINE] > 0 else None,
                vs_best=mine / med[best] if med[best] > 0 else None,
                switches=_median([float(r.source_switches) for r in auto if r.cls == cls]),
                rounds=dict(sorted(rounds.items())),
            )
        )
    return tuple(out)


def _reference_run(
    reference: ReferenceDecoder,
    runner: BenchRunner,
    request: GenerationRequest,
    prompt_id: str,
    cls: str,
    trial: int,
    clock: Clock,
) -> BenchRun:
    """The reference on the very prompt ids ours decoded (chat template and all), same budget and EOS."""
    model = runner.model
    ids = runner.encode_prompt(request)
    got: ReferenceRun = reference.generate(
        model, ids, max_tokens=request.max_tokens, eos_ids=model.tokenizer.eos_ids, clock=clock
    )
    n = len(got.token_ids)
    return BenchRun(
        mode=reference.name,
        prompt_id=prompt_id,
        cls=cls,
        trial=trial,
        decode_tok_s=got.tokens_per_second,
        e2e_tok_s=n / max(got.prefill_s + got.decode_s, 1e-9),
        ttft_s=got.prefill_s,
        # Tokens per target forward: a plain reference makes one a step, a speculative one reports its rounds.
        mean_accepted=n / got.rounds if got.rounds else (1.0 if n > 1 else 0.0),
        generated_tokens=n,
        token_ids=got.token_ids,
        source=reference.name,
        prompt_tokens=len(ids),
        prefill_tok_s=_prefill_rate(len(ids), 0, got.prefill_s),
    )


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The index of the first differing token (the shorter length if one is a prefix), None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _paired(
    runs: Sequence[BenchRun], ref: Mapping[tuple[str, int], BenchRun], rate: Callable[[BenchRun], float]
) -> list[float]:
    out = []
    for r in runs:
        other = ref.get((r.prompt_id, r.trial))
        if other is not None and rate(other) > 0:
            out.append(rate(r) / rate(other))
    return out


def _decode_ratio(runs: Sequence[BenchRun], ref: Mapping[tuple[str, int], BenchRun]) -> float | None:
    ratios = _paired(runs, ref, lambda r: r.decode_tok_s)
    return _median(ratios) if ratios else None


def fastest(runs: Sequence[BenchRun], modes: Sequence[str]) -> str | None:
    """The mode among `modes` with the highest median decode tok/s (the first on a tie), None if none ran."""
    rates = {m: _median([r.decode_tok_s for r in runs if r.mode == m]) for m in modes}
    return max(rates, key=lambda m: rates[m]) if rates else None


def _ratios(rs: Sequence[BenchRun], ref_runs: Mapping[tuple[str, int], BenchRun]) -> ReferenceRatios:
    prefill = _paired(rs, ref_runs, lambda r: r.prefill_tok_s)
    classes = sorted({r.cls for r in rs})
    return ReferenceRatios(
        decode=_decode_ratio(rs, ref_runs),
        prefill=_median(prefill) if prefill else None,
        per_class={c: _decode_ratio([r for r in rs if r.cls == c], ref_runs) for c in classes},
    )


def summarize(
    runs: Sequence[BenchRun],
    order: Sequence[str],
    *,
    greedy: bool,
    references: Sequence[str] = (),
    headline: str | None = None,
) -> tuple[ModeSummary, ...]:
    """Per-mode medians, speedups against the baseline, ratios against each reference (the `headline` one,
    default the fastest, in the flat fields) and lossless verdicts."""
    by_mode = {m: [r for r in runs if r.mode == m] for m in order}
    base = by_mode.get(BASELINE, [])
    base_rate = _median([r.decode_tok_s for r in base])
    base_class = {c: _median([r.decode_tok_s for r in base if r.cls == c]) for c in {r.cls for r in base}}
    reference_ids = {r.prompt_id: r.token_ids for r in base if r.trial == 0}
    headline = headline if headline is not None else fastest(runs, references)
    ref_runs = {
        name: {(r.prompt_id, r.trial): r for r in runs if r.mode == name} for name in references if name in by_mode
    }
    out = []
    for mode in order:
        rs = by_mode[mode]
        rate = _median([r.decode_tok_s for r in rs])
        lossless: bool | None = None
        mismatched: tuple[str, ...] = ()
        divergence: dict[str, int] = {}
        if greedy and reference_ids:
            for r in rs:
                expected = reference_ids.get(r.prompt_id, r.token_ids)
                at = first_divergence(expected, r.token_ids)
                if at is not None:
                    divergence[r.prompt_id] = min(at, divergence.get(r.prompt_id, at))
            mismatched = tuple(sorted(divergence))
            lossless = not mismatched
        classes = sorted({r.cls for r in rs})
        per_class = {c: _median([r.decode_tok_s for r in rs if r.cls == c]) for c in classes}
        against = {name: _ratios(rs, paired) for name, paired in ref_runs.items()}
        top = against.get(headline or "")
        out.append(
            ModeSummary(
                mode=mode,
                runs=len(rs),
                decode_tok_s=rate,
                e2e_tok_s=_median([r.e2e_tok_s for r in rs]),
                ttft_s=_median([r.ttft_s for r in rs]),
                mean_accepted=_median([r.mean_accepted for r in rs]),
                speedup=(rate / base_rate) if base and base_rate > 0 else None,
                lossless=lossless,
                mismatched=mismatched,
                per_class=per_class,
                per_class_speedup={
                    c: (per_class[c] / base_class[c]) if base_class.get(c, 0.0) > 0 else None for c in classes
                },
                sources=dict(sorted(Counter(r.source for r in rs).items())),
                prefill_tok_s=_median([r.prefill_tok_s for r in rs]),
                decode_vs_reference=top.decode if top else None,
                prefill_vs_reference=top.prefill if top else None,
                per_class_vs_reference=dict(top.per_class) if top else {},
                first_divergence=dict(sorted(divergence.items())),
                vs_references=against,
            )
        )
    return tuple(out)


def synthetic_prompt(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """`length` well-mixed token ids (an LCG over the vocabulary, above the low special ids where it is large)."""
    low = 256 if vocab_size > 1024 else 0
    state = 0x9E3779B9 + seed
    out = []
    for _ in range(length):
        state = (state * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        out.append(low + (state >> 33) % (vocab_size - low))
    return out


def run_prefill_bench(
    runner: BenchRunner,
    lengths: Sequence[int],
    *,
    reference: ReferenceDecoder | None = None,
    trials: int = 3,
    clock: Clock | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> tuple[PrefillPoint, ...]:
    """Prefill alone at each length: synthetic ids, a cold cache, no prefix cache; ours then the reference
    (with its default prefill step) on the same ids, alternating per trial.

    Ours is the whole request path up to the first token (`GenerationResult.prefill_s`), one token asked.
    A length at or past the context window is cut to fit (the point reports the length really run).
    """
    if trials < 1:
        raise ValueError("trials must be >= 1")
    model = runner.model
    ref_clock = clock or MonotonicClock()
    eos = model.tokenizer.eos_ids
    fit = [min(int(n), model.context_window - 1) for n in lengths]
    if not fit or min(fit) < 1:
        raise InvalidRequest(message=f"prefill lengths must be positive, got {list(lengths)}", param="prefill_lengths")

    def ours(ids: list[int]) -> tuple[float, tuple[int, ...]]:
        model.target.reset(0)
        r = runner.generate(GenerationRequest(prompt=ids, max_tokens=1, prefix_cache=False))
        return r.prefill_s, r.token_ids

    def theirs(ids: list[int]) -> tuple[float, tuple[int, ...]]:
        assert reference is not None
        got = reference.generate(model, ids, max_tokens=1, eos_ids=eos, clock=ref_clock)
        return got.prefill_s, got.token_ids

    warm = synthetic_prompt(min(64, model.context_window - 1), model.target.vocab_size, seed=99)
    ours(warm)
    if reference is not None:
        theirs(warm)
    probe = model.target if isinstance(model.target, ForwardCostProbe) else None
    cost = probe.forward_cost() if probe else None
    points = []
    total, done = len(fit) * trials, 0
    for n in fit:
        ids = synthetic_prompt(n, model.target.vocab_size, seed=n)
        # The GEMM rate is timed before each length: a busy machine between lengths shows in its own limit.
        bound = prefill_bound_tok_s(n, cost, probe.gemm_flops_per_s()) if probe and cost else None
        mine: list[float] = []
        other: list[float] = []
        same = True
        for trial in range(trials):
            a_s, a_ids = ours(ids)
            mine.append(a_s)
            if reference is not None:
                b_s, b_ids = theirs(ids)
                other.append(b_s)
                same = same and a_ids == b_ids
            done += 1
            if progress is not None:
                progress(f"prefill {n} tokens trial {trial + 1}/{trials}", done / total)
        ours_rate = n / _median(mine) if _median(mine) > 0 else 0.0
        ratios = [b / a for a, b in zip(mine, other) if a > 0 and b > 0]
        points.append(
            PrefillPoint(
                tokens=n,
                ours_tok_s=ours_rate,
                reference_tok_s=(n / _median(other) if _median(other) > 0 else 0.0) if other else None,
                ratio=_median(ratios) if ratios else None,
                same_first_token=same if reference is not None else None,
                ours_s=tuple(mine),
                reference_s=tuple(other),
                bound_tok_s=bound,
                of_bound=ours_rate / bound if bound else None,
            )
        )
    model.target.reset(0)
    return tuple(points)


def prefill_json(points: Sequence[PrefillPoint], reference: str | None) -> dict[str, Any]:
    """The `--prefill-lengths --json` document's points."""
    return {
        "reference": reference,
        "points": [
            {
                "tokens": p.tokens,
                "prefill_tok_s": p.ours_tok_s,
                "reference_prefill_tok_s": p.reference_tok_s,
                "prefill_vs_reference": p.ratio,
                "same_first_token": p.same_first_token,
                "ours_s": list(p.ours_s),
                "reference_s": list(p.reference_s),
                "gemm_bound_tok_s": p.bound_tok_s,
                "prefill_vs_gemm_bound": p.of_bound,
            }
            for p in points
        ],
    }


def curves_json(curves: CostCurves) -> dict[str, Any]:
    """A cost curve as JSON (widths/caps as string keys, seconds as numbers)."""
    return {
        "verify_s": {str(k): v for k, v in sorted(curves.verify_s.items())},
        "draft_s": {str(k): v for k, v in sorted(curves.draft_s.items())},
        "slope_s_per_token": curves.slope_s_per_token,
        "overhead_s": curves.overhead_s,
    }


def report_json(report: BenchReport, *, include_runs: bool = True) -> dict[str, Any]:
    """The `--json` document (schema BENCH_SCHEMA)."""
    doc: dict[str, Any] = {
        "schema": BENCH_SCHEMA,
        "model": report.model,
        "model_identity": report.model_identity,
        "prompt_set": {
            "name": report.prompt_set.name,
            "version": report.prompt_set.version,
            "count": len(report.prompt_set.prompts),
            "classes": sorted({p.cls for p in report.prompt_set.prompts}),
        },
        "settings": {"trials": report.trials, "max_tokens": report.max_tokens, "temperature": report.temperature},
        "environment": dict(report.environment),
        "baseline": BASELINE if any(m.mode == BASELINE for m in report.modes) else None,
        "reference": report.reference,
        "references": list(report.references),
        "modes": [
            {
                "mode": m.mode,
                "runs": m.runs,
                "decode_tok_s": m.decode_tok_s,
                "e2e_tok_s": m.e2e_tok_s,
                "ttft_s": m.ttft_s,
                "mean_accepted": m.mean_accepted,
                "speedup": m.speedup,
                "lossless": m.lossless,
                "mismatched_prompts": list(m.mismatched),
                "per_class_decode_tok_s": dict(m.per_class),
                "per_class_speedup": dict(m.per_class_speedup),
                "sources": dict(m.sources),
                "prefill_tok_s": m.prefill_tok_s,
                "decode_vs_reference": m.decode_vs_reference,
                "prefill_vs_reference": m.prefill_vs_reference,
                "per_class_decode_vs_reference": dict(m.per_class_vs_reference),
                "first_divergence": dict(m.first_divergence),
                "vs_references": {
                    name: {
                        "decode": v.decode,
                        "prefill": v.prefill,
                        "per_class_decode": dict(v.per_class),
                    }
                    for name, v in m.vs_references.items()
                },
            }
            for m in report.modes
        ],
        "curves": {name: curves_json(c) for name, c in report.curves.items()},
        "auto_per_class": [
            {
                "class": v.cls,
                "auto_decode_tok_s": v.auto_tok_s,
                "plain_decode_tok_s": v.plain_tok_s,
                "best_fixed_mode": v.best_mode,
                "best_fixed_decode_tok_s": v.best_tok_s,
                "auto_vs_plain": v.vs_plain,
                "auto_vs_best_fixed": v.vs_best,
                "median_source_switches": v.switches,
                "rounds_per_source": dict(v.rounds),
            }
            for v in report.auto
        ],
    }
    if include_runs:
        doc["runs"] = [
            {
                "mode": r.mode,
                "prompt_id": r.prompt_id,
                "class": r.cls,
                "trial": r.trial,
                "decode_tok_s": r.decode_tok_s,
                "e2e_tok_s": r.e2e_tok_s,
                "ttft_s": r.ttft_s,
                "mean_accepted": r.mean_accepted,
                "generated_tokens": r.generated_tokens,
                "source": r.source,
                "prompt_tokens": r.prompt_tokens,
                "prefill_tok_s": r.prefill_tok_s,
                "source_switches": r.source_switches,
                "source_rounds": dict(r.source_rounds),
            }
            for r in report.runs
        ]
    if report.prefill:
        doc["prefill"] = prefill_json(report.prefill, report.reference)
    return doc


def runner_curves(
    store: CalibrationStore,
    clock: Clock,
    model: LoadedModel,
    runners: Mapping[str, GenerationService],
    *,
    drafter_bits: int | None = None,
    progress: Progress | None = None,
) -> dict[str, CostCurves]:
    """The calibrated cost curves of every fixed speculative mode among `runners` (for the JSON and the plot)."""
    sources: dict[str, DraftSource | None] = {
        mode: g.selector.source
        for mode, g in runners.items()
        if isinstance(g.selector, FixedSelector) and g.selector.source is not None
    }
    if not sources:
        return {}
    return curves_for(store, model, sources, clock, drafter_bits=drafter_bits, progress=progress)
