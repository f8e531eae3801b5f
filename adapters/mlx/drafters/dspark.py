"""DSpark (drafters.md §3): the shared backbone plus a Markov head (sequential logit bias) and a confidence
head, drafted left to right; every slot from `first_draft_slot` on is a draft.

Slot k's corrected logits are U_k + w2(w1[x_{k−1}]) with x_{−1} = the anchor and x_{k−1} the token actually
drafted at the previous slot, so q_k (the Markov-corrected distribution) is exactly what x_k was drawn
from — the condition for lossless speculative sampling. The confidence c_k = sigmoid(proj([h_k ;
w1[x_{k−1}]])) uses only x_{<k}, so truncating on it is non-anticipating.

`DSparkDrafter` is the trainable module (pure, teacher-forced forward); `DSparkDraftSource` the DraftSource.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx import nn

from mlx_dspark.adapters.mlx import compiled_forward, key_buckets, model_parts
from mlx_dspark.adapters.mlx.drafters import heads
from mlx_dspark.adapters.mlx.drafters.backbone import DrafterBackbone, Positions
from mlx_dspark.adapters.mlx.drafters.checkpoint import check_fits_target
from mlx_dspark.adapters.mlx.drafters.config import DSparkConfig
from mlx_dspark.adapters.mlx.drafters.source import ARGMAX, BackboneDraftSource, pick
from mlx_dspark.adapters.mlx.readback import DeviceTokens
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.drafting.confidence import confident_prefix_length
from mlx_dspark.domain.errors import IncompatibleDrafter
from mlx_dspark.domain.tokens import SamplingParams


class MarkovHead(nn.Module):
    """Vanilla Markov head: bias = markov_w2(markov_w1[previous token]) (w1 over the target vocabulary)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def __call__(self, prev_embedding: mx.array) -> mx.array:
        return self.markov_w2(prev_embedding)


class ConfidenceHead(nn.Module):
    """Logit of "this slot is accepted given every earlier slot was"; the bias is optional (§3.6)."""

    def __init__(self, in_dims: int, bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dims, 1, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)[..., 0]


