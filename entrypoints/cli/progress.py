"""What a person sees while long work runs: one live progress bar (rich) on stderr when it is a terminal.

Nothing at all when stderr is not a terminal or with --quiet, so piped output and `--json` stay clean;
results always go to stdout, never through here. Warnings are the exception: they are always written.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn, TimeElapsedColumn

PREFIX = "mlx-dspark: "


class ProgressBar:
    """One bar for a command: `update(label, fraction)` moves it, `note(text)` prints a line above it.

    Args:
        quiet: show nothing but warnings.
        stream: where to draw (default stderr); the bar is live only when it is a terminal.
    """

    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.live = not quiet and self._stream.isatty()
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._console = Console(file=self._stream, highlight=False) if self.live else None

    def update(self, label: str, fraction: float) -> None:
        """Move the bar to `fraction` (0..1) with `label` beside it; phases may restart from 0."""
        if self._console is None:
            return
        if self._bar is None:
            self._bar = Progress(
                TextColumn(PREFIX + "{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=self._console,
                transient=True,  # the bar is gone once the work is done; results take its place
            )
            self._bar.start()
            self._task = self._bar.add_task(label, total=1.0)
        assert self._task is not None
        self._bar.update(self._task, description=label, completed=min(max(fraction, 0.0), 1.0))

    def note(self, text: str) -> None:
        """A one-off status line (on a terminal only), printed above the bar."""
        if self._console is not None:
            self._console.print(PREFIX + text, markup=False)

    def warn(self, text: str) -> None:
        """Something the user must see, terminal or not."""
        if self._console is not None:
            self._console.print(PREFIX + text, markup=False)
        else:
            self._stream.write(PREFIX + text + "\n")
            self._stream.flush()

    def close(self) -> None:
        """Remove the bar (before results are written to the same terminal)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            self._task = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
