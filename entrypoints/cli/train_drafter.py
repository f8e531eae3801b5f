"""`mlx-dspark train-drafter`: distil a DFlash or DSpark drafter for a target, with a progress bar, periodic
atomic checkpoints, `--resume`, and an optional measurement of the result on the held-out prompts."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mlx_dspark.entrypoints.cli.common import progress_line, run_guarded, settings_from, start


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-dspark train-drafter",
        description="Distil a drafter from the target's own responses (drafters.md §2.4 / §3.4).",
    )
    p.add_argument("--target", default="default", help="'default', a local dir, a repo id or a .gguf file")
    p.add_argument("--kind", choices=("dflash", "dspark"), required=True)
    p.add_argument("--out", required=True, help="checkpoint directory (config.json + model.safetensors + card)")
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers (default 1)")
    p.add_argument("--block-size", type=int, help="block length (default: dflash 8 → 7 drafts, dspark 7)")
    p.add_argument("--target-layers", default="auto", help="'auto' (the published rule) or ids like 1,8,14,21,27")
    p.add_argument("--prompts", default="builtin", help="'builtin' or a JSONL file of {messages} / {prompt}")
    p.add_argument("--samples", type=int, default=2000, help="conversations to generate responses for")
    p.add_argument("--max-new-tokens", type=int, default=192, help="response cap during data generation")
    p.add_argument("--gen-batch", type=int, default=64, help="concurrent sequences during data generation")
    p.add_argument("--sampled-fraction", type=float, default=0.25, help="share of sampled (T=0.7) responses")
    p.add_argument("--gen-time-budget", type=float, help="seconds after which no new prompt is generated")
    p.add_argument("--data", help="JSONL cache of generated sequences (reused when present)")
    p.add_argument("--generate-only", action="store_true", help="stop after writing --data")
    p.add_argument("--epochs", type=float, default=6.0)
    p.add_argument("--batch", type=int, default=8, help="sequences per training step")
    p.add_argument("--anchors", type=int, default=32, help="random anchors per sequence and step")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--steps", type=int, help="cap on training steps")
    p.add_argument("--time-budget", type=float, help="seconds of training (sets the step count from measured speed)")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="head vocabulary (the most frequent response tokens, d2t); 0 = full",
    )
    p.add_argument("--compile", action="store_true", help="compile the training step (mx.compile; fast on a GPU)")
    p.add_argument("--init-from", help="start from this published drafter checkpoint (its shape and weights)")
    p.add_argument(
        "--grow",
        action="store_true",
        help="with --init-from: keep --layers/--block-size/--target-layers; the checkpoint's layers first, added "
        "layers and target layers start at zero, so training starts from the checkpoint's function",
    )
    p.add_argument("--kl-weight", type=float, default=0.0, help="soft targets: KL to the target's distribution")
    p.add_argument("--own-prev", type=float, default=0.0, help="dspark: share of blocks fed their own drafts")
    p.add_argument("--loss-gamma", type=float, default=0.0, help="slot weight decay exp(-k/γ) (0 = published)")
    p.add_argument("--length-grouping", type=int, default=32, help="batches from length-sorted groups (0 = off)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS", help="time STEPS steps part by part")
    p.add_argument("--stop-after", type=float, help="stop (checkpointed) after this many seconds; --resume goes on")
    p.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="drafter forward/backward dtype (bfloat16: over float32 master weights)",
    )
    p.add_argument("--markov-rank", type=int, default=32, help="dspark: Markov head rank")
    p.add_argument("--mlp-width", type=int, default=0, help="the drafter's MLP width (0: the target's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=0, help="steps between held-out τ estimates (0 = end only)")
    p.add_argument("--save-dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/training/, or, when OUT holds only a published drafter, continue that drafter "
        "with this run's data (fresh optimizer and schedule)",
    )
    p.add_argument("--measure", action="store_true", help="afterwards, measure τ and speedup on held-out prompts")
    p.add_argument("--measure-only", action="store_true", help="only measure the checkpoint in --out")
    p.add_argument("--measure-tokens", type=int, default=128)
    p.add_argument("--max-draft", default="7", help="drafts per round when measuring (an integer or 'auto')")
    p.add_argument("--cache-dir", help="where converted models are stored")
    p.add_argument("--log-level", help="debug, info, warning, error")
    p.add_argument("--json", action="store_true", help="print the run's facts as JSON")
    return p


class ProgressBar:
    """One status line on stderr: step/total, loss, block tokens/s and ETA (a log line when not a TTY)."""

    def __init__(self, width: int = 24) -> None:
        self.width = width
        self.tty = sys.stderr.isatty()
        self.last_plain = 0.0

    def __call__(self, p: Mapping[str, Any]) -> None:
        if "profile" in p:
            prof = p["profile"]
            if self.tty:
                sys.stderr.write("\n")
            sys.stderr.write(
                f"profile: {prof['block_tokens_per_s']:.0f} block tok/s, {prof['steps_per_s']:.2f} steps/s; per step "
                f"{prof['step_ms']:.1f} ms (target-side forward {prof['target_ms']:.1f}, drafter "
                f"{prof['drafter_ms']:.1f}), host {prof['host_ms']:.1f} ms\n"
            )
            return
        frac = p["step"] / max(1, p["total"])
        filled = int(frac * self.width)
        eta = int(p["eta_s"])
        tau = f" τ≈{p['tau']:.2f}" if p.get("tau") else ""
        line = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {p['step']}/{p['total']} "
            f"loss {p['loss']:.3f} acc {p['acc']:.3f}{tau} {p['tokens_per_s']:.0f} tok/s "
            f"{p.get('steps_per_s', 0):.2f} steps/s "
            f"ETA {eta // 60}:{eta % 60:02d}"
        )
        if self.tty:
            sys.stderr.write(f"\r\033[K{line}")
            if p["step"] >= p["total"]:
                sys.stderr.write("\n")
        elif time.monotonic() - self.last_plain > 10 or p["step"] >= p["total"]:
            self.last_plain = time.monotonic()
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _layers(value: str) -> tuple[int, ...]:
    if value.strip().lower() == "auto":
        return ()
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError as exc:
        raise SystemExit(f"mlx-dspark train-drafter: --target-layers must be 'auto' or integers: {exc}") from exc


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)

    def body() -> int:
        import attrs

        from mlx_dspark.application import bootstrap
        from mlx_dspark.application.lab.training import DataOptions, TrainPlan, TrainRequest, train_drafter

        flags = {"model": args.target, "cache_dir": args.cache_dir, "log_level": args.log_level}
        settings = settings_from(argparse.Namespace(**flags))
        facts: dict[str, Any] = {}
        if not args.measure_only:
            bootstrap.runtime().prepare()
            trainer = bootstrap.build_trainer(settings)
            block = args.block_size or (8 if args.kind == "dflash" else 7)
            plan = TrainPlan(
                kind=args.kind,
                layers=args.layers,
                block_size=block,
                target_layers=_layers(args.target_layers),
                draft_vocab=args.draft_vocab,
                markov_rank=args.markov_rank,
                mlp_width=args.mlp_width,
                lr=args.lr,
                epochs=args.epochs,
                batch=args.batch,
                anchors=args.anchors,
                max_steps=args.steps,
                time_budget_s=args.time_budget,
                seed=args.seed,
                checkpoint_every=args.checkpoint_every,
                eval_every=args.eval_every,
                save_dtype=args.save_dtype,
                compile=args.compile,
                init_from=args.init_from,
                grow=args.grow,
                kl_weight=args.kl_weight,
                own_prev=args.own_prev,
                loss_gamma=args.loss_gamma,
                length_grouping=args.length_grouping,
                profile_steps=args.profile,
                stop_after_s=args.stop_after,
                compute_dtype=args.compute_dtype,
            )
            data = DataOptions(
                prompts=args.prompts,
                samples=args.samples,
                max_new_tokens=args.max_new_tokens,
                batch=args.gen_batch,
                sampled_fraction=args.sampled_fraction,
                time_budget_s=args.gen_time_budget,
                cache=args.data,
                seed=args.seed,
            )
            request = TrainRequest(
                target=args.target,
                out=args.out,
                plan=plan,
                data=data,
                resume=args.resume,
                generate_only=args.generate_only,
            )
            facts = dict(train_drafter(trainer, request, say=progress_line, on_progress=ProgressBar()))
            if facts.get("interrupted"):
                progress_line(f"interrupted at step {facts['steps']}: checkpoint in {args.out}; --resume continues")
                return 130
            if "steps" in facts:
                progress_line(
                    f"done: {facts['steps']} steps, loss {facts['first_loss']:.3f} → {facts['loss']:.3f}, "
                    f"held-out τ estimate {facts['tau_estimate']:.2f}; checkpoint in {args.out}"
                )
        if args.measure or args.measure_only:
            facts["measured"] = _measure(args, settings)
        if args.json:
            sys.stdout.write(json.dumps({k: v for k, v in facts.items() if k != "config"}, default=str) + "\n")
        _ = attrs
        return 0

    return run_guarded(body)


def _measure(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    """Plain vs speculative greedy decoding on the held-out prompts; the result is added to the model card."""
    from pathlib import Path

    from mlx_dspark.application.generation import GenerationService
    from mlx_dspark.application.lab.training import measure_drafter
    from mlx_dspark.application.modes import parse_max_draft
    from mlx_dspark.domain.costmodel.draft_cap import FixedCap

    services = start(settings, quiet_logs=True)
    runtime = bootstrap_runtime()
    progress_line(f"measuring {args.kind} from {args.out} on {runtime}")
    model = services.loader.load_target(args.target)
    source = services.loader.load_drafter(args.kind, args.out, model, bits=None)
    cap = parse_max_draft(args.max_draft)
    fixed = None if cap is None else min(cap, source.max_block)
    runners = {
        "baseline": GenerationService(model, clock=services.clock, telemetry=services.telemetry),
        args.kind: GenerationService(
            model,
            source=source,
            mode=args.kind,
            clock=services.clock,
            telemetry=services.telemetry,
            cap_policy_factory=None if fixed is None else (lambda: FixedCap(fixed)),
        ),
    }
    measured = measure_drafter(
        runners, kind=args.kind, max_tokens=args.measure_tokens, device=runtime, cap=fixed or "auto"
    )
    card = Path(args.out) / "README.md"
    if card.is_file():
        text = card.read_text().split("\n## Measured", 1)[0].rstrip("\n") + "\n"
        card.write_text(text + _measured_section(measured))
    progress_line(
        f"{args.kind}: acceptance median {measured['median_acceptance']:.2f} (mean {measured['mean_acceptance']:.2f}), "
        f"speedup {measured['median_speedup']:.2f}x, identical {measured['identical']}/{measured['prompts']}"
    )
    return measured


def bootstrap_runtime() -> str:
    import os

    from mlx_dspark.application import bootstrap

    info = bootstrap.runtime().report()
    return (
        f"{info.get('device_type', info.get('device'))} ({os.cpu_count()} cores, {info.get('platform')}), "
        f"MLX {info.get('mlx_version')}, BLAS {info.get('blas')}"
    )


def _measured_section(measured: Mapping[str, Any]) -> str:
    from mlx_dspark.application.lab.training import model_card

    full = model_card("", "", {}, measured)
    return "\n## Measured" + full.split("\n## Measured", 1)[1]