class DSparkDrafter(DrafterBackbone, heads.DraftVocabulary):
    """The DSpark drafter.

    Args:
        config: the parsed checkpoint config.
        vocab_size: the target vocabulary (rows of w1; columns of every q).
        embed_fn / head_fn: the target's embedding / head, used when the checkpoint ships none.
        own_embedding / own_head: whether the checkpoint ships `embed_tokens` / `lm_head`.
        confidence_bias: whether `confidence_head.proj` has a bias.
        d2t: for a reduced draft vocabulary, offsets mapping draft id d to target id d + d2t[d].
    """

    def __init__(
        self,
        config: DSparkConfig,
        *,
        vocab_size: int,
        embed_fn: heads.ArrayFn | None = None,
        head_fn: heads.ArrayFn | None = None,
        own_embedding: bool = True,
        own_head: bool = True,
        confidence_bias: bool = True,
        d2t: mx.array | None = None,
    ) -> None:
        super().__init__(config.backbone)
        h = config.backbone.hidden_size
        self.dspark_config = config
        self.vocab_size = vocab_size
        self.draft_vocab_size = int(d2t.shape[0]) if d2t is not None else vocab_size
        if own_embedding:
            self.embed_tokens = nn.Embedding(vocab_size, h)
        elif embed_fn is None:
            raise ValueError("a DSpark drafter without embed_tokens needs the target's embedding")
        if own_head:
            self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        elif head_fn is None or d2t is not None:
            raise ValueError("a DSpark drafter without lm_head needs the target's head and the full vocabulary")
        self.embed_fn = embed_fn
        self.head_fn = head_fn
        if config.markov_rank:
            self.markov_head = MarkovHead(vocab_size, self.draft_vocab_size, config.markov_rank)
        if config.confidence_head:
            extra = config.markov_rank if config.confidence_with_markov else 0
            self.confidence_head = ConfidenceHead(h + extra, bias=confidence_bias)
        self.map_draft_vocabulary(d2t)

    @property
    def has_markov(self) -> bool:
        return "markov_head" in self

    @property
    def has_confidence(self) -> bool:
        return "confidence_head" in self

    def embed_block(self, ids: mx.array) -> mx.array:
        if "embed_tokens" in self:
            h = self.embed_tokens(ids)
            scale = self.dspark_config.input_embedding_scale
            return (h * scale if scale is not None else h).astype(self.dtype)
        assert self.embed_fn is not None
        return self.embed_fn(ids).astype(self.dtype)

    def base_logits(self, h: mx.array) -> mx.array:
        """U = head(h) over the draft vocabulary, with the checkpoint's output multiplier / softcap."""
        if "lm_head" not in self:
            assert self.head_fn is not None
            return self.head_fn(h)
        cfg = self.dspark_config
        return heads.own_head_logits(self.lm_head, h, cfg.output_multiplier, cfg.final_logit_softcapping)

    def prev_embedding(self, prev_ids: mx.array) -> mx.array | None:
        """w1[x_{k−1}] for previous-token ids (target vocabulary), or None without a Markov head."""
        if not self.has_markov:
            return None
        # Look up as a 1-D batch: a quantized embedding cannot dequantize a single 0-d index.
        flat = self.markov_head.markov_w1(prev_ids.reshape(-1))
        return flat.reshape(*prev_ids.shape, flat.shape[-1])

    def corrected(self, base: mx.array, prev_emb: mx.array | None) -> mx.array:
        """U_k + B_k (float32)."""
        out = base.astype(mx.float32)
        if prev_emb is not None:
            out = out + self.markov_head(prev_emb).astype(mx.float32)
        return out

    def confidence_logit(self, h: mx.array, prev_emb: mx.array | None) -> mx.array | None:
        """proj([h_k ; w1[x_{k−1}]]) (or proj(h_k)), or None without a confidence head (or, for a head that
        reads the previous tokens, without them)."""
        if not self.has_confidence:
            return None
        x = h
        if self.dspark_config.confidence_with_markov:
            if prev_emb is None:
                return None
            x = mx.concatenate([h, prev_emb.astype(h.dtype)], axis=-1)
        return self.confidence_head(x).astype(mx.float32)

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        """Draft-vocabulary ids → target ids (identity for a full-vocabulary head)."""
        return draft_ids if self._draft_to_target is None else self._draft_to_target[draft_ids]

    def to_target_probs(self, q: mx.array) -> mx.array:
        """Draft-vocabulary distributions [..., V_d] → the same distributions over the target vocabulary."""
        if self._draft_to_target is None:
            return q
        idx = mx.broadcast_to(self._draft_to_target, q.shape)
        return mx.put_along_axis(mx.zeros((*q.shape[:-1], self.vocab_size), dtype=q.dtype), idx, q, axis=-1)

    def __call__(
        self,
        block_ids: mx.array,
        context_features: mx.array | None,
        *,
        positions: Positions,
        context_positions: Positions = 0,
        prev_ids: mx.array | None = None,
        masks: Any = None,
    ) -> tuple[mx.array, mx.array | None]:
        """Pure teacher-forced forward (training and reference).

        Args:
            block_ids: [B, L] block tokens (anchor then masks; several blocks may be concatenated).
            context_features: [B, S, m·H_t] concatenated target features, or None.
            positions / context_positions / masks: as in `DFlashDrafter.__call__`.
            prev_ids: [B, L] previous token per slot (target ids) for the Markov bias and the confidence
                head; in training the ground truth, at inference the drafted tokens. None = no bias.

        Returns:
            Corrected logits [B, L, V_d] (float32) and confidence logits [B, L] (or None).
        """
        h = self.block_hidden(block_ids, context_features, positions, context_positions, masks)
        prev_emb = self.prev_embedding(prev_ids) if prev_ids is not None else None
        return self.corrected(self.base_logits(h), prev_emb), self.confidence_logit(h, prev_emb)

    @classmethod
    def assemble(
        cls, config: DSparkConfig, weights: Mapping[str, mx.array], target_model: nn.Module, *, where: str
    ) -> tuple[DSparkDrafter, Mapping[str, mx.array]]:
        own_embedding = "embed_tokens.weight" in weights
        weights = dict(weights)
        if "d2t" in weights and "lm_head.weight" not in weights:
            # This project's reduced heads ship no rows: they are the target head's rows of the d2t ids.
            mapped_rows = heads.mapped_ids(weights["d2t"])
            if (
                int(mx.max(mapped_rows).item()) < model_parts.vocab_size(target_model)
                and int(mx.min(mapped_rows).item()) >= 0
            ):
                weights["lm_head.weight"] = model_parts.head_rows(target_model, mapped_rows)
        own_head = "lm_head.weight" in weights
        check_fits_target(
            config.backbone, target_model, uses_target_vocab=not (own_embedding and own_head), where=where
        )
        vocab = model_parts.vocab_size(target_model)
        d2t = heads.checked_d2t(weights, config.draft_vocab_size, vocab, where=where)
        if own_head and weights["lm_head.weight"].shape[0] != (vocab if d2t is None else d2t.shape[0]):
            raise IncompatibleDrafter(
                message=f"{where}: its lm_head has {weights['lm_head.weight'].shape[0]} rows, "
                f"the target vocabulary {vocab}"
            )
        drafter = cls(
            config,
            vocab_size=vocab,
            embed_fn=None if own_embedding else heads.target_embedding(target_model, config.input_embedding_scale),
            head_fn=None
            if own_head
            else heads.target_head(target_model, config.output_multiplier, config.final_logit_softcapping),
            own_embedding=own_embedding,
            own_head=own_head,
            confidence_bias="confidence_head.proj.bias" in weights,
            d2t=d2t,
        )
        return drafter, {k: v for k, v in weights.items() if k != "d2t"}


