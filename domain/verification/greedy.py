"""Greedy acceptance: the longest prefix of drafts equal to the target's argmax, plus its bonus token."""

from __future__ import annotations

from collections.abc import Sequence

from mlx_dspark.domain.verification.outcome import Acceptance


def longest_accepted_prefix(drafts: Sequence[int], target_argmax: Sequence[int]) -> Acceptance:
    """Greedy verdict.

    Args:
        drafts: the proposed tokens d_1..d_k.
        target_argmax: the target's argmax at each verified row: k + 1 entries, row i predicting the token
            after the anchor and d_1..d_i.

    Returns:
        The accepted count a and the target's token at row a.
    """
    if len(target_argmax) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} target rows, got {len(target_argmax)}")
    a = 0
    while a < len(drafts) and drafts[a] == target_argmax[a]:
        a += 1
    return Acceptance(accepted=a, next_token=target_argmax[a])
