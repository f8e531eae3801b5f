"""The distillation recipe of drafters.md §2.4 / §3.4: random anchors, the block training mask and the
position-decayed losses (DFlash CE; DSpark 0.1·CE + 0.9·L1 + confidence BCE), with optional soft targets
(KL to the target's distribution over the draft vocabulary).

The host draws only what is random: the anchors of each sequence (a seeded `Generator` drives every choice,
so a resumed run draws exactly what an uninterrupted one would). `AnchorBatch` carries them with the padded
token ids; `expand` lays out blocks, labels, Markov inputs and teacher rows on the device, inside the
compiled step, exactly as `build_batch` (the host reference, kept for tests) does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    def for_kind(cls, kind: str, block_size: int, gamma: float | None = None) -> BlockLayout:
        """The kind's layout; `gamma` replaces the published decay (DFlash (bs − 1)/2, DSpark 4) when given."""
        if kind == "dflash":
            # γ = 7 for bs 16, 5 for bs 10, 4 for bs 8 (§2.4): about half the draft count.
            return cls(block_size=block_size, first_slot=1, shift=0, gamma=gamma or max(1.0, (block_size - 1) / 2))
        return cls(block_size=block_size, first_slot=0, shift=1, gamma=gamma or 4.0)

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


def bucket_length(n: int) -> int:
    """A compiled step's padded length for `n` rows: a multiple of 128 up to 512, of 256 beyond. Each shape is
    a trace and, on a GPU, kernels compiled anew (seconds each), so few shapes beat tight padding."""
    step = 128 if n <= 512 else 256
    return -(-max(1, n) // step) * step


@attrs.frozen(kw_only=True)
class AnchorBatch:
    """One step's host arrays: what is random (the anchors) and the padded token ids; `expand` does the rest.

    Attributes:
        ctx_ids: [B, S] right-padded token ids.
        anchors: [B, N] anchor positions, −1 for a padding block (a short response has fewer anchors).
        lengths: [B] sequence lengths.
        window: [B, R] the rows whose next-token distribution some slot's teacher is: the response rows
            `lo .. lo + R − 1` of each sequence (lo = its first anchor position), clipped to its last row.
        tokens: supervised slots in the batch.
    """

    ctx_ids: np.ndarray
    anchors: np.ndarray
    lengths: np.ndarray
    window: np.ndarray
    tokens: int

    def arrays(self) -> dict[str, mx.array]:
        """The batch as MLX arrays (the inputs of a compiled step)."""
        return {f.name: mx.array(getattr(self, f.name)) for f in attrs.fields(AnchorBatch) if f.name != "tokens"}


def response_window(seqs: Sequence[TrainSequence], layout: BlockLayout) -> int:
    """Teacher rows one sequence needs at most: from its first anchor to its last row (rounded up to 32; one
    shape for the whole run)."""
    longest = max((len(x.tokens) - max(x.prompt_len, 1) for x in seqs), default=1)
    return -(-max(1, longest) // 32) * 32


def anchor_batch(
    seqs: Sequence[TrainSequence],
    *,
    layout: BlockLayout,
    anchors: int,
    rng: np.random.Generator,
    window: int,
    pad_id: int = 0,
    bucket: bool = True,
) -> AnchorBatch:
    """Draw one step's anchors (the same draws as `build_batch`) and pad the token ids.

    Args:
        seqs: the step's sequences.
        layout: the kind's block layout.
        anchors: anchors per sequence (fewer when a response is short; missing blocks are padding).
        rng: the run's random generator (advanced here exactly as `build_batch` advances it).
        window: R, teacher rows per sequence (`response_window` over the whole data, so one shape).
        pad_id: id used for right padding.
        bucket: pad the length with `bucket_length` and always lay out `anchors` blocks (few compiled shapes).
    """
    b = len(seqs)
    s = max(len(x.tokens) for x in seqs)
    drawn = [sample_anchors(rng, len(x.tokens), x.prompt_len, anchors, layout) for x in seqs]
    n = max(1, *(len(a) for a in drawn))
    if bucket:
        s, n = bucket_length(s), max(n, anchors)
    ctx_ids = np.full((b, s), pad_id, dtype=np.int32)
    picks = np.full((b, n), -1, dtype=np.int32)
    lengths = np.zeros((b,), dtype=np.int32)
    tokens = 0
    offsets = np.arange(layout.first_slot, layout.block_size) + layout.shift
    for i, (x, a) in enumerate(zip(seqs, drawn, strict=True)):
        length = len(x.tokens)
        ctx_ids[i, :length] = x.tokens
        picks[i, : len(a)] = a
        lengths[i] = length
        tokens += int((a[:, None] + offsets[None, :] < length).sum())
    lo = np.array([max(x.prompt_len, 1) for x in seqs], dtype=np.int32)
    rows = np.minimum(lo[:, None] + np.arange(window, dtype=np.int32)[None, :], lengths[:, None] - 1)
    return AnchorBatch(ctx_ids=ctx_ids, anchors=picks, lengths=lengths, window=rows.astype(np.int32), tokens=tokens)


def expand(batch: Mapping[str, mx.array], layout: BlockLayout, mask_token_id: int) -> dict[str, mx.array]:
    """The block layout of `build_batch`, computed on the device from an `AnchorBatch`'s arrays.

    Returns:
        block_ids / positions [B, N·bs]; labels, prev_ids, target_rows [B, N, slots] (as `HostBatch`);
        window_index [B, N, slots]: where each slot's teacher row sits in `window`; visible [B, 1, N·bs, S]:
        context row j is visible to a block row iff j < its anchor (none for a padding block).
    """
    ctx, anchors, lengths = batch["ctx_ids"], batch["anchors"], batch["lengths"]
    b, s = ctx.shape
    n, bs = anchors.shape[1], layout.block_size
    real = anchors >= 0
    a = mx.maximum(anchors, 0)
    k = mx.arange(bs, dtype=mx.int32)
    positions = mx.where(real[..., None], a[..., None] + k, k)
    first = mx.where(real, mx.take_along_axis(ctx, a, axis=1), mask_token_id)
    rest = mx.full((b, n, bs - 1), mask_token_id, dtype=ctx.dtype)
    block_ids = mx.concatenate([first[..., None], rest], axis=-1)
    label_pos = a[..., None] + (mx.arange(layout.first_slot, bs, dtype=mx.int32) + layout.shift)
    last = (lengths - 1)[:, None, None]
    flat = label_pos.reshape(b, -1)
    ok = real[..., None] & (label_pos < lengths[:, None, None])
    picked = mx.take_along_axis(ctx, mx.minimum(flat, s - 1), axis=1).reshape(label_pos.shape)
    labels = mx.where(ok, picked, IGNORE)
    rows = mx.minimum(label_pos - 1, last)
    prev = mx.take_along_axis(ctx, rows.reshape(b, -1), axis=1).reshape(rows.shape)
    prev_ids = mx.where(real[..., None], prev, 0)
    target_rows = mx.where(real[..., None], rows, 0)
    lo = batch["window"][:, :1, None]
    window_index = mx.clip(target_rows - lo, 0, batch["window"].shape[1] - 1)
    anchor_rows = mx.repeat(mx.where(real, a, 0), bs, axis=1)  # [B, N·bs]; 0 hides every context row
    visible = mx.arange(s, dtype=mx.int32)[None, None, :] < anchor_rows[..., None]
    return {
        "block_ids": block_ids.reshape(b, n * bs),
        "positions": positions.reshape(b, n * bs),
        "labels": labels,
        "prev_ids": prev_ids,
        "target_rows": target_rows,
        "window_index": window_index,
        "visible": visible[:, None],
    }


def dense_mask(visible: mx.array, block_size: int) -> mx.array:
    """[B, 1, q, S + q] boolean mask of `build_batch` from `expand`'s `visible` (context, then own block)."""
    q = visible.shape[2]
    blk = mx.arange(q) // block_size
    own = blk[:, None] == blk[None, :]
    return mx.concatenate([visible, mx.broadcast_to(own, (*visible.shape[:2], q, q))], axis=-1)


def _weighted_mean(values: mx.array, weights: mx.array) -> mx.array:
    return (values * weights).sum() / mx.maximum(weights.sum(), 1e-6)


def slot_weights(labels: mx.array, layout: BlockLayout) -> mx.array:
    """Decay weight per supervised slot, zero where unsupervised."""
    decay = mx.array(layout.weights())
    return mx.where(labels != IGNORE, decay, 0.0)


def kl_to_teacher(logp: mx.array, teacher: mx.array) -> mx.array:
    """KL(teacher ‖ drafter) per slot over the draft vocabulary: Σ t·(log t − log p_d).

    Args:
        logp: [..., V_d] drafter log-probabilities.
        teacher: [..., V_d] the target's next-token distribution renormalized over the draft vocabulary.
    """
    t_log_t = mx.where(teacher > 0, teacher * mx.log(mx.maximum(teacher, 1e-30)), 0.0)
    return (t_log_t - teacher * logp).sum(axis=-1)


def dflash_loss(
    logits: mx.array,
    labels: mx.array,
    layout: BlockLayout,
    *,
    teacher: mx.array | None = None,
    supervised: mx.array | None = None,
    kl_weight: float = 0.0,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Position-decayed cross-entropy (§2.4); with `kl_weight` > 0, (1 − w)·CE + w·KL(teacher ‖ drafter).

    Args:
        logits: [B, N, slots, V] drafter logits of the supervised slots.
        labels: [B, N, slots] target ids (IGNORE = unsupervised).
        teacher: [B, N, slots, V] the target's distribution renormalized over the drafter's vocabulary.
        supervised: [B, N, slots] labels as target ids (IGNORE = unsupervised): the KL's slots, also those
            whose label lies outside a reduced draft vocabulary.
        kl_weight: share of the soft-target term.
    """
    w = slot_weights(labels, layout)
    logits = logits.astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1)
    picked = mx.take_along_axis(logits, mx.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    ce = _weighted_mean(lse - picked, w)
    loss = ce
    parts = {"ce": ce}
    if kl_weight > 0 and teacher is not None:
        kl = _weighted_mean(kl_to_teacher(logits - lse[..., None], teacher), slot_weights(supervised, layout))
        loss = (1.0 - kl_weight) * ce + kl_weight * kl
        parts["kl"] = kl
    hit = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32)
    parts["acc"] = _weighted_mean(hit, (labels != IGNORE).astype(mx.float32))
    return loss, parts


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
    kl_weight: float = 0.0,
) -> tuple[mx.array, dict[str, mx.array]]:
    """0.1·CE + 0.9·L1 + 1.0·BCE(confidence), each a decayed weighted mean (§3.4); with `kl_weight` > 0 plus
    kl_weight·KL(teacher renormalized over the draft vocabulary ‖ drafter).

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
    if kl_weight > 0:
        inside = teacher / mx.maximum(teacher.sum(axis=-1, keepdims=True), 1e-12)
        kl = _weighted_mean(kl_to_teacher(logp, inside), w)
        loss = loss + kl_weight * kl
        parts["kl"] = kl
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
