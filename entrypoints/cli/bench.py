"""`mlx-dspark bench`: every mode on the fixed prompt set, baseline measured in the same run; a table,
`--json`, or a PNG plot (`--plot`, needs the optional `plot` extra)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from mlx_dspark.entrypoints.cli.common import progress_line, run_guarded, start_with_model

DEFAULT_MODES = ("baseline", "lookup", "dflash", "dspark", "auto")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-dspark bench",
        description="Measure decode speed of each mode against plain decoding, on the same prompts, in one run.",
    )
    p.add_argument("--model", help="'default', a local dir, a Hugging Face repo id or a .gguf file")
    p.add_argument("--drafter", help="drafter checkpoint for dspark/dflash: local dir or Hugging Face repo id")
    p.add_argument("--drafter-bits", type=int, choices=(0, 4, 8), help="quantize the drafter on load (0 = off)")
    p.add_argument("--max-draft", help="draft cap per round: an integer or 'auto' (measured)")
    p.add_argument("--trust-remote-code", action="store_true", default=None)
    p.add_argument("--cache-dir", help="where converted models and calibration are stored")
    p.add_argument("--log-level", help="debug, info, warning, error")
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated, any of {','.join(DEFAULT_MODES)} (default: baseline, available drafters, auto)",
    )
    p.add_argument("--prompts", default="chat,code,math", help="classes of the built-in set, or a JSONL/text file")
    p.add_argument("--trials", type=int, default=3, help="runs per prompt per mode (medians over all)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (enables the lossless check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also write a PNG of tok/s per mode and the cost curves")
    return p


def _progress(msg: str, fraction: float) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[Kmlx-dspark: {msg} [{fraction * 100:3.0f}%]")
        if fraction >= 1.0:
            sys.stderr.write("\n")
        sys.stderr.flush()


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)

    def body() -> int:
        from mlx_dspark.application import bootstrap
        from mlx_dspark.application.auto_mode import SwitchingDraftSource
        from mlx_dspark.application.bench import PlotUnavailable, plot_report, render_table, report_json, run_bench
        from mlx_dspark.application.calibration import curves_for
        from mlx_dspark.application.data import load_prompts
        from mlx_dspark.application.generation import GenerationService
        from mlx_dspark.application.modes import build_generator
        from mlx_dspark.application.settings import MODES
        from mlx_dspark.domain.errors import DomainError, InvalidRequest
        from mlx_dspark.domain.ports import DraftSource

        prompts = load_prompts(args.prompts)
        settings, services, model = start_with_model(args)
        if args.modes:
            modes = [m.strip() for m in args.modes.split(",") if m.strip()]
            bad = [m for m in modes if m not in MODES]
            if bad:
                raise InvalidRequest(message=f"unknown mode(s) {bad}; choose from {', '.join(MODES)}", param="modes")
            explicit = True
        else:
            available = set(services.loader.available_drafters(model))
            modes = [m for m in DEFAULT_MODES if m in {"baseline", "auto"} or m in available]
            explicit = False
        if "baseline" not in modes:
            modes.insert(0, "baseline")  # speedups are always against a baseline measured in this run
        runners: dict[str, GenerationService] = {}
        for mode in modes:
            try:
                runners[mode] = build_generator(services, settings, model=model, mode=mode, progress=progress_line)
            except DomainError as exc:
                if explicit:
                    raise
                progress_line(f"skipping {mode}: {exc}")
        sources: dict[str, DraftSource | None] = {
            m: g.source
            for m, g in runners.items()
            if g.source is not None and not isinstance(g.source, SwitchingDraftSource)
        }
        curves = {}
        if (args.json or args.plot) and sources:
            curves = curves_for(
                services.calibration,
                model,
                sources,
                services.clock,
                drafter_bits=settings.model.drafter_bits,
                progress=_progress,
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
            progress=_progress,
        )
        if args.json:
            sys.stdout.write(json.dumps(report_json(report), indent=1) + "\n")
        else:
            sys.stdout.write(render_table(report))
        if args.plot:
            try:
                plot_report(report, args.plot)
            except PlotUnavailable as exc:
                sys.stderr.write(f"mlx-dspark: {exc}\n")
                return 1
            progress_line(f"wrote {args.plot}")
        bad_modes = [m.mode for m in report.modes if m.lossless is False]
        if bad_modes:
            progress_line(f"LOSSLESS CHECK FAILED for {', '.join(bad_modes)} (token ids differ from baseline)")
            return 3
        return 0

    return run_guarded(body)
