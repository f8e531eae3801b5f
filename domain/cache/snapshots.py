"""Where to snapshot state that cannot be cut back (recurrent layers, a wrapped sliding window).

Such a state serves a later prompt only if that prompt starts with exactly the snapshotted tokens, so
snapshots go where a later turn's prompt is sure to agree: the ends of the system prompt and of user or
tool turns, measured on the model's own template (the application renders the history as a later turn
would and passes the points where the token streams still agree).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def snapshot_points(
    boundaries: Iterable[int], *, start: int, end: int, min_gap: int = 1, most: int = 4
) -> tuple[int, ...]:
    """The boundaries worth a snapshot during a prefill of rows [start, end).

    Args:
        boundaries: candidate row counts (stable turn ends).
        start: rows already cached (a snapshot there exists or is not needed).
        end: rows after the prefill (the prompt length); a point there is taken once prefill ends.
        min_gap: points closer than this to the previous one (or to `start`) are not worth the copy.
        most: at most this many: the earliest (the shared system prompt) and the latest ones.

    Returns:
        Increasing row counts in (start, end].
    """
    if most < 1:
        return ()
    kept: list[int] = []
    last = start
    for b in sorted(set(boundaries)):
        if start < b <= end and b - last >= min_gap:
            kept.append(b)
            last = b
    if len(kept) > most:
        kept = [kept[0], *kept[len(kept) - (most - 1) :]] if most > 1 else kept[-1:]
    return tuple(kept)
