"""What travels between the engine and a job's consumer, and what a decode job is to the engine.

A job's output is one typed stream of `JobEvent`s: items (`JobItem`), then exactly one end — `JobEnded` or
`JobFailed`. A decode job (`StepJob`) is a request's state machine: the engine asks its `work()`, runs it
together with the other rows' and hands the result to `advance()`; the job emits its items as they happen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs

from mlx_dspark.domain.decoder import Work


@attrs.frozen
class JobItem:
    """One item of a job's output (a chat event, a text chunk, a result...)."""

    value: Any


@attrs.frozen
class JobFailed:
    """The job ended with `error` (in its caller's terms: the dialect words it)."""

    error: BaseException


@attrs.frozen
class JobEnded:
    """The job ended normally (or was cancelled): nothing more comes."""


JobEvent = JobItem | JobFailed | JobEnded
Emit = Callable[[Any], None]  # a job's sink for its items


class StepJob(Protocol):
    """A request as the step engine drives it."""

    def work(self) -> Work | None:
        """What the request needs from the next step (None: it has finished and emitted its last item)."""
        ...

    def advance(self, result: Any) -> int | None:
        """The current work's result; for a verify, the rows the request keeps."""
        ...

    def cancel(self) -> None:
        """Its client went away: end now (state worth keeping is kept; nothing more is emitted)."""
        ...
