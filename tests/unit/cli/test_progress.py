"""The progress bar: one live bar on a terminal (a pty here), nothing when not a terminal or --quiet."""

from __future__ import annotations

import io
import os
import pty

from mlx_dspark.entrypoints.cli.progress import ProgressBar
from tests.unit.cli.terminal import read_pty


def _drain(master: int) -> str:
    return read_pty(master, 0.2, 0.2).decode(errors="replace")


def test_a_terminal_gets_one_live_bar_not_a_line_per_percent() -> None:
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            bar = ProgressBar(stream=tty)
            assert bar.live
            bar.note("loading default")
            for step in range(101):
                bar.update("race baseline", step / 100)
            bar.close()
            tty.flush()
        out = _drain(master)
    finally:
        os.close(master)
        os.close(slave)
    assert "loading default" in out and "race baseline" in out
    # 101 updates, one note: the bar redraws in place (a few lines at most), never a line per update
    assert out.count("\n") <= 3, out.count("\n")
    assert "race baseline (" not in out


def test_not_a_terminal_or_quiet_writes_nothing_but_warnings() -> None:
    for bar, stream in ((ProgressBar(stream=s), s) for s in (io.StringIO(),)):
        assert not bar.live
        bar.note("loading default")
        bar.update("race baseline", 0.5)
        bar.close()
        assert stream.getvalue() == ""
        bar.warn("skipping dflash: not found")
        assert stream.getvalue() == "mlx-dspark: skipping dflash: not found\n"
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            quiet = ProgressBar(quiet=True, stream=tty)
            assert not quiet.live
            quiet.note("loading default")
            quiet.update("race baseline", 0.5)
            quiet.close()
            tty.flush()
        assert _drain(master) == ""
    finally:
        os.close(master)
        os.close(slave)
