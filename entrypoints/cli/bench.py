"""`mlx-dspark bench`: every mode on the fixed prompt set, baseline measured in the same run; a table,
`--json`, or a PNG plot (`--plot`, needs the optional `plot` extra)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from mlx_dspark.entrypoints.cli.common import add_model_args, run_guarded, start_with_model
from mlx_dspark.entrypoints.cli.progress import ProgressBar


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-dspark bench",
        description="Measure decode speed of each mode against plain decoding, on the same prompts, in one run.",
    )
    add_model_args(p, mode=False)
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated, any of baseline,lookup,dflash,dspark,auto (default: baseline, available drafters, auto)",
    )
    p.add_argument("--prompts", default="chat,code,math", help="classes of the built-in set, or a JSONL/text file")
    p.add_argument("--trials", type=int, default=3, help="runs per prompt per mode (medians over all)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (enables the lossless check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also write a PNG of tok/s per mode and the cost curves")
    p.add_argument("--quiet", action="store_true", help="no progress bar, only the report")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    bar = ProgressBar(quiet=args.quiet)

    def body() -> int:
        from mlx_dspark.application import bootstrap
        from mlx_dspark.application.bench import report_json, run_bench, runner_curves
        from mlx_dspark.application.data import load_prompts
        from mlx_dspark.application.modes import bench_runners
        from mlx_dspark.entrypoints.cli.bench_render import PlotUnavailable, plot_report, render_table

        prompts = load_prompts(args.prompts)
        settings, services, model = start_with_model(args, bar.note)
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
            environment=bootstrap.runtime_report() if args.json else {},
            progress=bar.update,
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
        bad_modes = [m.mode for m in report.modes if m.lossless is False]
        if bad_modes:
            bar.warn(f"LOSSLESS CHECK FAILED for {', '.join(bad_modes)} (token ids differ from baseline)")
            return 3
        return 0

    try:
        return run_guarded(body)
    finally:
        bar.close()
