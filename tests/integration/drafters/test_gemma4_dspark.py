"""Gemma-4 DSpark drafters in DeepSpec's published layout (`Gemma4DSparkModel`), on the tiny Gemma-4 target.

The checkpoint is written as DeepSpec's `build_draft_config` and `state_dict()` would have it: a copy of the
target's Gemma-4 text config plus the DSpark keys; k=v attention (no `v_proj`), `v_norm` without a weight,
sandwich norms and a `layer_scalar` buffer per layer, GELU-tanh MLP, own embedding (scaled by sqrt(H)) and
head (final-logit softcap). Checks: it loads strictly (a missing or extra tensor is named), greedy decoding
with it equals plain decoding at exact budgets and accepts drafts, and one block's forward equals a NumPy
re-implementation of the reference math written here (proportional partial RoPE included).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.adapters.mlx.drafters import DSparkDraftSource, load_drafter
from mlx_dspark.adapters.mlx.drafters.config import parse_dspark
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.errors import ModelUnavailable
from tests.fakes.tiny_models import hf_config
from tests.integration.drafters import helpers
from tests.integration.drafters.test_loading import edit, retensor
from tests.integration.families.test_family_suite import assert_decodes_as_plain, transitions
from tests.integration.mlx.test_target_greedy import model

FAMILY = "gemma4_text"
EPS = 1e-6


def text_config(**overrides: Any) -> dict[str, Any]:
    """The tiny Gemma-4 target's text config as a serialised Gemma4TextConfig would hold it."""
    cfg = {**helpers.GEMMA4_TEXT_DEFAULTS, **hf_config(FAMILY)}
    n, every = cfg["num_hidden_layers"], cfg.pop("sliding_window_pattern")
    cfg["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    cfg.update(overrides)
    return cfg


# Gemma-4 31B-style global layers: keys and values share one projection, two KV heads.
K_EQ_V = {"attention_k_eq_v": True, "num_global_key_value_heads": 2}


def write(tmp: Path, name: str, **kw: Any) -> Path:
    overrides = kw.pop("text", K_EQ_V)
    return helpers.write_gemma4_dspark(tmp / name, model(FAMILY), text_config(**overrides), **kw)


# ---------------------------------------------------------------- (a) loading, strict names


def test_a_gemma4_dspark_checkpoint_loads_in_its_published_layout(tmp_path: Path) -> None:
    path = write(tmp_path, "g")
    source = load_drafter("dspark", str(path), model(FAMILY), bits=0)
    assert isinstance(source, DSparkDraftSource)
    d = source.drafter
    cfg = d.config
    assert (cfg.layout, cfg.values_from_keys, cfg.hidden_activation, cfg.attention_scale) == (
        "gemma4",
        True,
        "gelu_tanh",
        1.0,
    )
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (32, 4, 2, 2)
    assert cfg.layer_types == ("full_attention",) * 2 and cfg.sliding_window is None
    assert cfg.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert cfg.rope_theta == 1e6 and cfg.target_layer_ids == (0, 5)
    assert d.dspark_config.input_embedding_scale == pytest.approx(8.0)  # sqrt(hidden 64)
    assert d.dspark_config.final_logit_softcapping == 30.0
    assert "v_proj" not in d.layers[0].self_attn and d.has_markov and d.has_confidence
    assert source.max_block == 5 and source.target_layer_ids == (0, 5)
    # Without k=v (the smaller Gemma-4s), values have their own projection and the local KV head count.
    plain = load_drafter("dspark", str(write(tmp_path, "v", text={})), model(FAMILY), bits=0)
    assert "v_proj" in plain.drafter.layers[0].self_attn and plain.drafter.config.num_kv_heads == 1


def test_a_missing_or_extra_tensor_is_refused_by_name(tmp_path: Path) -> None:
    target = model(FAMILY)
    missing = retensor(write(tmp_path, "m"), lambda t: t.pop("layers.1.layer_scalar"))
    with pytest.raises(ModelUnavailable, match=r"missing tensors: layers\.1\.layer_scalar"):
        load_drafter("dspark", str(missing), target, bits=0)
    no_post_ff = retensor(write(tmp_path, "p"), lambda t: t.pop("layers.0.post_feedforward_layernorm.weight"))
    with pytest.raises(ModelUnavailable, match=r"missing tensors: layers\.0\.post_feedforward_layernorm\.weight"):
        load_drafter("dspark", str(no_post_ff), target, bits=0)

    def add_v(t: dict[str, mx.array]) -> None:
        t["layers.0.self_attn.v_proj.weight"] = t["layers.0.self_attn.k_proj.weight"]
        t["layers.0.self_attn.v_norm.weight"] = mx.ones((32,))

    extra = retensor(write(tmp_path, "x"), add_v)
    with pytest.raises(
        ModelUnavailable,
        match=r"unexpected tensors: layers\.0\.self_attn\.v_norm\.weight, layers\.0\.self_attn\.v_proj\.weight",
    ):
        load_drafter("dspark", str(extra), target, bits=0)
    # Without k=v a checkpoint lacking v_proj is refused too.
    no_v = retensor(write(tmp_path, "n", text={}), lambda t: t.pop("layers.1.self_attn.v_proj.weight"))
    with pytest.raises(ModelUnavailable, match=r"missing tensors: layers\.1\.self_attn\.v_proj\.weight"):
        load_drafter("dspark", str(no_v), target, bits=0)


def test_double_wide_mlp_layers_follow_the_gemma4_rule(tmp_path: Path) -> None:
    """With `use_double_wide_mlp`, the drafter's last `num_kv_shared_layers` (2) layers are twice as wide."""
    text = {**K_EQ_V, "use_double_wide_mlp": True}
    path = write(tmp_path, "w", text=text, layers=3)
    source = load_drafter("dspark", str(path), model(FAMILY), bits=0)
    widths = [layer.mlp.gate_proj.weight.shape[0] for layer in source.drafter.layers]
    assert widths == [128, 256, 256]
    narrow = retensor(
        write(tmp_path, "n", text=text, layers=3),
        lambda t: t.update(
            {k: v[:128] if "gate" in k or "up" in k else v[:, :128] for k, v in t.items() if "layers.2.mlp" in k}
        ),
    )
    with pytest.raises(ModelUnavailable, match=r"shapes do not match.*layers\.2\.mlp"):
        load_drafter("dspark", str(narrow), model(FAMILY), bits=0)


def test_gemma4_variants_the_reference_cannot_run_are_refused_in_words(tmp_path: Path) -> None:
    target = model(FAMILY)
    cases = [
        (lambda c: c.update(enable_moe_block=True), "MoE blocks"),
        (lambda c: c.update(hidden_size_per_layer_input=8), "per-layer inputs"),
        (lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"), "RoPE type 'yarn'"),
        (lambda c: c.pop("global_head_dim"), "no `global_head_dim`"),
        (lambda c: c.update(num_global_key_value_heads=None), "no `num_global_key_value_heads`"),
        (lambda c: c.update(hidden_activation="relu"), "hidden_activation 'relu'"),
        (lambda c: c.update(markov_head_type="rnn"), "'rnn' is not supported"),
    ]
    for i, (change, message) in enumerate(cases):
        path = edit(write(tmp_path, f"r{i}"), change)
        with pytest.raises(ModelUnavailable, match=message):
            load_drafter("dspark", str(path), target, bits=0)


# ---------------------------------------------------------------- (b) lossless decoding


def test_greedy_decoding_with_a_gemma4_dspark_drafter_equals_plain_decoding(tmp_path: Path) -> None:
    m = model(FAMILY)
    n = len(m.layers)
    path = write(tmp_path, "d", layer_ids=(0, n - 1), block_size=6, bigrams=transitions(FAMILY))
    source = load_drafter("dspark", str(path), m, bits=0)
    drafted, accepted = assert_decodes_as_plain(FAMILY, m, source)
    assert drafted > 0 and accepted > 0


# ---------------------------------------------------------------- (c) numerics against the reference math


def rms(x: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    """Gemma4RMSNorm: x · (mean(x²) + eps)^−½ · weight (no weight: `with_scale=False`)."""
    out = x * np.power(np.mean(x * x, axis=-1, keepdims=True) + EPS, -0.5)
    return out if w is None else out * w


def proportional_rope(x: np.ndarray, pos: np.ndarray, head_dim: int, theta: float, fraction: float) -> np.ndarray:
    """HF's proportional RoPE on x [T, heads, D]: the first int(fraction·D/2) of D/2 frequencies are
    theta^(−2i/D), the rest zero; applied with rotate_half over the whole head."""
    angles = int(fraction * head_dim // 2)
    inv = np.concatenate([1.0 / theta ** (np.arange(0, 2 * angles, 2) / head_dim), np.zeros(head_dim // 2 - angles)])
    freqs = pos[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    half = head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


SLIPS = ("full_rope", "values_k_normed", "no_layer_scalar", "no_embed_scale", "pre_norm_layer")


def reference_block(
    w: dict[str, np.ndarray],
    cfg: dict[str, Any],
    ctx_feats: np.ndarray,
    block_ids: np.ndarray,
    anchor_pos: int,
    slip: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Gemma4DSparkModel's final-normed hidden states and base logits for one block (context rows at
    0..S−1, the block at anchor_pos..). `slip` makes one of the layout mistakes of SLIPS on purpose."""
    h_size, nh, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["global_head_dim"]
    k_eq_v = cfg["attention_k_eq_v"]
    nkv = cfg["num_global_key_value_heads"] if k_eq_v else cfg["num_key_value_heads"]
    rope = cfg["rope_parameters"]["full_attention"]
    s, length = ctx_feats.shape[0], block_ids.shape[0]
    positions = np.concatenate([np.arange(s), np.arange(anchor_pos, anchor_pos + length)]).astype(np.float64)

    fraction = 1.0 if slip == "full_rope" else rope["partial_rotary_factor"]

    def rot(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return proportional_rope(x, pos, hd, rope["rope_theta"], fraction)

    target = rms(ctx_feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = w["embed_tokens.weight"][block_ids] * (1.0 if slip == "no_embed_scale" else np.sqrt(h_size))
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        a = rms(x, w[p + "input_layernorm.weight"])
        q = rms((a @ w[p + "self_attn.q_proj.weight"].T).reshape(length, nh, hd), w[p + "self_attn.q_norm.weight"])
        k_rows = np.concatenate([target, a]) @ w[p + "self_attn.k_proj.weight"].T
        v_rows = k_rows if k_eq_v else np.concatenate([target, a]) @ w[p + "self_attn.v_proj.weight"].T
        k = rms(k_rows.reshape(s + length, nkv, hd), w[p + "self_attn.k_norm.weight"])
        v = rms(
            v_rows.reshape(s + length, nkv, hd), w[p + "self_attn.k_norm.weight"] if slip == "values_k_normed" else None
        )
        q, k = rot(q, positions[-length:]), rot(k, positions)
        out = np.zeros((length, nh, hd))
        for head in range(nh):
            g = head // (nh // nkv)
            scores = q[:, head] @ k[:, g].T  # scaling 1.0, bidirectional over [context ; block]
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[:, head] = (probs / probs.sum(axis=-1, keepdims=True)) @ v[:, g]
        attn = out.reshape(length, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        if slip == "pre_norm_layer":  # Qwen3's residuals with Gemma's weights: no post-attention norm
            x = x + attn
        else:
            x = x + rms(attn, w[p + "post_attention_layernorm.weight"])
        b = rms(x, w[p + "pre_feedforward_layernorm.weight"])
        mlp = (gelu_tanh(b @ w[p + "mlp.gate_proj.weight"].T) * (b @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"
        ].T
        x = (x + rms(mlp, w[p + "post_feedforward_layernorm.weight"])) * (
            1.0 if slip == "no_layer_scalar" else w[p + "layer_scalar"]
        )
    hidden = rms(x, w["norm.weight"])
    cap = cfg["final_logit_softcapping"]
    return hidden, np.tanh(hidden @ w["lm_head.weight"].T / cap) * cap


@pytest.mark.parametrize("text", [K_EQ_V, {}], ids=["k_eq_v", "v_proj"])
def test_one_block_matches_a_numpy_reimplementation_of_the_reference(tmp_path: Path, text: dict[str, Any]) -> None:
    path = write(tmp_path, "n", text=text, layers=3, block_size=6, seed=7)
    cfg = json.loads((path / "config.json").read_text())
    w = {
        k: np.array(v.astype(mx.float32)).astype(np.float64)
        for k, v in mx.load(str(path / "model.safetensors")).items()
    }
    assert parse_dspark(cfg).backbone.layout == "gemma4"
    source = load_drafter("dspark", str(path), model(FAMILY), bits=0)
    rng = np.random.default_rng(3)
    feats = mx.array(rng.normal(0, 1, (9, 2 * cfg["hidden_size"])).astype(np.float32))
    prompt = [5, 9, 17, 33, 2, 71, 8, 40, 11]
    # Features arrive in two chunks (prefill, then a round's committed rows), as in decoding.
    source.begin(prompt)
    source.ingest(DraftContext(anchor=0, position=6, history=prompt[:6], features=feats[:6]))
    source.ingest(DraftContext(anchor=0, position=9, history=prompt, features=feats[6:]))
    ids = source.block_ids(44)
    args = (w, cfg, np.array(feats).astype(np.float64), np.array(ids[0].tolist()), 9)
    want_h, want = reference_block(*args)

    d = source.drafter
    hidden = source.cache.forward(d.embed_block(ids), 9)
    np.testing.assert_allclose(np.array(hidden[0]), want_h, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.array(d.base_logits(hidden)[0]), want, rtol=1e-3, atol=1e-3)
    pure = d.block_hidden(ids, feats[None], 9, 0, None)  # the pure (training) forward
    np.testing.assert_allclose(np.array(pure[0]), want_h, rtol=1e-3, atol=1e-3)
    # The batched-rows path (several requests' blocks at once) agrees too.
    from mlx_dspark.adapters.mlx.drafters.backbone import ContextCache

    rows = ContextCache.forward_rows([source.cache, source.cache], mx.concatenate([d.embed_block(ids)] * 2), [9, 9])
    np.testing.assert_allclose(np.array(rows[1]), want_h, rtol=1e-3, atol=1e-3)
    # Each layout slip moves the hidden states far past that tolerance, so none of them could pass.
    for slip in SLIPS:
        assert np.abs(reference_block(*args, slip=slip)[0] - want_h).max() > 0.05, slip
