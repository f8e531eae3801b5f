"""The KV-injection backbone shared by DFlash and DSpark (drafters.md §2.1, §3.1), written once.

`fc` fuses the concatenated target-layer features, `hidden_norm` normalizes them, and every drafter layer
uses the fused rows as extra keys/values (same k/v projections and k_norm as the block; queries only from
the block). RoPE puts context rows at their absolute positions and the block at anchor_pos... Full layers
attend bidirectionally over the block and every context row; sliding layers are causal in the block
(unless the checkpoint says otherwise) and see only the last `sliding_window` positions.

Two layer layouts, chosen by the parsed config: Qwen3's (pre-norm residuals, SwiGLU) and Gemma-4's
(`Gemma4DSparkModel`: sandwich norms scaled by `layer_scalar`, values normalized without a scale and, with
`attention_k_eq_v`, taken from the key projection, attention scale 1, GELU-tanh MLP, proportional RoPE).

Two ways in: a pure forward (`DrafterBackbone.hidden`, explicit positions and masks, for training) and
`ContextCache`, the inference cache that holds K/V of verified context rows only and so never rolls back.
Training lays many blocks side by side in one row; `BlockwiseMask` attends them without the dense
[blocks × blocks] part of the mask, where all but each block's own square is hidden.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self

import attrs
import mlx.core as mx
from mlx import nn
from mlx_lm.models.rope_utils import initialize_rope

from mlx_dspark.adapters.mlx import compiled_forward, key_buckets
from mlx_dspark.adapters.mlx.drafters.checkpoint import load_strict, prepare
from mlx_dspark.adapters.mlx.drafters.config import GEMMA4, SLIDING, BackboneConfig

Positions = int | mx.array
KV = tuple[mx.array, mx.array]


@attrs.frozen
class BlockwiseMask:
    """Training attention of N blocks of `block_size` rows laid side by side: block row i sees context row j
    iff `visible[..., i, j]` and the rows of its own block only.

    The same softmax as the dense mask [context visibility ; own-block squares] over S + N·bs keys, computed
    over S + bs keys per row: the [N·bs × N·bs] square, all hidden but its diagonal blocks, is never formed.

    Attributes:
        visible: [B, 1, N·bs, S] boolean, the context rows each block row sees.
        block_size: rows per block.
    """

    visible: mx.array
    block_size: int

    def attend(self, q: mx.array, k: mx.array, v: mx.array, context: KV, scale: float) -> mx.array:
        """softmax over [context ; own block] of q·kᵀ·scale, times the values; q [B, h, q, D], k/v the block's
        [B, kv, q, D], `context` [B, kv, S, D]; grouped-query heads share their kv head."""
        b, h, rows, d = q.shape
        kv, bs = k.shape[1], self.block_size
        n, rep = rows // bs, h // kv
        qg = (q * scale).reshape(b, kv, rep, rows, d)
        ck, cv = context[0].astype(q.dtype)[:, :, None], context[1].astype(q.dtype)[:, :, None]
        s_ctx = qg @ ck.swapaxes(-1, -2)  # [B, kv, rep, q, S]
        s_ctx = mx.where(self.visible[:, :, None], s_ctx, -mx.inf)
        qb = qg.reshape(b, kv, rep, n, bs, d)
        kb = k.reshape(b, kv, 1, n, bs, d)
        vb = v.reshape(b, kv, 1, n, bs, d)
        s_own = (qb @ kb.swapaxes(-1, -2)).reshape(b, kv, rep, rows, bs)
        p = mx.softmax(mx.concatenate([s_ctx, s_own], axis=-1).astype(mx.float32), axis=-1).astype(q.dtype)
        width = s_ctx.shape[-1]
        out = p[..., :width] @ cv + (p[..., width:].reshape(b, kv, rep, n, bs, bs) @ vb).reshape(b, kv, rep, rows, d)
        return out.reshape(b, h, rows, d)


def rope_at(rope: nn.Module, x: mx.array, positions: Positions) -> mx.array:
    """Rotate `x` [B, heads, T, D] at `positions`: a start offset (contiguous rows) or ids [T] / [B, T]."""
    if isinstance(positions, int) or positions.ndim == 0:  # one start offset (an int, or a 0-d array)
        return rope(x, offset=positions)
    b, h, t, d = x.shape
    pos = mx.broadcast_to(positions.reshape(-1, t) if positions.ndim == 2 else positions[None], (b, t))
    # mx.fast.rope takes one offset per batch entry, so every token becomes its own batch entry.
    rows = x.transpose(0, 2, 1, 3).reshape(b * t, h, 1, d)
    out = rope(rows, offset=pos.reshape(-1).astype(mx.int32))
    return out.reshape(b, t, h, d).transpose(0, 2, 1, 3)


class DraftAttention(nn.Module):
    """Attention whose keys/values are [context rows ; block rows] and whose queries are the block.

    Gemma-4 layout: values are RMS-normalized without a scale (`v_norm`, no tensor); with `values_from_keys`
    they are the key projection's rows before `k_norm` and RoPE (there is no `v_proj`)."""

    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.n_heads, self.n_kv_heads, self.head_dim = nh, nkv, hd
        self.scale = hd**-0.5 if cfg.attention_scale is None else cfg.attention_scale
        self.value_norm_eps = cfg.rms_norm_eps if cfg.layout == GEMMA4 else None
        self.q_proj = nn.Linear(h, nh * hd, bias=bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=bias)
        if not cfg.values_from_keys:
            self.v_proj = nn.Linear(h, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            base=cfg.rope_theta,
            traditional=False,
            scaling_config=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def _heads(self, x: mx.array, n: int) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3)

    def _unrotated_kv(self, x: mx.array) -> KV:
        """Keys (k_norm'ed, not yet rotated) and values [B, kv_heads, T, D] of rows `x` [B, T, H]."""
        keys = self.k_proj(x)
        values = self.v_proj(x) if "v_proj" in self else keys
        v = self._heads(values, self.n_kv_heads)
        if self.value_norm_eps is not None:
            v = mx.fast.rms_norm(v, None, self.value_norm_eps)
        return self.k_norm(self._heads(keys, self.n_kv_heads)), v

    def key_values(self, x: mx.array, positions: Positions) -> KV:
        """Rotated keys and values [B, kv_heads, T, D] of rows `x` [B, T, H] (context or block)."""
        k, v = self._unrotated_kv(x)
        return rope_at(self.rope, k, positions), v

    def _attend(
        self, q: mx.array, k: mx.array, v: mx.array, context: KV | None, mask: mx.array | BlockwiseMask | None
    ) -> mx.array:
        if isinstance(mask, BlockwiseMask) and context is not None:
            return mask.attend(q, k, v, context, self.scale)
        if context is not None:
            k = mx.concatenate([context[0].astype(k.dtype), k], axis=2)
            v = mx.concatenate([context[1].astype(v.dtype), v], axis=2)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)

    def _out(self, out: mx.array) -> mx.array:
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))

    def __call__(
        self, x: mx.array, positions: Positions, context: KV | None, mask: mx.array | BlockwiseMask | None
    ) -> mx.array:
        q = rope_at(self.rope, self.q_norm(self._heads(self.q_proj(x), self.n_heads)), positions)
        k, v = self.key_values(x, positions)
        return self._out(self._attend(q, k, v, context, mask))

    def rows(
        self, x: mx.array, offsets: mx.array, contexts: Sequence[KV | None], masks: Sequence[mx.array | None]
    ) -> mx.array:
        """Blocks of different requests at once: row r of `x` [B, L, H] starts at `offsets[r]` and attends to
        its own context. The projections run batched (their weights are read once for every row); only the
        attention itself runs per row, since the rows' contexts differ in length."""
        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=offsets)
        k, v = self._unrotated_kv(x)
        k = self.rope(k, offset=offsets)
        out = [
            self._attend(q[r : r + 1], k[r : r + 1], v[r : r + 1], context, mask)
            for r, (context, mask) in enumerate(zip(contexts, masks, strict=True))
        ]
        return self._out(mx.concatenate(out, axis=0))


