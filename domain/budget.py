"""Budget and stop rules of a round: never past max_tokens, end at the first EOS inside a block."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from mlx_dspark.domain.tokens import FinishReason, StopRule


def round_cap(requested: int, remaining: int) -> int:
    """The most drafts worth proposing: a round commits up to cap + 1 tokens, so leave room for the bonus."""
    return max(0, min(requested, remaining - 1))


@attrs.frozen
class CommitPlan:
    """What a round really commits.

    Attributes:
        tokens: tokens to emit, in order (an EOS that ends generation is not emitted).
        keep_rows: verified rows to keep in the target's cache (anchor + the drafts that stay).
        finish: why generation ends after this round, or None to go on.
    """

    tokens: tuple[int, ...]
    keep_rows: int
    finish: FinishReason | None


def plan_commit(candidates: Sequence[int], generated: int, rule: StopRule) -> CommitPlan:
    """Clip one round's accepted drafts + next token to the budget and the first EOS.

    Args:
        candidates: accepted drafts followed by the target's next token.
        generated: tokens emitted before this round.
        rule: the request's stop rule.

    Returns:
        The committed tokens, how many verified rows stay cached, and the finish reason if any.
        Row i of a verify holds the anchor (i = 0) or draft i; committing c tokens keeps c rows, the
        last committed token becoming the next anchor.
    """
    remaining = rule.max_tokens - generated
    out: list[int] = []
    finish: FinishReason | None = None
    for token in candidates:
        if token in rule.eos_ids:
            finish = FinishReason.STOP
            break
        if len(out) >= remaining:
            break
        out.append(token)
    if finish is None and generated + len(out) >= rule.max_tokens:
        finish = FinishReason.LENGTH
    return CommitPlan(tokens=tuple(out), keep_rows=len(out), finish=finish)
