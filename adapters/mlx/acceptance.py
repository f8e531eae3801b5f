"""On-device sampling and speculative acceptance, pinned to domain.verification by tests/contract.

Same rules as `distribution` (temperature → top-k → top-p, ties to the lower index), `sample_index`
(inverse CDF) and `speculative_accept`, vectorized over the vocabulary; nothing here syncs with the host.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.sampled import RESIDUAL_FLOOR


def descending_order(logits: mx.array) -> mx.array:
    """Indices that sort each row by value, largest first, equal values by lower index first.

    Sort stability differs between backends, so the tie-break is folded into a unique int64 key:
    the float's order-preserving integer image, shifted left, plus the column index.
    """
    vocab = logits.shape[-1]
    x = mx.where(logits == 0, 0.0, logits.astype(mx.float32))  # -0.0 ties with +0.0, as in Python
    bits = x.view(mx.int32)
    # Negative floats order backwards as integers; flipping their magnitude bits fixes that.
    monotone = mx.where(bits < 0, mx.bitwise_xor(bits, 0x7FFFFFFF), bits).astype(mx.int64)
    shift = 1 << max(1, (vocab - 1).bit_length())
    key = (-monotone) * shift + mx.arange(vocab, dtype=mx.int64)
    return mx.argsort(key, axis=-1)


def truncated_probs(logits: mx.array, sampling: SamplingParams) -> mx.array:
    """The normalized distributions `sampling` draws from, one per row (float32, [..., V]).

    Greedy sampling gives the one-hot argmax rows, as `domain.verification.distribution` does.
    """
    x = logits.astype(mx.float32)
    vocab = x.shape[-1]
    if sampling.greedy:
        return (mx.arange(vocab) == mx.argmax(x, axis=-1, keepdims=True)).astype(mx.float32)
    weights = mx.exp((x - x.max(axis=-1, keepdims=True)) / sampling.temperature)
    use_k = 0 < sampling.top_k < vocab
    use_p = sampling.top_p < 1.0
    if use_k or use_p:
        order = descending_order(x)
        ranked = mx.take_along_axis(weights, order, axis=-1)
        if use_k:
            ranked = mx.where(mx.arange(vocab) < sampling.top_k, ranked, 0.0)
        if use_p:
            share = ranked / ranked.sum(axis=-1, keepdims=True)
            # A token stays when the mass strictly before it (in sorted order) is still short of top_p.
            before = mx.cumsum(share, axis=-1, inclusive=False)
            ranked = mx.where(before < sampling.top_p, ranked, 0.0)
        weights = mx.put_along_axis(mx.zeros_like(weights), order, ranked, axis=-1)
    return weights / weights.sum(axis=-1, keepdims=True)


def sample_index(row: mx.array, u: mx.array) -> mx.array:
    """Inverse-CDF draw from one unnormalized non-negative row [V] with a uniform u (scalar array)."""
    positive = row > 0
    target = u * row.sum()
    hit = (mx.cumsum(row) > target) & positive
    first_hit = mx.argmax(hit.astype(mx.int32))
    vocab = row.shape[-1]
    # Rounding can leave the target at or past the total: the reference then returns the last positive.
    last_positive = vocab - 1 - mx.argmax(positive[::-1].astype(mx.int32))
    return mx.where(hit.any(), first_hit, last_positive).astype(mx.int32)


def as_q_rows(q: Any, k: int) -> mx.array | None:
    """A draft block's q handle as a float32 [k, V] array (None stays None: one-hot proposals)."""
    if q is None:
        return None
    rows = q if isinstance(q, mx.array) else mx.array(q)
    return rows[:k].astype(mx.float32)


def speculative_accept(p: mx.array, drafts: mx.array, q: mx.array | None, uniforms: mx.array) -> mx.array:
    """Rejection sampling over one block, on device.

    Args:
        p: the target's truncated distributions at the k + 1 verified rows, [k + 1, V].
        drafts: the proposed tokens, int32 [k].
        q: the proposal distributions [k, V], or None for one-hot proposals.
        uniforms: k + 1 uniforms, float32: k accept tests, then one draw.

    Returns:
        int32 [2]: the accepted count and the corrected or bonus token.
    """
    k = drafts.shape[0]
    if k == 0:
        return mx.stack([mx.array(0, mx.int32), sample_index(p[0], uniforms[0])])
    rows = mx.arange(k)
    px = p[rows, drafts]
    qx = mx.ones_like(px) if q is None else q[rows, drafts]
    passed = (uniforms[:k] * qx < px).astype(mx.int32)
    accepted = mx.cumprod(passed).sum()
    at = mx.minimum(accepted, k - 1)  # the rejected draft's row (clamped when all passed; unused then)
    p_at = p[accepted]
    if q is None:
        residual = mx.where(mx.arange(p.shape[-1]) == drafts[at], 0.0, p[at])
    else:
        residual = mx.maximum(p[at] - q[at], 0.0)
    residual = mx.where(residual.sum() <= RESIDUAL_FLOOR, p[at], residual)
    row = mx.where(accepted < k, residual, p_at)
    return mx.stack([accepted.astype(mx.int32), sample_index(row, uniforms[k])])


def greedy_accept(logits: mx.array, drafts: mx.array) -> mx.array:
    """Verdict of one greedy round from raw logits [k + 1, V]: int32 [accepted, next_token].

    The longest prefix of drafts equal to the argmax rows, then the argmax after it
    (`domain.verification.greedy.longest_accepted_prefix`).
    """
    best = mx.argmax(logits, axis=-1).astype(mx.int32)
    k = drafts.shape[0]
    if k == 0:
        return mx.stack([mx.array(0, mx.int32), best[0]])
    accepted = mx.cumprod((best[:k] == drafts.astype(mx.int32)).astype(mx.int32)).sum().astype(mx.int32)
    return mx.stack([accepted, mx.take(best, accepted)])


def accept_block(
    logits: mx.array, drafts: mx.array, q: mx.array | None, uniforms: mx.array, sampling: SamplingParams
) -> mx.array:
    """Verdict of one sampled round from raw logits [k + 1, V]: int32 [accepted, next_token]."""
    return speculative_accept(truncated_probs(logits, sampling), drafts, q, uniforms)


def pick_token(logits: mx.array, sampling: SamplingParams, uniform: float) -> mx.array:
    """One token from a row of raw logits [V]: the argmax when greedy, else the inverse-CDF draw."""
    if sampling.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    p = truncated_probs(logits[None], sampling)[0]
    return sample_index(p, mx.array(uniform, mx.float32))
