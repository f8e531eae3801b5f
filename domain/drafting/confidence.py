"""Confidence-scheduled truncation of a DSpark block (non-anticipating, hence lossless)."""

from __future__ import annotations

from collections.abc import Sequence


def confident_prefix_length(confidences: Sequence[float], threshold: float) -> int:
    """How many leading drafts to keep: stop before the first slot whose running survival drops below.

    Slot k's confidence is the probability it survives given slots < k did, and it is computed from
    tokens before k only, so cutting on it never looks at the token it cuts.

    Args:
        confidences: per-slot conditional survival probabilities c_k.
        threshold: keep while the running product stays >= threshold; <= 0 keeps everything.

    Returns:
        The number of drafts to verify (at least 1 when there is any draft).
    """
    if threshold <= 0 or not confidences:
        return len(confidences)
    survival = 1.0
    for k, c in enumerate(confidences):
        survival *= c
        if survival < threshold:
            return max(1, k)
    return len(confidences)