ACTIVATIONS = {"silu": nn.silu, "gelu": nn.gelu, "gelu_tanh": nn.gelu_approx}


class DraftMLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) · up(x)), SiLU (SwiGLU) or GELU."""

    def __init__(self, cfg: BackboneConfig, width: int | None = None) -> None:
        super().__init__()
        width = width or cfg.intermediate_size
        self.act = ACTIVATIONS[cfg.hidden_activation]
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Residual decoder layer: pre-norm (Qwen3 layout), or Gemma-4's sandwich norms, whose output is scaled by
    `layer_scalar`: h = x + post_attn(attn(input(x))); out = (h + post_ff(mlp(pre_ff(h)))) · layer_scalar."""

    def __init__(self, cfg: BackboneConfig, index: int = 0) -> None:
        super().__init__()
        self.sandwich = cfg.layout == GEMMA4
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        wide = index in cfg.double_wide_layers
        self.mlp = DraftMLP(cfg, 2 * cfg.intermediate_size if wide else None)
        if self.sandwich:
            self.pre_feedforward_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.post_feedforward_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.layer_scalar = mx.ones((1,))  # a checkpoint buffer (loaded, never trained)
            self.freeze(keys=["layer_scalar"], recurse=False)

    def _after_attention(self, x: mx.array, attended: mx.array) -> mx.array:
        if not self.sandwich:
            h = x + attended
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(attended)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar

    def __call__(
        self, x: mx.array, positions: Positions, context: KV | None, mask: mx.array | BlockwiseMask | None
    ) -> mx.array:
        return self._after_attention(x, self.self_attn(self.input_layernorm(x), positions, context, mask))

    def rows(
        self, x: mx.array, offsets: mx.array, contexts: Sequence[KV | None], masks: Sequence[mx.array | None]
    ) -> mx.array:
        """`__call__` for blocks of different requests (see `DraftAttention.rows`)."""
        return self._after_attention(x, self.self_attn.rows(self.input_layernorm(x), offsets, contexts, masks))