class DSparkDraftSource(BackboneDraftSource):
    """DraftSource over a `DSparkDrafter`: one backbone forward and the Markov chain queued on
    the device; the target reads the tokens back with its verdict (a confidence threshold reads once more).

    Args:
        drafter: the loaded drafter.
        proposal: "sample" (draw from the Markov-corrected q, report q) or "argmax" (one-hot q).
        confidence_threshold: > 0 truncates the block where the running confidence product drops below it.
    """

    drafter: DSparkDrafter

    def __init__(self, drafter: DSparkDrafter, *, proposal: str = "sample", confidence_threshold: float = 0.0) -> None:
        super().__init__(drafter, proposal=proposal)
        if confidence_threshold > 0 and not drafter.has_confidence:
            raise ValueError("a confidence threshold needs a drafter with a confidence head")
        self.confidence_threshold = confidence_threshold
        self.last_confidences: list[float] = []
        self._compile = compiled_forward.enabled(key_buckets.enabled())
        self._chains: dict[tuple[Any, ...], Any] = {}  # compiled greedy chains per (h shape, anchors shape)

    @property
    def name(self) -> str:
        return "dspark"

    @property
    def max_block(self) -> int:
        return self.drafter.config.block_size - self.drafter.dspark_config.first_draft_slot

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        """Up to `cap` drafts, left to right through the Markov head; truncated on confidence if enabled."""
        n = self.round_size(ctx, cap)
        if n == 0:
            return DraftBlock(source=self.name)
        d = self.drafter
        first = d.dspark_config.first_draft_slot
        h = self.cache.block_hidden(self.block_ids(ctx.anchor), ctx.position)[0, first : first + n]
        sampled = self.sampled(sampling)
        u = mx.array(list(uniforms[:n]), dtype=mx.float32) if sampled else None
        token_arr, qs, conf_arr = self._chain(h, mx.array(ctx.anchor, dtype=mx.int32), sampling, u)
        q_arr = d.to_target_probs(mx.stack(qs)) if qs else None
        # Queued, not read: the verify reads the tokens back with its verdict. Only a confidence
        # threshold waits here, since the block's width depends on it.
        mx.async_eval(token_arr, *(a for a in (q_arr, conf_arr) if a is not None), *self.cache.state())
        block = DraftBlock(pending=DeviceTokens(token_arr), q=q_arr, source=self.name)
        if conf_arr is not None:
            block = self.truncate_on_confidence(block, cast(list[float], conf_arr.tolist()))
        return block

    def truncate_on_confidence(self, block: DraftBlock, confidences: list[float]) -> DraftBlock:
        self.last_confidences = confidences
        return block.truncated(confident_prefix_length(confidences, self.confidence_threshold))

    def _chain(
        self, h: mx.array, anchor: mx.array, sampling: SamplingParams, u: mx.array | None
    ) -> tuple[mx.array, list[mx.array], mx.array | None]:
        """The Markov chain over slots of hidden states `h` [..., n, H] after `anchor` [...]: the drafted target
        ids [..., n], each sampled slot's q (over draft ids), and the confidences [..., n] when thresholded.

        Where verifies run compiled (`compiled_forward`), a greedy chain is one compiled graph per shape too:
        its n sequential steps are otherwise n rounds of small graphs the host builds while the device waits."""
        want_conf = self.confidence_threshold > 0
        if u is None and self._compile:
            key = (tuple(h.shape), tuple(anchor.shape), want_conf)
            chain = self._chains.get(key)
            if chain is None:
                chain = self._chains[key] = mx.compile(lambda h, a: self._greedy_chain(h, a, want_conf))
            tokens, *conf = chain(h, anchor)
            return tokens, [], conf[0] if conf else None
        return self._steps(h, anchor, sampling, u, want_conf)

    def _greedy_chain(self, h: mx.array, anchor: mx.array, want_conf: bool) -> list[mx.array]:
        tokens, _, conf = self._steps(h, anchor, ARGMAX, None, want_conf)
        return [tokens] if conf is None else [tokens, conf]

    def _steps(
        self, h: mx.array, anchor: mx.array, sampling: SamplingParams, u: mx.array | None, want_conf: bool
    ) -> tuple[mx.array, list[mx.array], mx.array | None]:
        d = self.drafter
        base = d.base_logits(h)
        prev = anchor
        tokens, qs, confs = [], [], []
        for k in range(int(h.shape[-2])):
            prev_emb = d.prev_embedding(prev)
            x, q = pick(d.corrected(base[..., k, :], prev_emb), sampling, None if u is None else u[k])
            if want_conf:
                c = d.confidence_logit(h[..., k, :], prev_emb)
                assert c is not None
                confs.append(mx.sigmoid(c))
            prev = d.to_target_ids(x)
            tokens.append(prev)
            if q is not None:
                qs.append(q)
        return mx.stack(tokens, axis=-1), qs, mx.stack(confs, axis=-1) if confs else None

    @property
    def first_slot(self) -> int:
        return self.drafter.dspark_config.first_draft_slot

    def greedy_slots(self, h: mx.array, anchors: mx.array) -> tuple[mx.array, mx.array | None]:
        tokens, _, confidences = self._chain(h, anchors, ARGMAX, None)
        return tokens, confidences
