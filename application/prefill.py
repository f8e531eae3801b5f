"""Prefill of one prompt in pieces: progress events for long prompts, and saved states at snapshot points.

The target still chunks each piece itself (activation memory); the pieces here are where the use case
needs control back: every `PROGRESS_EVERY` tokens (telemetry, keep-alives) and at each snapshot point.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

from mlx_dspark.domain.events import PrefillProgress
from mlx_dspark.domain.ports import TargetModel
from mlx_dspark.domain.tokens import SamplingParams

PROGRESS_EVERY = 1024  # prompt tokens between progress events


def prefill(
    target: TargetModel,
    prompt: Sequence[int],
    start: int,
    sampling: SamplingParams,
    uniform: float,
    *,
    snapshots: Sequence[int] = (),
    on_snapshot: Callable[[], object] | None = None,
    every: int | None = None,
) -> Generator[PrefillProgress, None, int]:
    """Prefill `prompt[start:]` (rows before `start` are cached); returns the first token.

    Yields PrefillProgress after each piece when the prefill is longer than `every` tokens (the last
    event reports the whole prompt). `on_snapshot` runs when the cache holds exactly a snapshot point's
    rows (a point at the prompt's end: right after the prefill).
    """
    every = every or PROGRESS_EVERY
    total = len(prompt)
    points = {p for p in snapshots if start < p <= total}
    report = total - start > every
    stops = points | (set(range(start + every, total, every)) if report else set())
    pos = start
    for stop in sorted(s for s in stops if s < total):
        target.extend(prompt[pos:stop])
        pos = stop
        if stop in points and on_snapshot is not None:
            on_snapshot()
        if report:
            yield PrefillProgress(done=pos, total=total, reused=start)
    first = target.prefill(prompt[pos:], sampling, uniform)
    if total in points and on_snapshot is not None:
        on_snapshot()
    if report:
        yield PrefillProgress(done=total, total=total, reused=start)
    return first