class DrafterBackbone(nn.Module):
    """fc + hidden_norm + decoder layers + final norm; tensor names match the published checkpoints."""

    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.config = cfg
        m = len(cfg.target_layer_ids)
        self.fc = nn.Linear(m * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DraftLayer(cfg, i) for i in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    @property
    def dtype(self) -> mx.Dtype:
        return self.norm.weight.dtype

    @classmethod
    def from_weights(
        cls,
        config: Any,
        weights: Mapping[str, mx.array],
        target_model: nn.Module,
        *,
        bits: int | None = 0,
        dtype: mx.Dtype | None = None,
        where: str = "drafter",
    ) -> Self:
        """Build, check against the target, load strictly, then cast/quantize.

        Raises:
            IncompatibleDrafter: the drafter does not fit `target_model`.
            ModelUnavailable: missing/unexpected tensors or wrong shapes.
        """
        drafter, tensors = cls.assemble(config, weights, target_model, where=where)
        load_strict(drafter, tensors, where=where)
        prepare(drafter, bits=bits, dtype=dtype)
        drafter.freeze()
        return drafter

    @classmethod
    def assemble(
        cls, config: Any, weights: Mapping[str, mx.array], target_model: nn.Module, *, where: str
    ) -> tuple[Self, Mapping[str, mx.array]]:
        """The drafter of `config` bound to `target_model` (checked to fit it), and the tensors to load into it."""
        raise NotImplementedError

    def fuse(self, features: mx.array) -> mx.array:
        """hidden_norm(fc(features)): concatenated target features [.., m·H_t] → context rows [.., H]."""
        return self.hidden_norm(self.fc(features.astype(self.dtype)))

    def context_kv(self, fused: mx.array, positions: Positions) -> list[KV]:
        """Each layer's rotated K/V of fused context rows [B, S, H] at `positions`."""
        return [layer.self_attn.key_values(fused, positions) for layer in self.layers]

    def embed_block(self, ids: mx.array) -> mx.array:
        """Block token ids [B, L] → input embeddings (each drafter binds its own or the target's)."""
        raise NotImplementedError

    def block_hidden(
        self,
        block_ids: mx.array,
        context_features: mx.array | None,
        positions: Positions,
        context_positions: Positions,
        masks: Any,
    ) -> mx.array:
        """The pure forward of both drafters up to the heads: fuse the context, embed the block, run `hidden`."""
        context = None
        if context_features is not None:
            context = self.context_kv(self.fuse(context_features), context_positions)
        return self.hidden(self.embed_block(block_ids), positions, context=context, masks=masks)

    def hidden(
        self,
        block: mx.array,
        positions: Positions,
        *,
        context: list[KV] | None = None,
        masks: mx.array | BlockwiseMask | Mapping[str, mx.array | None] | None = None,
    ) -> mx.array:
        """Pure forward of block embeddings through every layer, then the final norm.

        Args:
            block: block input embeddings [B, L, H].
            positions: the block's absolute positions (start offset or ids).
            context: per-layer context K/V from `context_kv` (or `ContextCache.layer_kv`), or None.
            masks: None (attend to everything), one mask for every layer, or a mapping from layer type
                ("full_attention" / "sliding_attention") to a mask; masks are boolean (True = attend) or
                additive, shaped [L, S + L] or broadcastable to [B, heads, L, S + L]; or a `BlockwiseMask`
                (training blocks side by side, with a context).

        Returns:
            Final-normed hidden states [B, L, H].
        """
        x = block.astype(self.dtype)
        for i, layer in enumerate(self.layers):
            mask = masks.get(self.config.layer_types[i]) if isinstance(masks, Mapping) else masks
            x = layer(x, positions, None if context is None else context[i], mask)
        return self.norm(x)


def sliding_mask(q_positions: mx.array, k_positions: mx.array, window: int, causal: bool) -> mx.array:
    """Boolean [Lq, Lk]: key j visible to query i iff i − j < window (and j ≤ i when causal)."""
    diff = q_positions[:, None] - k_positions[None, :]
    visible = diff < window
    if causal:
        visible = visible & (diff >= 0)
    return visible


class ContextCache:
    """Per-layer K/V of verified context rows, appended from target features; never holds block rows.

    Full layers keep every row; sliding layers keep the last `sliding_window − 1` rows (all the anchor's
    query can see; later block queries see a subset, enforced by the mask). Rows are contiguous positions
    `[start_i, offset)` per layer, so one start offset per layer describes them.
    """

    _STEP = 256

    def __init__(self, backbone: DrafterBackbone, graphs: dict[tuple[int, ...], Any] | None = None) -> None:
        """`graphs`: compiled block forwards to share (every fork of one source replays the same ones)."""
        self._backbone = backbone
        self._cfg = backbone.config
        self._buckets = key_buckets.enabled()  # blocks attend over whole buffers, masked (key_buckets)
        self._graphs = graphs if graphs is not None and compiled_forward.enabled(self._buckets) else None
        self.reset()

    def reset(self) -> None:
        n = self._cfg.num_layers
        self.offset = 0
        self._keys: list[mx.array | None] = [None] * n
        self._values: list[mx.array | None] = [None] * n
        self._start = [0] * n
        self._len = [0] * n

    def _keep(self, i: int) -> int | None:
        if self._cfg.is_sliding(i):
            assert self._cfg.sliding_window is not None
            return max(1, self._cfg.sliding_window - 1)
        return None

    def append(self, features: mx.array, first_position: int) -> None:
        """Add the rows of `features` [n, m·H_t] whose first row sits at absolute `first_position`.

        A gap (rows the drafter never saw, e.g. a reused prompt prefix) drops older rows so positions stay
        contiguous; the drafter then simply attends to less context.
        """
        if features.ndim == 2:
            features = features[None]
        n = features.shape[1]
        if n == 0:
            return
        self._move_to(first_position)
        kvs = self._backbone.context_kv(self._backbone.fuse(features), first_position)
        for i, (k, v) in enumerate(kvs):
            self._write(i, k, v)
        self.offset = first_position + n

    def _move_to(self, first_position: int) -> None:
        if first_position != self.offset:
            if first_position < self.offset:
                raise ValueError(f"context rows from {first_position} overlap cached rows up to {self.offset}")
            self.reset()
            self._start = [first_position] * self._cfg.num_layers

    @staticmethod
    def append_rows(caches: Sequence[ContextCache], chunks: Sequence[tuple[mx.array, int]]) -> None:
        """`append` for several caches of one drafter at once: cache j gets `chunks[j]` = (features [n, m·H_t],
        first position). The fusion and every layer's K/V projections run once over all the rows, so each
        weight is read once, not once per cache."""
        live = [(c, f.reshape(-1, f.shape[-1]), p) for c, (f, p) in zip(caches, chunks, strict=True) if f.shape[-2]]
        if not live:
            return
        backbone = live[0][0]._backbone
        if len(live) == 1:
            cache, features, position = live[0]
            cache.append(features, position)
            return
        for cache, _, position in live:
            cache._move_to(position)
        sizes = [int(f.shape[0]) for _, f, _ in live]
        ids = mx.concatenate([mx.arange(p, p + n) for (_, _, p), n in zip(live, sizes, strict=True)])
        fused = backbone.fuse(mx.concatenate([f for _, f, _ in live], axis=0))[None]
        kvs = backbone.context_kv(fused, ids)
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        for j, (cache, _, position) in enumerate(live):
            lo, hi = bounds[j], bounds[j + 1]
            for i, (k, v) in enumerate(kvs):
                cache._write(i, k[..., lo:hi, :], v[..., lo:hi, :])
            cache.offset = position + sizes[j]

    def _write(self, i: int, k: mx.array, v: mx.array) -> None:
        n = k.shape[2]
        used = self._len[i]
        keys, values = self._keys[i], self._values[i]
        if keys is None or values is None or used + n > keys.shape[2]:
            rows = key_buckets.capacity(used + n) if self._buckets else used + -(-n // self._STEP) * self._STEP
            b, h, _, d = k.shape
            new_k = mx.zeros((b, h, rows, d), dtype=k.dtype)
            new_v = mx.zeros((b, h, rows, d), dtype=v.dtype)
            if keys is not None and values is not None and used:
                new_k[..., :used, :] = keys[..., :used, :]
                new_v[..., :used, :] = values[..., :used, :]
            keys, values = new_k, new_v
        keys[..., used : used + n, :] = k
        values[..., used : used + n, :] = v
        used += n
        keep = self._keep(i)
        if keep is not None and used > keep + self._STEP:
            # Trim a sliding layer back to its window only now and then, to amortize the copy.
            keys, values = keys[..., used - keep : used, :], values[..., used - keep : used, :]
            self._start[i] += used - keep
            used = keep
        self._keys[i], self._values[i], self._len[i] = keys, values, used

    def layer_kv(self, i: int) -> KV | None:
        """Layer i's cached context K/V [1, kv_heads, S_i, D], or None when empty."""
        keys, values = self._keys[i], self._values[i]
        if keys is None or values is None or self._len[i] == 0:
            return None
        return keys[..., : self._len[i], :], values[..., : self._len[i], :]

    def state(self) -> list[Any]:
        """Arrays to evaluate together with a draft, so the cache graph never grows across rounds."""
        return [a for a in (*self._keys, *self._values) if a is not None]

    def _mask(self, i: int, ctx: KV | None, anchor_position: int, length: int) -> mx.array | None:
        """Layer i's mask for a block of `length` rows at `anchor_position` (None: attend to everything)."""
        cfg = self._cfg
        if cfg.layer_types[i] != SLIDING or cfg.sliding_window is None:
            return None
        q_pos = mx.arange(anchor_position, anchor_position + length)
        ctx_len = 0 if ctx is None else ctx[0].shape[2]
        k_pos = mx.concatenate([mx.arange(self._start[i], self._start[i] + ctx_len), q_pos])
        return sliding_mask(q_pos, k_pos, cfg.sliding_window, cfg.sliding_causal)

    def _attends(self, i: int, anchor_position: int, length: int) -> tuple[KV | None, mx.array | None]:
        """Layer i's context K/V and mask for a block of `length` rows at `anchor_position`: the exact rows, or
        with key buckets on, the whole buffer with its unwritten rows hidden (one key length per bucket)."""
        ctx = self.layer_kv(i)
        keys, values = self._keys[i], self._values[i]
        if not self._buckets or ctx is None or keys is None or values is None:
            return ctx, self._mask(i, ctx, anchor_position, length)
        cap, used = keys.shape[2], self._len[i]
        seen = _written(used, cap, length)
        exact = self._mask(i, ctx, anchor_position, length)
        if exact is None:
            seen = mx.broadcast_to(seen[None], (length, cap + length))
        else:  # the sliding mask over [used context rows ; block], spread over the padded columns
            hidden = mx.zeros((length, cap - used), dtype=mx.bool_)
            spread = mx.concatenate([exact[:, :used], hidden, exact[:, used:]], axis=1)
            seen = spread & seen[None]
        return (keys, values), key_buckets.additive(seen, self._backbone.dtype)

    def block_hidden(self, ids: mx.array, anchor_position: int) -> mx.array:
        """`forward` of the block `ids` [1, L] (embedded here). With key buckets and compiled forwards on, a
        drafter of full-attention layers replays one compiled graph per (bucket, block) instead of the host
        building its layers' graph every round."""
        keys = self._keys
        if (
            self._graphs is None
            or ids.shape[0] != 1
            or any(self._cfg.is_sliding(i) for i in range(self._cfg.num_layers))
            or any(k is None for k in keys)
            or len({(k.shape[2], n) for k, n in zip(keys, self._len, strict=True) if k is not None}) != 1
            or not self._len[0]
        ):
            return self.forward(self._backbone.embed_block(ids), anchor_position)
        cap, length = int(keys[0].shape[2]), int(ids.shape[1])  # type: ignore[union-attr]
        graph = self._graphs.get((cap, length))
        if graph is None:
            graph = self._graphs[(cap, length)] = mx.compile(_block_graph(self._backbone, cap, length))
        buffers = [a for kv in zip(self._keys, self._values, strict=True) for a in kv]
        position = mx.array(anchor_position, dtype=mx.int32)
        return graph(ids, position, mx.array(self._len[0], dtype=mx.int32), *buffers)  # type: ignore[no-any-return]

    def forward(self, block: mx.array, anchor_position: int) -> mx.array:
        """Final-normed hidden [1, L, H] of block embeddings [1, L, H] starting at `anchor_position`."""
        length = block.shape[1]
        x = block.astype(self._backbone.dtype)
        for i, layer in enumerate(self._backbone.layers):
            ctx, mask = self._attends(i, anchor_position, length)
            x = layer(x, anchor_position, ctx, mask)
        return self._backbone.norm(x)

    @staticmethod
    def forward_rows(caches: Sequence[ContextCache], block: mx.array, anchor_positions: Sequence[int]) -> mx.array:
        """`forward` of several requests' blocks at once: row r of `block` [B, L, H] over `caches[r]`, starting at
        `anchor_positions[r]`; returns [B, L, H]. The rounding may differ from one row's own `forward`."""
        backbone = caches[0]._backbone
        length = block.shape[1]
        offsets = mx.array(list(anchor_positions), dtype=mx.int32)
        x = block.astype(backbone.dtype)
        for i, layer in enumerate(backbone.layers):
            inputs = [c._attends(i, p, length) for c, p in zip(caches, anchor_positions, strict=True)]
            x = layer.rows(x, offsets, [ctx for ctx, _ in inputs], [mask for _, mask in inputs])
        return backbone.norm(x)


def _written(used: int | mx.array, cap: int, length: int) -> mx.array:
    """Boolean [cap + length]: which columns of [a `cap`-row context buffer ; the block] hold rows (the first
    `used` context rows and the block's own)."""
    cols = mx.arange(cap + length)
    return (cols < used) | (cols >= cap)


def _block_graph(backbone: DrafterBackbone, cap: int, length: int) -> Any:
    """The block forward over whole `cap`-row context buffers, `used` rows of them written (for `mx.compile`)."""

    def forward(ids: mx.array, position: mx.array, used: mx.array, *buffers: mx.array) -> mx.array:
        dtype = backbone.dtype
        x = backbone.embed_block(ids).astype(dtype)
        seen = mx.broadcast_to(_written(used, cap, length)[None], (length, cap + length))
        mask = key_buckets.additive(seen, dtype)
        for i, layer in enumerate(backbone.layers):
            x = layer(x, position, (buffers[2 * i], buffers[2 * i + 1]), mask)
        return backbone.norm(x)

    return forward
