"""The MLX drafters against a straightforward numpy reference written here from drafters.md §2.1/§3.1.

Covers the backbone (fc + hidden_norm, KV injection, q/k norms, RoPE at absolute positions, GQA,
bidirectional block, sliding window), the incremental context cache, the Markov chain and the confidence
head, on random weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.tokens import SamplingParams
from tests.integration.drafters import helpers

EPS = 1e-6


def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """NeoX (split-half) rotary embedding of x [T, heads, D] at positions [T]."""
    d = x.shape[-1]
    half = d // 2
    inv = theta ** (-np.arange(half) * 2.0 / d)
    ang = pos[:, None, None] * inv[None, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def reference_hidden(
    w: dict[str, np.ndarray],
    cfg: dict[str, Any],
    ctx_feats: np.ndarray,
    block_emb: np.ndarray,
    anchor_pos: int,
    *,
    layer_types: list[str],
    window: int | None = None,
    theta: float = 1e6,
) -> np.ndarray:
    """Final-normed drafter hidden states of one block [L, H], context rows at positions 0..S-1."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    s, length = ctx_feats.shape[0], block_emb.shape[0]
    c = rms(ctx_feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    ctx_pos = np.arange(s, dtype=np.float64)
    blk_pos = np.arange(anchor_pos, anchor_pos + length, dtype=np.float64)
    key_pos = np.concatenate([ctx_pos, blk_pos])
    x = block_emb.astype(np.float64)
    for i, kind in enumerate(layer_types):
        p = f"layers.{i}."
        a = rms(x, w[p + "input_layernorm.weight"])

        def proj(inp: np.ndarray, name: str, heads: int, p: str = p) -> np.ndarray:
            return (inp @ w[p + f"self_attn.{name}.weight"].T).reshape(inp.shape[0], heads, hd)

        q = rope(rms(proj(a, "q_proj", nh), w[p + "self_attn.q_norm.weight"]), blk_pos, theta)
        k = np.concatenate(
            [
                rope(rms(proj(c, "k_proj", nkv), w[p + "self_attn.k_norm.weight"]), ctx_pos, theta),
                rope(rms(proj(a, "k_proj", nkv), w[p + "self_attn.k_norm.weight"]), blk_pos, theta),
            ]
        )
        v = np.concatenate([proj(c, "v_proj", nkv), proj(a, "v_proj", nkv)])
        visible = np.ones((length, s + length), dtype=bool)
        if kind == "sliding_attention":
            diff = blk_pos[:, None] - key_pos[None, :]
            visible = (diff < window) & (diff >= 0)
        out = np.zeros((length, nh, hd))
        for h in range(nh):
            g = h // (nh // nkv)
            scores = q[:, h] @ k[:, g].T / np.sqrt(hd)
            scores = np.where(visible, scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            out[:, h] = probs @ v[:, g]
        x = x + out.reshape(length, -1) @ w[p + "self_attn.o_proj.weight"].T
        b = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = b @ w[p + "mlp.gate_proj.weight"].T
        up = b @ w[p + "mlp.up_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"])


def read(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    cfg = json.loads((path / "config.json").read_text())
    loaded = mx.load(str(path / "model.safetensors"))
    weights = {k: np.array(v.astype(mx.float32)).astype(np.float64) for k, v in loaded.items()}
    return cfg, weights


def target_arrays(target: Any) -> tuple[np.ndarray, np.ndarray]:
    embed = np.array(model_parts._decoder(target).embed_tokens.weight).astype(np.float64)
    head = helpers.head_weight(target).astype(np.float64)
    return embed, head


@pytest.mark.parametrize("variant", ["v1", "v2", "sliding"])
def test_dflash_logits_match_the_numpy_reference(tmp_path: Path, qwen3_target: Any, variant: str) -> None:
    path = helpers.write_dflash(tmp_path / variant, variant=variant, block_size=6, sliding_window=5, seed=3)
    cfg, w = read(path)
    source = load_drafter("dflash", str(path), qwen3_target, bits=0)
    prompt = [5, 9, 17, 33, 2, 71, 8, 40, 11]
    _, feats = helpers.target_forward(qwen3_target, prompt, source.target_layer_ids)
    # Features arrive in two chunks (prefill, then a round's committed rows), as in decoding.
    source.begin(prompt)
    source.ingest(DraftContext(anchor=0, position=6, history=prompt[:6], features=feats[:6]))
    source.ingest(DraftContext(anchor=0, position=9, history=prompt, features=feats[6:]))
    anchor = 44
    ids = source.block_ids(anchor)
    hidden = source.cache.forward(source.drafter.embed_block(ids), 9)[0]
    got = np.array(source.drafter.logits(hidden).astype(mx.float32))

    embed, head = target_arrays(qwen3_target)
    block_ids = np.array(ids[0].tolist())
    layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    ref_h = reference_hidden(
        w, cfg, np.array(feats).astype(np.float64), embed[block_ids], 9, layer_types=layer_types, window=5
    )
    np.testing.assert_allclose(got, ref_h @ head.T, rtol=2e-3, atol=2e-3)

    # The pure (training) forward over the same context gives the same logits.
    pure = source.drafter(ids, feats[None], positions=9, context_positions=0)
    if variant == "sliding":
        # The pure forward takes explicit masks; build the sliding one for layer 0.
        from mlx_dspark.adapters.mlx.drafters.backbone import sliding_mask

        q_pos = mx.arange(9, 15)
        k_pos = mx.concatenate([mx.arange(0, 9), q_pos])
        pure = source.drafter(
            ids,
            feats[None],
            positions=9,
            masks={"sliding_attention": sliding_mask(q_pos, k_pos, 5, True), "full_attention": None},
        )
    np.testing.assert_allclose(np.array(pure[0].astype(mx.float32)), got, rtol=2e-3, atol=2e-3)


def test_per_token_positions_equal_a_start_offset(qwen3_target: Any, tmp_path: Path) -> None:
    """Training passes position ids; inference passes a start offset. Same rotation."""
    path = helpers.write_dflash(tmp_path / "d", seed=4)
    source = load_drafter("dflash", str(path), qwen3_target, bits=0)
    _, feats = helpers.target_forward(qwen3_target, [3, 4, 5, 6, 7], source.target_layer_ids)
    ids = source.block_ids(9)
    by_offset = source.drafter(ids, feats[None], positions=5, context_positions=0)
    by_ids = source.drafter(ids, feats[None], positions=mx.arange(5, 11), context_positions=mx.arange(0, 5))
    np.testing.assert_allclose(np.array(by_ids), np.array(by_offset), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("packaging", ["deepspec", "speculators", "specforge"])
def test_dspark_markov_chain_and_confidence_match_the_reference(
    tmp_path: Path, qwen3_target: Any, packaging: str
) -> None:
    draft_vocab = 96 if packaging == "speculators" else None
    path = helpers.write_dspark(
        tmp_path / packaging, qwen3_target, packaging=packaging, draft_vocab=draft_vocab, markov_strength=0.0, seed=5
    )
    cfg, w = read(path)
    source = load_drafter("dspark", str(path), qwen3_target, bits=0, confidence_threshold=1e-9)
    prompt = [7, 1, 90, 23, 64, 3, 12]
    _, feats = helpers.target_forward(qwen3_target, prompt, source.target_layer_ids)
    anchor, pos = 55, len(prompt)
    source.begin(prompt)
    ctx = DraftContext(anchor=anchor, position=pos, history=[*prompt, anchor], features=feats)
    block = source.propose(ctx, 5, SamplingParams(), [0.5] * 5)

    layer_cfg = cfg.get("transformer_layer_config", cfg)
    embed, head = target_arrays(qwen3_target)
    embed = w.get("embed_tokens.weight", embed)
    head = w.get("lm_head.weight", head)
    ids = np.array([anchor] + [layer_cfg["vocab_size"] - 1] * 4)
    ref_h = reference_hidden(
        w, layer_cfg, np.array(feats).astype(np.float64), embed[ids], pos, layer_types=["full_attention"] * 2
    )
    to_target = (np.arange(head.shape[0]) + w.get("d2t", 0)).astype(np.int64)
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    wc, bc = w["confidence_head.proj.weight"][0], w.get("confidence_head.proj.bias", np.zeros(1))[0]
    prev, tokens, confs = anchor, [], []
    for k in range(5):
        logits = ref_h[k] @ head.T + w2 @ w1[prev]
        confs.append(1 / (1 + np.exp(-(wc @ np.concatenate([ref_h[k], w1[prev]]) + bc))))
        prev = int(to_target[int(np.argmax(logits))])
        tokens.append(prev)
    assert list(block.tokens) == tokens
    np.testing.assert_allclose(source.last_confidences, confs, rtol=1e-3, atol=1e-4)

    # Sampled: q_k is the Markov-corrected distribution given the tokens actually drafted before k.
    t = 0.7
    source.begin(prompt)
    sampled = source.propose(ctx, 5, SamplingParams(temperature=t), [0.1, 0.9, 0.3, 0.6, 0.99])
    q = np.array(sampled.q)
    assert q.shape == (5, model_parts.vocab_size(qwen3_target))
    prev = anchor
    for k, x in enumerate(sampled.tokens):
        logits = (ref_h[k] @ head.T + w2 @ w1[prev]) / t
        p = np.exp(logits - logits.max())
        p /= p.sum()
        full = np.zeros(q.shape[1])
        full[to_target] = p
        np.testing.assert_allclose(q[k], full, rtol=2e-3, atol=1e-5)
        assert q[k, x] > 0
        prev = x


def test_the_pure_dspark_forward_without_previous_tokens_has_no_confidence(tmp_path: Path, qwen3_target: Any) -> None:
    """The confidence head reads [h ; w1[x_{k-1}]]: with no previous tokens there is nothing to read, so no logit
    (it used to feed h alone to a head H + r wide)."""
    source = load_drafter("dspark", str(helpers.write_dspark(tmp_path / "d", qwen3_target)), qwen3_target, bits=0)
    _, feats = helpers.target_forward(qwen3_target, [3, 4, 5, 6, 7], source.target_layer_ids)
    ids = mx.array([[5, 1, 1, 1, 1]])
    logits, confidence = source.drafter(ids, feats[None], positions=5, context_positions=0)
    assert confidence is None and logits.shape[:2] == (1, 5)
    with_prev, confidence = source.drafter(ids, feats[None], positions=5, context_positions=0, prev_ids=ids)
    assert confidence is not None and confidence.shape == (1, 5)
    assert not mx.allclose(with_prev, logits).item()  # the Markov bias moved them
