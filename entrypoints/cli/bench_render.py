"""Terminal and PNG renderings of a bench report (the use case in application/lab/bench.py measures)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from mlx_dspark.application.lab.bench import BenchReport, ModeSummary, PrefillPoint


def _times(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _grid(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _decode_vs(m: ModeSummary, reference: str) -> str:
    v = m.vs_references.get(reference)
    return _times(v.decode if v is not None else None)


def render_table(report: BenchReport) -> str:
    """The terminal table: one row per mode, its speedup per prompt class, what auto ran and, with references
    (`--against`), a row of each and every mode's paired decode ratio against each (prefill against the
    fastest reference, which the title names)."""
    classes = sorted({p.cls for p in report.prompt_set.prompts})
    ref = report.reference
    refs = report.references or ((ref,) if ref else ())
    against = (*(f"decode/{r}" for r in refs), f"prefill/{ref}") if ref else ()
    head = (
        "mode", "decode tok/s", "prefill tok/s", "e2e tok/s", "TTFT ms", "acc/round", "speedup", *against,
        *classes, "lossless", "ran",
    )  # fmt: skip
    rows = [head]
    for m in report.modes:
        if m.lossless is None:
            lossless = "n/a"
        elif m.lossless:
            lossless = "yes"
        elif m.mode in refs:
            lossless = "differs: " + ", ".join(f"{p}@{i}" for p, i in m.first_divergence.items())
        else:
            lossless = f"NO ({len(m.mismatched)})"
        ran = ", ".join(f"{name} {n}" for name, n in m.sources.items()) if set(m.sources) != {m.mode} else ""
        ratios = (*(_decode_vs(m, r) for r in refs), _times(m.prefill_vs_reference)) if ref else ()
        rows.append(
            (
                m.mode,
                f"{m.decode_tok_s:.2f}",
                f"{m.prefill_tok_s:.1f}",
                f"{m.e2e_tok_s:.2f}",
                f"{m.ttft_s * 1e3:.0f}",
                f"{m.mean_accepted:.2f}",
                _times(m.speedup),
                *ratios,
                *(_times(m.per_class_speedup.get(c)) for c in classes),
                lossless,
                ran,
            )
        )
    title = (
        f"{report.model}: {len(report.prompt_set.prompts)} prompts ({report.prompt_set.name} "
        f"{report.prompt_set.version}) × {report.trials} trials, {report.max_tokens} tokens, "
        f"temperature {report.temperature:g}; medians; per-class columns are speedups on that class"
    )
    if len(refs) == 1:
        title += f"; {ref} ran right after baseline on each prompt, ratios are paired per prompt (ours / {ref})"
    elif refs:
        title += (
            f"; {', '.join(refs)} ran right after baseline on each prompt, ratios are paired per prompt "
            f"(ours / theirs); the fastest reference is {ref}"
        )
    return title + "\n" + "\n".join(_grid(rows)) + "\n" + render_auto(report)


def render_auto(report: BenchReport) -> str:
    """Auto per class: its median decode tok/s against plain decoding's and the best fixed mode's."""
    if not report.auto:
        return ""
    rows = [("class", "auto tok/s", "plain tok/s", "best fixed", "auto/plain", "auto/best", "switches", "auto rounds")]
    for v in report.auto:
        rows.append(
            (
                v.cls,
                f"{v.auto_tok_s:.2f}",
                f"{v.plain_tok_s:.2f}",
                f"{v.best_mode} {v.best_tok_s:.2f}",
                _times(v.vs_plain),
                _times(v.vs_best),
                f"{v.switches:g}",
                ", ".join(f"{k} {n}" for k, n in v.rounds.items()),
            )
        )
    title = "auto per class (medians, same run; switches = median in-request source switches)"
    return title + "\n" + "\n".join(_grid(rows)) + "\n"


def render_prefill(model: str, points: Sequence[PrefillPoint], reference: str | None) -> str:
    """The `--prefill-lengths` table: prefill tok/s per prompt length, ours and the reference's."""
    theirs_head = (f"{reference} tok/s", f"ours/{reference}", "same 1st token") if reference else ()
    bound = any(p.bound_tok_s for p in points)
    head = ("tokens", "ours tok/s", *theirs_head, *(("GEMM bound tok/s", "ours/bound") if bound else ()))
    rows = [head]
    for p in points:
        theirs = (
            (
                f"{p.reference_tok_s:.1f}" if p.reference_tok_s is not None else "n/a",
                _times(p.ratio),
                "n/a" if p.same_first_token is None else ("yes" if p.same_first_token else "NO"),
            )
            if reference
            else ()
        )
        limit = (
            (f"{p.bound_tok_s:.1f}" if p.bound_tok_s else "n/a", f"{p.of_bound:.2f}" if p.of_bound else "n/a")
            if bound
            else ()
        )
        rows.append((str(p.tokens), f"{p.ours_tok_s:.1f}", *theirs, *limit))
    title = f"{model}: prefill alone (synthetic ids, cold cache, prefix cache off), medians over trials"
    return title + "\n" + "\n".join(_grid(rows)) + "\n"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (it is the optional `plot` extra)."""


def plot_report(report: BenchReport, path: str) -> None:
    """Write a PNG: decode tok/s per mode, and the verify/drafter cost curves.

    Raises:
        PlotUnavailable: matplotlib is missing (`pip install 'mlx-dspark[plot]'`).
    """
    try:
        # Optional dependency: imported by name so type checking does not need it installed.
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'mlx-dspark[plot]'") from exc
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [m.mode for m in report.modes]
    ax1.bar(names, [m.decode_tok_s for m in report.modes], color="tab:blue")
    ax1.set_ylabel("decode tokens/s (median)")
    ax1.set_title(f"{report.model}")
    for i, m in enumerate(report.modes):
        if m.speedup is not None:
            ax1.annotate(f"{m.speedup:.2f}x", (i, m.decode_tok_s), ha="center", va="bottom")
    plotted_verify = False
    for name, c in report.curves.items():
        if not plotted_verify:
            xs = sorted(c.verify_s)
            ax2.plot(xs, [c.verify_s[x] * 1e3 for x in xs], marker="o", label="verify (by width)")
            plotted_verify = True
        if c.draft_s:
            xs = sorted(c.draft_s)
            ax2.plot(xs, [c.draft_s[x] * 1e3 for x in xs], marker=".", label=f"{name} drafter (by cap)")
    ax2.set_xlabel("width / cap")
    ax2.set_ylabel("ms")
    ax2.set_title("measured cost curves")
    if plotted_verify:
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
