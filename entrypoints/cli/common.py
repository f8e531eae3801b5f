"""Shared CLI plumbing: settings from flags + environment, logging, services, and error reporting."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from typing import Any

from mlx_dspark.application import bootstrap
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.services import Services
from mlx_dspark.application.settings import MODES, Settings, load_settings
from mlx_dspark.domain.errors import DomainError
from mlx_dspark.entrypoints.log_config import configure_logging


def add_model_args(p: argparse.ArgumentParser, *, mode: bool = True) -> None:
    """The model flags, declared once for every command that loads a model (None = take the environment or
    default). Commands that run several modes themselves (bench, calibrate) pass `mode=False`."""
    p.add_argument(
        "--model",
        help="a named model (default, gemma3-270m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b; installed on first use), "
        "a local dir, a Hugging Face repo id or a .gguf file",
    )
    if mode:
        p.add_argument("--mode", choices=MODES, help="draft source (default auto: measured winner)")
    p.add_argument("--drafter", help="drafter checkpoint: local dir or Hugging Face repo id")
    p.add_argument(
        "--draft-model",
        metavar="NAME|DIR",
        help="the draft model of --mode draft (and of bench --against mlx-lm-draft): a named model, local dir, "
        "repo id or .gguf sharing the target's vocabulary (default: qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)",
    )
    p.add_argument("--drafter-bits", type=int, choices=(0, 4, 8), help="quantize the drafter on load (0 = off)")
    p.add_argument("--max-draft", help="draft cap per round: an integer or 'auto' (measured)")
    p.add_argument(
        "--confidence-threshold",
        type=float,
        help="stop a block early, in [0, 1): DSpark below this survival (default: never), a draft model after a "
        "draft it gave less than this probability (default 0.2); 0 = never",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="a draft model drafts from its N most used tokens (its head reads only those rows; default: all)",
    )
    p.add_argument("--trust-remote-code", action="store_true", default=None, help="allow checkpoints with custom code")
    p.add_argument("--cache-dir", help="where converted models and calibration are stored")
    p.add_argument(
        "--distributed",
        choices=("ring", "jaccl", "mpi", "nccl", "any"),
        help="shard the target over the processes `mlx.launch` started, with this mx.distributed backend; rank 0 "
        "runs the command, the other ranks follow it (one request at a time)",
    )
    p.add_argument(
        "--rank-timeout",
        type=float,
        help="with --distributed: seconds rank 0 waits for the other ranks in one call before it ends the request "
        "as a lost (hung) rank (default 60; 0 waits forever)",
    )
    p.add_argument(
        "--prefix-cache-bytes",
        help="memory for cached prompt prefixes: bytes, 512M, 2G (0: reuse only what the model still holds; "
        "auto: 1/4 free)",
    )
    p.add_argument("--prefix-cache-dir", help="spill cold prefix-cache entries here; reloaded after a restart")
    p.add_argument("--log-level", help="debug, info, warning, error")


def settings_from(args: argparse.Namespace, extra: Mapping[str, Any] | None = None) -> Settings:
    flags = {k: v for k, v in vars(args).items() if v is not None}
    flags.update(extra or {})
    return load_settings(flags)


def start(settings: Settings, *, quiet_logs: bool = False) -> Services:
    """Swap the BLAS (before MLX loads), configure logging, wire services."""
    bootstrap.runtime().prepare()
    telemetry = settings.telemetry
    if quiet_logs and telemetry.log_level == "info":
        import attrs

        telemetry = attrs.evolve(telemetry, log_level="warning")
    configure_logging(telemetry)
    return bootstrap.build(settings)


MODEL_FLAGS = (
    "model",
    "drafter",
    "draft_model",
    "drafter_bits",
    "max_draft",
    "confidence_threshold",
    "draft_vocab",
    "trust_remote_code",
    "cache_dir",
    "distributed",
    "rank_timeout",
    "prefix_cache_bytes",
    "prefix_cache_dir",
    "log_level",
)


def start_with_model(
    args: argparse.Namespace, say: Callable[[str], None] | None = None
) -> tuple[Settings, Services, LoadedModel]:
    """Settings from the model flags only, wired services, and the loaded target (`say` hears "loading …",
    default a line on stderr)."""
    settings = settings_from(argparse.Namespace(**{k: getattr(args, k) for k in MODEL_FLAGS}))
    services = start(settings, quiet_logs=True)
    (say or progress_line)(f"loading {settings.model.model}")
    return settings, services, services.loader.load_target(settings.model.model)


def run_guarded(fn: Callable[[], int]) -> int:
    """Run a command body: domain errors become one clear line and exit status 1; Ctrl-C exits 130."""
    try:
        return fn()
    except DomainError as exc:
        sys.stderr.write(f"mlx-dspark: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\nmlx-dspark: interrupted\n")
        return 130


def progress_line(msg: str) -> None:
    sys.stderr.write(f"mlx-dspark: {msg}\n")
    sys.stderr.flush()
