"""`mlx-dspark calibrate`: re-measure this machine's cost curves for a model and its drafters, re-run the
auto-mode race, and store both (what `--mode auto` and `--max-draft auto` read)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from mlx_dspark.entrypoints.cli.common import add_model_args, run_guarded, start_with_model
from mlx_dspark.entrypoints.cli.progress import ProgressBar


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-dspark calibrate", description="Measure cost curves and race the draft sources."
    )
    add_model_args(p, mode=False)
    p.add_argument("--modes", help="draft sources to race (default: every available one), e.g. lookup,dspark")
    p.add_argument("--race-tokens", type=int, default=24, help="tokens per race prompt")
    p.add_argument("--json", action="store_true", help="print curves and race results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar, only the results")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    bar = ProgressBar(quiet=args.quiet)

    def calibrating(msg: str, fraction: float) -> None:
        bar.update(f"calibrating: {msg}", fraction)

    def body() -> int:
        from mlx_dspark.application.auto_mode import measure_and_choose
        from mlx_dspark.application.lab.bench import curves_json
        from mlx_dspark.application.modes import auto_candidates, parse_max_draft
        from mlx_dspark.domain.costmodel.curves import best_cap

        settings, services, model = start_with_model(args, bar.note)
        kinds = [k.strip() for k in args.modes.split(",") if k.strip()] if args.modes else None
        candidates = auto_candidates(services.loader, settings, model, bar.warn, kinds=kinds)
        choice = measure_and_choose(
            services.calibration,
            model,
            candidates,
            services.clock,
            drafter_bits=settings.model.drafter_bits,
            max_draft=parse_max_draft(settings.model.max_draft),
            force=True,
            online=False,
            race_tokens=args.race_tokens,
            progress=calibrating,
        )
        bar.close()
        prior = [0.7] * 64
        if args.json:
            doc = {
                "model": model.identity,
                "chosen": choice.mode,
                "race_decode_tok_s": dict(choice.rates),
                "curves": {name: curves_json(c) for name, c in choice.curves.items()},
                "best_cap_at_prior_0.7": {
                    name: best_cap(c, prior, candidates[name].max_block)  # type: ignore[union-attr]
                    for name, c in choice.curves.items()
                    if candidates.get(name) is not None
                },
            }
            sys.stdout.write(json.dumps(doc, indent=1) + "\n")
            return 0
        any_curves = next(iter(choice.curves.values()))
        widths = sorted(any_curves.verify_s)
        sys.stdout.write(f"{model.identity}: verify ms by width (context depth 0)\n")
        sys.stdout.write("  " + "  ".join(f"{w}:{any_curves.verify_s[w] * 1e3:.1f}" for w in widths) + "\n")
        sys.stdout.write(
            f"  context slope {any_curves.slope_s_per_token * 1e6:.2f} µs/token, "
            f"round overhead {any_curves.overhead_s * 1e3:.2f} ms\n"
        )
        for name, src in candidates.items():
            rate = choice.rates.get(name, 0.0)
            line = f"  {name:<10} race {rate:7.2f} tok/s"
            if src is not None:
                c = choice.curves[name]
                draft = "  ".join(f"{k}:{v * 1e3:.1f}" for k, v in sorted(c.draft_s.items()))
                line += f"  best cap at p=0.7: {best_cap(c, prior, src.max_block)}  drafter ms by cap {draft}"
            sys.stdout.write(line + "\n")
        sys.stdout.write(f"auto mode picks: {choice.mode}\n")
        return 0

    try:
        return run_guarded(body)
    finally:
        bar.close()
