"""`mlx-dspark claude`: run claude against the local server (see launch.py)."""

from __future__ import annotations

from collections.abc import Sequence

from mlx_dspark.entrypoints.cli.launch import main as launch


def main(argv: Sequence[str]) -> int:
    return launch("claude", argv)
