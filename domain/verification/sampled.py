"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), the exact reference.

Accept draft i with probability min(1, p_i(x_i) / q_i(x_i)); on the first rejection draw from
norm(max(0, p_i - q_i)) (p_i when that mass is zero); after a fully accepted block draw the bonus from p.
A one-hot q (deterministic proposals) makes the acceptance probability p_i(x_i) and the residual p_i with
x_i removed. The output is then distributed exactly as the target's own samples.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_dspark.domain.verification.distribution import sample_index
from mlx_dspark.domain.verification.outcome import Acceptance

RESIDUAL_FLOOR = 1e-12


def speculative_accept(
    drafts: Sequence[int],
    p_rows: Sequence[Sequence[float]],
    q_rows: Sequence[Sequence[float]] | None,
    uniforms: Sequence[float],
) -> Acceptance:
    """Reference rejection sampling over one block.

    Args:
        drafts: proposed tokens x_1..x_k.
        p_rows: the target's (truncated, normalized) distributions at the k + 1 verified rows.
        q_rows: the proposal distributions for the k drafts, or None for one-hot proposals.
        uniforms: k + 1 independent U[0, 1) numbers: k accept tests, then one draw.

    Returns:
        The accepted count and the corrected or bonus token.
    """
    k = len(drafts)
    if len(p_rows) != k + 1:
        raise ValueError(f"need {k + 1} target rows, got {len(p_rows)}")
    if len(uniforms) < k + 1:
        raise ValueError(f"need {k + 1} uniforms, got {len(uniforms)}")
    draw = uniforms[k]
    for i, x in enumerate(drafts):
        p = p_rows[i]
        qx = 1.0 if q_rows is None else q_rows[i][x]
        if uniforms[i] * qx < p[x]:
            continue
        if q_rows is None:
            residual = [0.0 if j == x else pj for j, pj in enumerate(p)]
        else:
            residual = [max(0.0, pj - qj) for pj, qj in zip(p, q_rows[i], strict=True)]
        if sum(residual) <= RESIDUAL_FLOOR:
            residual = list(p)
        return Acceptance(accepted=i, next_token=sample_index(residual, draw))
    return Acceptance(accepted=k, next_token=sample_index(p_rows[k], draw))
