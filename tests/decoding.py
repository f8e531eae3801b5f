"""Reading a decode's event stream back as what a caller sees: the tokens, the rounds and the finish."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mlx_dspark.domain.events import DecodeEvent, Finished, RoundFinished, TokensCommitted


def collect(
    events: Iterable[DecodeEvent], *, after_commit: Callable[[list[int]], None] | None = None
) -> tuple[list[int], list[RoundFinished], Finished]:
    """Committed tokens, every `RoundFinished` and the one `Finished`; `after_commit(tokens so far)` runs
    after each commit (for invariants that must hold between rounds)."""
    tokens: list[int] = []
    rounds: list[RoundFinished] = []
    finished = None
    for ev in events:
        if isinstance(ev, TokensCommitted):
            tokens.extend(ev.tokens)
            if after_commit is not None:
                after_commit(tokens)
        elif isinstance(ev, RoundFinished):
            rounds.append(ev)
        elif isinstance(ev, Finished):
            finished = ev
    assert finished is not None
    return tokens, rounds, finished
