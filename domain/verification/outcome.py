"""What one verify pass decides."""

from __future__ import annotations

import attrs


@attrs.frozen
class Acceptance:
    """The verdict of one round.

    Attributes:
        accepted: how many leading drafts the target accepted (0..len(block)).
        next_token: the target's own token after them: the bonus token when every draft was accepted,
            the corrected (resampled) token otherwise.
    """

    accepted: int
    next_token: int
