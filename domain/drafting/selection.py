"""Which draft source runs a request, and with which cap policy: one selector object per mode.

A fixed mode always selects the same pair; `--mode auto` (application/auto_mode.py) chooses per request
from observed throughput, and its selection carries a SourceSwitcher that the decode loop asks after every
round, so a source that loses on this prompt gives way within the request. A switch is a SourceSwitched
event. Every round is verified by the target, so no choice changes the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from mlx_dspark.domain.costmodel.draft_cap import CapPolicy, repeatable
from mlx_dspark.domain.events import SourceSwitched, Usage
from mlx_dspark.domain.ports import DraftSource
from mlx_dspark.domain.tokens import SamplingParams

PLAIN = "baseline"  # the name of plain decoding (no draft source)


class SourceSwitcher(Protocol):
    """Asked by the decode loop after every round of a request (auto mode)."""

    def after_round(
        self,
        name: str,
        committed: int,
        seconds: float,
        *,
        drafted: int = 0,
        depth: int = 0,
        history: Sequence[int] = (),
    ) -> Selection | None:
        """The round of source `name` committed `committed` tokens in `seconds` (wall time per round),
        after drafting `drafted` tokens at context depth `depth`; `history` is the prompt and every token
        committed so far, this round's last (read only: what other sources would have drafted on it).

        Returns:
            The selection to run from the next round on (its `switched` is yielded), or None to stay.
        """
        ...


@attrs.frozen(kw_only=True)
class Selection:
    """What runs one request.

    Attributes:
        name: the source's mode name ("dspark", "lookup", ...; PLAIN for plain decoding).
        source: the draft source, or None for plain decoding.
        policy: the cap policy for this request (None = the source's full block).
        switched: set when the selector moved to this source (for this request, or from this round on).
        switcher: asked after every round whether to move on (None = this source for the whole request).
    """

    name: str
    source: DraftSource | None
    policy: CapPolicy | None = None
    switched: SourceSwitched | None = None
    switcher: SourceSwitcher | None = None


class SourceSelector(Protocol):
    """Chooses the (source, cap policy) pair of each request and learns from how it ran."""

    @property
    def mode(self) -> str:
        """The mode this selector implements ("auto", or the fixed mode's name)."""
        ...

    def select(self, prompt: Sequence[int], sampling: SamplingParams | None = None) -> Selection:
        """This request's source (`sampling`: the request's, e.g. a seed asks for a schedule that repeats)."""
        ...

    def finished(self, selection: Selection, usage: Usage) -> None:
        """The request run with `selection` ended with `usage`."""
        ...


@attrs.define
class FixedSelector:
    """Always the same source, with a fresh cap policy per request."""

    name: str
    source: DraftSource | None
    policy_factory: Callable[[], CapPolicy] | None = None

    @property
    def mode(self) -> str:
        return self.name

    def select(self, prompt: Sequence[int], sampling: SamplingParams | None = None) -> Selection:
        policy = self.policy_factory() if (self.policy_factory is not None and self.source is not None) else None
        if policy is not None:  # a seeded request's caps must not follow wall time
            policy = repeatable(policy, sampling)
        return Selection(name=self.name, source=self.source, policy=policy)

    def finished(self, selection: Selection, usage: Usage) -> None:
        return None
