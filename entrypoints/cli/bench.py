"""`mlx-dspark bench`: every mode on the fixed prompt set, baseline measured in the same run; a table,
`--json`, or a PNG plot (`--plot`, needs the optional `plot` extra). `--against mlx-lm` adds mlx-lm's own
plain decoding on the same prompts and model, `--against mlx-lm-draft` its draft-model speculation (one row
per `--num-draft`); `--prefill-lengths` times prefill alone instead."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from mlx_dspark.entrypoints.cli.common import add_model_args, run_guarded, start_with_model
from mlx_dspark.entrypoints.cli.progress import ProgressBar

if TYPE_CHECKING:
    from mlx_dspark.application.ports import LoadedModel, ReferenceDecoder
    from mlx_dspark.application.services import Services


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-dspark bench",
        description="Measure decode speed of each mode against plain decoding, on the same prompts, in one run.",
    )
    add_model_args(p, mode=False)
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated, any of baseline,lookup,dflash,dspark,draft,auto (default: baseline, available "
        "drafters, auto)",
    )
    p.add_argument(
        "--prompts",
        default="chat,code,math",
        help="classes of the built-in set, heldout[:classes] (the drafters' held-out prompts), or a JSONL/text file",
    )
    p.add_argument("--per-class", type=int, default=None, metavar="N", help="only the first N prompts of each class")
    p.add_argument(
        "--trials",
        type=int,
        default=3,
        help="runs per prompt per mode (medians over all); with --concurrency, paired runs of every mode per level",
    )
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (enables the lossless check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also write a PNG of tok/s per mode and the cost curves")
    p.add_argument(
        "--concurrency",
        metavar="N,N,...",
        help="instead: aggregate decode tok/s of N requests batched together (e.g. 1,2,4,8), plain decoding and"
        " each of --modes (baseline,lookup,dflash,dspark,draft) at every N, paired against plain decoding",
    )
    p.add_argument(
        "--against",
        metavar="mlx-lm|mlx-lm-draft[,...]",
        help="also run mlx-lm on the same model and prompts (greedy), paired per prompt: its generate_step "
        "(mlx-lm) and/or its draft-model speculation, speculative_generate_step (mlx-lm-draft)",
    )
    p.add_argument(
        "--num-draft",
        metavar="N,N,...",
        help="mlx-lm-draft's draft tokens per round, each its own row mlx-lm-draft@N (default 2,4,8); the "
        "fastest is the headline reference",
    )
    p.add_argument(
        "--prefill-lengths",
        metavar="N,N,...",
        help="instead: prefill tok/s alone at these prompt lengths (e.g. 1024,4096,8192), ours vs mlx-lm",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar, only the report")
    return p


def _levels(spec: str, flag: str = "--concurrency", example: str = "1,2,4,8") -> list[int]:
    from mlx_dspark.domain.errors import InvalidRequest

    try:
        levels = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise InvalidRequest(message=f"{flag} takes positive integers like {example}; got {spec!r}")
    return levels


def _prefill(args: argparse.Namespace, bar: ProgressBar) -> int:
    from mlx_dspark.application import bootstrap
    from mlx_dspark.application.lab.bench import BENCH_SCHEMA, prefill_json, run_prefill_bench
    from mlx_dspark.application.modes import build_generator
    from mlx_dspark.entrypoints.cli.bench_render import render_prefill

    lengths = _levels(args.prefill_lengths, "--prefill-lengths", "1024,4096,8192")
    settings, services, model = start_with_model(args, bar.note)
    generator = build_generator(services, settings, model=model, mode="baseline")
    reference = bootstrap.reference_decoder()
    points = run_prefill_bench(
        generator, lengths, reference=reference, trials=args.trials, clock=services.clock, progress=bar.update
    )
    bar.close()
    if args.json:
        doc = {
            "schema": BENCH_SCHEMA,
            "model": model.name,
            "model_identity": model.identity,
            "trials": args.trials,
            "environment": bootstrap.runtime().report(),
            "prefill": prefill_json(points, reference.name),
        }
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        sys.stdout.write(render_prefill(model.name, points, reference.name))
    return 0


def _concurrency(args: argparse.Namespace, bar: ProgressBar) -> int:
    from mlx_dspark.application import bootstrap
    from mlx_dspark.application.data import interleaved, load_prompts
    from mlx_dspark.application.engine import forkable, speculates
    from mlx_dspark.application.lab.bench_concurrency import render_concurrency, run_concurrency_modes
    from mlx_dspark.application.modes import bench_runners
    from mlx_dspark.domain.errors import InvalidRequest

    levels = _levels(args.concurrency)
    # N concurrent requests take the first N prompts: mixed classes, not N of the first class.
    prompts = [p.prompt for p in interleaved(load_prompts(args.prompts)).prompts]
    settings, services, model = start_with_model(args, bar.note)
    rows = bootstrap.rows_factory()
    if rows(model.target, False) is None:
        raise InvalidRequest(message="this target's caches have no batched form (quantized KV or nested caches)")
    requested = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else ["baseline"]
    runners = bench_runners(services, settings, model, requested, bar.note, bar.update)
    unbatched = [
        mode
        for mode, gen in runners.items()
        if not forkable(gen) or rows(model.target, speculates(gen)) is None
    ]
    if unbatched:
        speculative = rows(model.target, True) is not None
        what = "plain, speculative and auto modes" if speculative else "plain decoding on this target"
        raise InvalidRequest(
            message=f"--concurrency batches {what}; {', '.join(unbatched)} runs one request at a time",
            param="modes",
        )
    points = run_concurrency_modes(
        runners,
        rows,
        prompts,
        services.clock,
        levels=levels,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        trials=args.trials,
        progress=bar.update,
    )
    bar.close()
    if args.json:
        sys.stdout.write(json.dumps([attrs.asdict(p) for p in points], indent=1) + "\n")
    else:
        sys.stdout.write(render_concurrency(points))
    return 0 if all(p.lossless for p in points) else 3


def _reference_specs(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """`--against` kinds and `--num-draft` counts, checked before any model loads."""
    from mlx_dspark.application.lab.references import DRAFT_REFERENCE, num_draft_values, reference_kinds
    from mlx_dspark.domain.errors import InvalidRequest

    kinds = reference_kinds(args.against) if args.against else []
    if kinds and args.temperature != 0:
        raise InvalidRequest(message="--against runs greedy only: use --temperature 0", param="against")
    if DRAFT_REFERENCE not in kinds:
        if args.num_draft:
            raise InvalidRequest(message=f"--num-draft goes with --against {DRAFT_REFERENCE}")
        return kinds, []
    return kinds, num_draft_values(args.num_draft)


def _references(
    kinds: Sequence[str], counts: Sequence[int], draft_spec: str | None, services: Services, model: LoadedModel,
    bar: ProgressBar,
) -> list[ReferenceDecoder]:  # fmt: skip
    """The reference decoders `--against` names: mlx-lm's plain decoding, then mlx-lm-draft at each count."""
    from mlx_dspark.application import bootstrap
    from mlx_dspark.application.lab.references import DRAFT_REFERENCE, load_draft_model

    out = [bootstrap.reference_decoder()] if "mlx-lm" in kinds else []
    if DRAFT_REFERENCE in kinds:
        bar.note(f"loading the draft model for {DRAFT_REFERENCE}")
        draft = load_draft_model(services.loader, model, draft_spec)
        bar.note(f"{DRAFT_REFERENCE}: {draft.name} drafts for {model.name}, {','.join(map(str, counts))} a round")
        out.extend(bootstrap.draft_reference_decoder(draft, n) for n in counts)
    return out


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    bar = ProgressBar(quiet=args.quiet)

    def body() -> int:
        if args.concurrency:
            return _concurrency(args, bar)
        if args.prefill_lengths:
            return _prefill(args, bar)
        from mlx_dspark.application import bootstrap
        from mlx_dspark.application.data import load_prompts, per_class
        from mlx_dspark.application.lab.bench import report_json, run_bench, runner_curves
        from mlx_dspark.application.modes import bench_runners
        from mlx_dspark.entrypoints.cli.bench_render import PlotUnavailable, plot_report, render_table

        prompts = load_prompts(args.prompts)
        if args.per_class is not None:
            prompts = per_class(prompts, args.per_class)
        kinds, counts = _reference_specs(args)
        settings, services, model = start_with_model(args, bar.note)
        references = _references(kinds, counts, args.draft_model, services, model, bar)  # before any calibration
        requested = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else None
        runners = bench_runners(services, settings, model, requested, bar.note, bar.update)
        curves = {}
        if args.json or args.plot:
            curves = runner_curves(
                services.calibration,
                services.clock,
                model,
                runners,
                drafter_bits=settings.model.drafter_bits,
                progress=bar.update,
            )
        report = run_bench(
            runners,
            prompts,
            trials=args.trials,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            curves=curves,
            environment=bootstrap.runtime().report() if args.json else {},
            progress=bar.update,
            references=references,
            clock=services.clock,
        )
        bar.close()
        if args.json:
            sys.stdout.write(json.dumps(report_json(report), indent=1) + "\n")
        else:
            sys.stdout.write(render_table(report))
        if args.plot:
            try:
                plot_report(report, args.plot)
            except PlotUnavailable as exc:
                bar.warn(str(exc))
                return 1
            bar.note(f"wrote {args.plot}")
        for ref in (m for m in report.modes if m.mode in report.references and m.lossless is False):
            # Not ours to fail on: a reference that rounds differently may flip a near-tied argmax.
            where = ", ".join(f"{p} at token {i}" for p, i in ref.first_divergence.items())
            bar.warn(f"{ref.mode} greedy output differs from our plain decoding: {where}")
        bad_modes = [m.mode for m in report.modes if m.lossless is False and m.mode not in report.references]
        if bad_modes:
            bar.warn(f"LOSSLESS CHECK FAILED for {', '.join(bad_modes)} (token ids differ from baseline)")
            return 3
        return 0

    try:
        return run_guarded(body)
    finally:
        bar.close()
