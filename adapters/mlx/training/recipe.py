"""The distillation recipe of drafters.md §2.4 / §3.4: random anchors, the block training mask and the
position-decayed losses (DFlash CE; DSpark 0.1·CE + 0.9·L1 + confidence BCE).

Batches are laid out on the host with numpy (a seeded `Generator` drives every random choice, so a resumed
run draws exactly what an uninterrupted one would) and moved to the device once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

IGNORE = -1  # label of an unsupervised slot


@attrs.frozen(kw_only=True)
class BlockLayout:
    """How a drafter kind reads a block.

    Attributes:
        block_size: anchor + masks.
        first_slot: first supervised slot (DFlash 1, DSpark 0).
        shift: slot k predicts the token at anchor + k + shift (DFlash 0, DSpark 1).
        gamma: loss decay; slot weight exp(−(k − first_slot)/gamma).
    """

    block_size: int
    first_slot: int
    shift: int
    gamma: float

    @classmethod
    def for_kind(cls, kind: str, block_size: int) -> BlockLayout:
        if kind == "dflash":
            # γ = 7 for bs 16, 5 for bs 10, 4 for bs 8 (§2.4): about half the draft count.
            return cls(block_size=block_size, first_slot=1, shift=0, gamma=max(1.0, (block_size - 1) / 2))
        return cls(block_size=block_size, first_slot=0, shift=1, gamma=4.0)

    @property
    def slots(self) -> int:
        """Supervised slots per block."""
        return self.block_size - self.first_slot

    def weights(self) -> np.ndarray:
        k = np.arange(self.slots, dtype=np.float32)
        return np.exp(-k / self.gamma).astype(np.float32)


@attrs.frozen(kw_only=True)
class TrainSequence:
    """One training sequence: prompt + target response token ids, and where the response starts."""

    tokens: tuple[int, ...]
    prompt_len: int


def anchor_range(seq_len: int, prompt_len: int, layout: BlockLayout) -> tuple[int, int]:
    """Valid anchors [lo, hi): response tokens whose first supervised label exists.

    The anchor is a committed token whose own feature row is not yet known, exactly as at inference where
    the first anchor is the first response token (position = prompt length).
    """
    lo = max(prompt_len, 1)
    hi = seq_len - (layout.first_slot + layout.shift)
    return lo, max(lo, hi)


def sample_anchors(rng: np.random.Generator, seq_len: int, prompt_len: int, n: int, layout: BlockLayout) -> np.ndarray:
    """Up to `n` distinct anchors drawn uniformly from the valid range, sorted."""
    lo, hi = anchor_range(seq_len, prompt_len, layout)
    count = hi - lo
    if count <= 0:
        return np.zeros((0,), dtype=np.int64)
    picked = rng.choice(count, size=min(n, count), replace=False) + lo
    return np.sort(picked)


@attrs.frozen(kw_only=True)
class HostBatch:
    """One step's arrays, on the host.

    Attributes:
        ctx_ids: [B, S] right-padded token ids (the target reads them; context rows for the drafter).
        block_ids: [B, N·bs] anchor + masks per block.
        positions: [B, N·bs] absolute position of every block row.
        mask: [B, 1, N·bs, S + N·bs] True = attend (context strictly before the block's anchor; own block).
        labels: [B, N, slots] target ids of supervised slots (IGNORE elsewhere).
        prev_ids: [B, N, slots] token before each supervised slot's label (DSpark's teacher-forced Markov input).
        target_rows: [B, N, slots] index of the target row whose next-token distribution is the slot's
            teacher (label position − 1), clipped into range.
        tokens: supervised slots in the batch.
    """

    ctx_ids: np.ndarray
    block_ids: np.ndarray
    positions: np.ndarray
    mask: np.ndarray
    labels: np.ndarray
    prev_ids: np.ndarray
    target_rows: np.ndarray
    tokens: int


def build_batch(
    seqs: Sequence[TrainSequence],
    *,
    layout: BlockLayout,
    anchors: int,
    mask_token_id: int,
    rng: np.random.Generator,
    pad_id: int = 0,
    bucket: int = 0,
) -> HostBatch:
    """Lay out one training step (§2.4): N random anchors per sequence, each a block [anchor, MASK × (bs−1)].

    Args:
        seqs: the step's sequences.
        layout: the kind's block layout.
        anchors: anchors per sequence (fewer when a response is short; missing blocks are padding).
        mask_token_id: the mask token.
        rng: the run's random generator (advanced here).
        pad_id: id used for right padding.
        bucket: > 0 pads the context length up to a multiple of it and always lays out `anchors` blocks,
            so a compiled step sees few distinct shapes.
    """
    bs, slots = layout.block_size, layout.slots
    b = len(seqs)
    s = max(len(x.tokens) for x in seqs)
    drawn = [sample_anchors(rng, len(x.tokens), x.prompt_len, anchors, layout) for x in seqs]
    n = max(1, *(len(a) for a in drawn))
    if bucket > 0:
        s = -(-s // bucket) * bucket
        n = max(n, anchors)
    q = n * bs
    ctx_ids = np.full((b, s), pad_id, dtype=np.int32)
    block_ids = np.full((b, n, bs), mask_token_id, dtype=np.int32)
    positions = np.zeros((b, n, bs), dtype=np.int32)
    labels = np.full((b, n, slots), IGNORE, dtype=np.int32)
    prev_ids = np.zeros((b, n, slots), dtype=np.int32)
    target_rows = np.zeros((b, n, slots), dtype=np.int32)
    mask = np.zeros((b, n, bs, s + q), dtype=bool)
    own = np.arange(q).reshape(n, bs)  # block-row index of each block's rows
    for i, (x, picks) in enumerate(zip(seqs, drawn, strict=True)):
        toks = np.asarray(x.tokens, dtype=np.int32)
        length = len(toks)
        ctx_ids[i, :length] = toks
        for j in range(n):
            rows = own[j]
            mask[i, j, :, s + rows[0] : s + rows[-1] + 1] = True  # own block, bidirectional
            if j >= len(picks):
                positions[i, j] = np.arange(bs)
                continue
            a = int(picks[j])
            block_ids[i, j, 0] = toks[a]
            positions[i, j] = np.arange(a, a + bs)
            mask[i, j, :, :a] = True  # context strictly before the anchor
            label_pos = a + np.arange(layout.first_slot, bs) + layout.shift
            ok = label_pos < length
            labels[i, j, ok] = toks[label_pos[ok]]
            prev_ids[i, j] = toks[np.minimum(label_pos - 1, length - 1)]
            target_rows[i, j] = np.minimum(label_pos - 1, length - 1)
    return HostBatch(
        ctx_ids=ctx_ids,
        block_ids=block_ids.reshape(b, q),
        positions=positions.reshape(b, q),
        mask=mask.reshape(b, 1, q, s + q),
        labels=labels,
        prev_ids=prev_ids,
        target_rows=target_rows,
        tokens=int((labels != IGNORE).sum()),
    )


def to_device(batch: HostBatch) -> dict[str, Any]:
    """The batch as MLX arrays (labels, prev ids and rows keep their [B, N, slots] shape)."""
    return {f.name: mx.array(getattr(batch, f.name)) for f in attrs.fields(HostBatch) if f.name != "tokens"}


def _weighted_mean(values: mx.array, weights: mx.array) -> mx.array:
    return (values * weights).sum() / mx.maximum(weights.sum(), 1e-6)


def slot_weights(labels: mx.array, layout: BlockLayout) -> mx.array:
    """Decay weight per supervised slot, zero where unsupervised."""
    decay = mx.array(layout.weights())
    return mx.where(labels != IGNORE, decay, 0.0)


def dflash_loss(logits: mx.array, labels: mx.array, layout: BlockLayout) -> tuple[mx.array, dict[str, mx.array]]:
    """Position-decayed cross-entropy (§2.4).

    Args:
        logits: [B, N, slots, V] drafter logits of the supervised slots.
        labels: [B, N, slots] target ids (IGNORE = unsupervised).
    """
    w = slot_weights(labels, layout)
    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, mx.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    ce = mx.logsumexp(logits, axis=-1) - picked
    loss = _weighted_mean(ce, w)
    hit = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32)
    return loss, {"ce": loss, "acc": _weighted_mean(hit, (labels != IGNORE).astype(mx.float32))}


def dspark_loss(
    logits: mx.array,
    conf_logits: mx.array | None,
    labels_draft: mx.array,
    labels: mx.array,
    teacher: mx.array,
    teacher_outside: mx.array,
    layout: BlockLayout,
    *,
    ce_alpha: float = 0.1,
    l1_alpha: float = 0.9,
    conf_alpha: float = 1.0,
) -> tuple[mx.array, dict[str, mx.array]]:
    """0.1·CE + 0.9·L1 + 1.0·BCE(confidence), each a decayed weighted mean (§3.4).

    Args:
        logits: [B, N, slots, V_d] Markov-corrected drafter logits over the draft vocabulary.
        conf_logits: [B, N, slots] confidence logits, or None.
        labels_draft: [B, N, slots] labels as draft-vocabulary ids (IGNORE when outside it or unsupervised).
        labels: [B, N, slots] labels as target ids (IGNORE = unsupervised).
        teacher: [B, N, slots, V_d] the target's next-token probabilities restricted to the draft vocabulary.
        teacher_outside: [B, N, slots] the target's probability mass outside the draft vocabulary.
    """
    w = slot_weights(labels, layout)
    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, mx.maximum(labels_draft, 0)[..., None], axis=-1)[..., 0]
    ce = _weighted_mean(-picked, mx.where(labels_draft != IGNORE, w, 0.0))
    # ‖p_d − p_t‖₁ over the full vocabulary: p_d is zero outside the draft vocabulary.
    l1_rows = mx.abs(mx.exp(logp) - teacher).sum(axis=-1) + teacher_outside
    l1 = _weighted_mean(l1_rows, w)
    loss = ce_alpha * ce + l1_alpha * l1
    parts = {"ce": ce, "l1": l1}
    if conf_logits is not None:
        soft = mx.stop_gradient(1.0 - 0.5 * l1_rows)
        z = conf_logits.astype(mx.float32)
        bce = mx.maximum(z, 0) - z * soft + mx.log1p(mx.exp(-mx.abs(z)))
        conf = _weighted_mean(bce, w)
        loss = loss + conf_alpha * conf
        parts["conf"] = conf
    hit = (mx.argmax(logits, axis=-1) == labels_draft).astype(mx.float32)
    parts["acc"] = _weighted_mean(hit, (labels != IGNORE).astype(mx.float32))
    return loss, parts


def teacher_forced_tau(hits: np.ndarray, supervised: np.ndarray) -> float:
    """1 + the mean length of each block's leading run of correct slots (greedy, bonus included).

    Args:
        hits: [blocks, slots] argmax == label.
        supervised: [blocks, slots] the slot has a label.
    """
    ok = hits & supervised
    run = np.cumprod(ok, axis=1).sum(axis=1)
    valid = supervised[:, 0]
    return float(1.0 + run[valid].mean()) if valid.any() else 1.0
