"""Stop strings matched on streamed text, holding back only what could still become a match."""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class StopMatch:
    """Text that is safe to emit, and the stop string that matched (None while none has)."""

    emit: str
    matched: str | None = None


@attrs.define
class StopStringMatcher:
    """Feed text deltas; get back what may be shown and whether a stop string completed.

    The earliest match in the text wins; text from the match on is never emitted.
    """

    stops: Sequence[str]
    _pending: str = ""
    _done: bool = False

    def feed(self, delta: str) -> StopMatch:
        if self._done:
            return StopMatch(emit="")
        text = self._pending + delta
        stops = [s for s in self.stops if s]
        if not stops:
            self._pending = ""
            return StopMatch(emit=text)
        first: tuple[int, str] | None = None
        for s in stops:
            i = text.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self._done = True
            self._pending = ""
            return StopMatch(emit=text[: first[0]], matched=first[1])
        hold = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self._pending = text[len(text) - hold :] if hold else ""
        return StopMatch(emit=text[: len(text) - hold])

    def flush(self) -> str:
        """Text held back at the end of generation (it never became a stop string)."""
        out, self._pending = self._pending, ""
        return "" if self._done else out
