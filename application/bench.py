"""Use case: `mlx-dspark bench` — warm runs of each mode on a fixed prompt set, the baseline measured in
the same run, a lossless check against it, and the report (data and its JSON document; the CLI renders
the table and the plot).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from mlx_dspark.application.calibration import Progress, curves_for
from mlx_dspark.application.data import PromptSet
from mlx_dspark.application.generation import GenerationRequest, GenerationResult, GenerationService
from mlx_dspark.application.ports import CalibrationStore, LoadedModel
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.drafting.selection import PLAIN, FixedSelector
from mlx_dspark.domain.ports import Clock, DraftSource
from mlx_dspark.domain.tokens import SamplingParams

BENCH_SCHEMA = "mlx-dspark/bench/2"  # 2: per-class speedups and the sources each run ended on
BASELINE = PLAIN


class BenchRunner(Protocol):
    """What the bench needs of a mode: its model and a way to run one request (a GenerationService)."""

    @property
    def model(self) -> LoadedModel: ...

    def generate(self, request: GenerationRequest) -> GenerationResult: ...


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


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


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
) -> BenchReport:
    """Run every mode on every prompt `trials` times and summarize.

    The baseline (if present) runs first. Each mode gets one untimed warm-up request; every timed request
    starts from an empty target cache, so no run reuses another mode's (or trial's) prompt rows.

    Args:
        runners: mode name → GenerationService (or anything with `model` and `generate`).
        prompts: the prompt set.
        trials: runs per prompt per mode (medians are over all of them).
        max_tokens: tokens per request.
        temperature: 0 = greedy (enables the lossless check).
        seed: sampling seed (the same for every mode).
        warmup_tokens: tokens of the warm-up request.
        curves: cost curves to include in the report (JSON and plot).
        environment: device/MLX facts to include in the report.
        progress: status-line callback (message, fraction done).
    """
    if trials < 1:
        raise ValueError("trials must be >= 1")
    order = sorted(runners, key=lambda m: m != BASELINE)
    sampling = SamplingParams(temperature=temperature, seed=seed)
    total = len(order) * len(prompts.prompts) * trials
    done = 0
    runs: list[BenchRun] = []
    for mode in order:
        runner = runners[mode]
        first = prompts.prompts[0]
        runner.model.target.reset(0)
        runner.generate(
            GenerationRequest(prompt=first.prompt, max_tokens=warmup_tokens, sampling=sampling, prefix_cache=False)
        )
        for trial in range(trials):
            for p in prompts.prompts:
                # A cold prompt on a warm model: the same work for every mode and trial.
                runner.model.target.reset(0)
                r = runner.generate(
                    GenerationRequest(prompt=p.prompt, max_tokens=max_tokens, sampling=sampling, prefix_cache=False)
                )
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
                    )
                )
                done += 1
                if progress is not None:
                    progress(f"{mode} {p.id} trial {trial + 1}/{trials}", done / max(total, 1))
    model = next(iter(runners.values())).model if runners else None
    return BenchReport(
        model=model.name if model else "",
        model_identity=model.identity if model else "",
        prompt_set=prompts,
        trials=trials,
        max_tokens=max_tokens,
        temperature=temperature,
        modes=summarize(runs, order, greedy=sampling.greedy),
        runs=tuple(runs),
        curves=dict(curves or {}),
        environment=dict(environment or {}),
    )


def summarize(runs: Sequence[BenchRun], order: Sequence[str], *, greedy: bool) -> tuple[ModeSummary, ...]:
    """Per-mode medians, speedups against the baseline and the lossless verdicts."""
    by_mode = {m: [r for r in runs if r.mode == m] for m in order}
    base = by_mode.get(BASELINE, [])
    base_rate = _median([r.decode_tok_s for r in base])
    base_class = {c: _median([r.decode_tok_s for r in base if r.cls == c]) for c in {r.cls for r in base}}
    reference = {r.prompt_id: r.token_ids for r in base if r.trial == 0}
    out = []
    for mode in order:
        rs = by_mode[mode]
        rate = _median([r.decode_tok_s for r in rs])
        lossless: bool | None = None
        mismatched: tuple[str, ...] = ()
        if greedy and reference:
            mismatched = tuple(
                sorted({r.prompt_id for r in rs if reference.get(r.prompt_id, r.token_ids) != r.token_ids})
            )
            lossless = not mismatched
        classes = sorted({r.cls for r in rs})
        per_class = {c: _median([r.decode_tok_s for r in rs if r.cls == c]) for c in classes}
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
            )
        )
    return tuple(out)


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
            }
            for m in report.modes
        ],
        "curves": {name: curves_json(c) for name, c in report.curves.items()},
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
            }
            for r in report.runs
        ]
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
