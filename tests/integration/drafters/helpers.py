"""Tiny targets and tiny drafter checkpoints written in the published formats.

Checkpoints are config.json + model.safetensors exactly as z-lab (DFlash), DeepSpec, vLLM speculators and
SpecForge (DSpark) publish them, only small.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dspark.adapters.mlx import fused_projections, model_parts

HIDDEN = 64
VOCAB = 128
LAYERS = 6


def perturbed(model: Any, scale: float, *, seed: int = 0) -> Any:
    """A copy of the mlx-lm `model` with every weight scaled by (1 + scale * noise): a draft model of its
    vocabulary that agrees with it often, not always (0: the same function)."""
    twin = type(model)(model.args)
    if any(n.endswith(("qkv_fused", "gate_up_fused")) for n, _ in model.named_modules()):
        fused_projections.install(twin)  # a target's projections are fused once it is wrapped: same layout
    key = mx.random.key(seed)
    params = []
    for name, w in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        params.append((name, w * (1 + scale * mx.random.normal(w.shape, key=sub)) if scale else w))
    twin.update(tree_unflatten(params))
    twin.eval()
    mx.eval(twin.parameters())
    return twin


def tiny_target(family: str, seed: int = 0, *, vocab: int = VOCAB, bigram: bool = True) -> Any:
    """A random mlx-lm target (llama or qwen3), hidden 64.

    With `bigram`, the layers' residual writes are damped so the next token depends mostly on the last one
    (plus a little context): drafters built from its bigram table then get many, but not all, drafts right.
    """
    mx.random.seed(seed)
    common = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    if family == "llama":
        from mlx_lm.models import llama

        model = llama.Model(llama.ModelArgs(model_type="llama", rope_theta=10000.0, **common))
    elif family == "qwen3":
        from mlx_lm.models import qwen3

        model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", rope_theta=1e6, **common))
    else:
        raise ValueError(family)
    rng = np.random.default_rng(seed)
    params = dict(tree_flatten(model.parameters()))
    new = {}
    for name, p in params.items():
        if name.endswith("norm.weight"):
            new[name] = mx.ones(p.shape)
            continue
        scale = 1.0 if "embed" in name or "lm_head" in name else p.shape[-1] ** -0.5
        if bigram and ("o_proj" in name or "down_proj" in name):
            scale *= 0.1
        new[name] = mx.array(rng.normal(0, scale, p.shape).astype(np.float32))
    model.load_weights(list(new.items()))
    model.eval()
    mx.eval(model.parameters())
    return model


def target_forward(model: Any, tokens: Sequence[int], layer_ids: Sequence[int] = ()) -> tuple[mx.array, mx.array]:
    """Logits [T, V] and concatenated outputs of `layer_ids` [T, m·H] (float32) of a full causal pass."""
    inner = model_parts._decoder(model)
    h = model_parts.embed(model, mx.array([list(tokens)]))
    feats = {}
    for i, layer in enumerate(inner.layers):
        h = layer(h, "causal" if len(tokens) > 1 else None, None)
        feats[i] = h
    logits = model_parts.lm_head(model, inner.norm(h))[0].astype(mx.float32)
    cat = (
        mx.concatenate([feats[i][0] for i in layer_ids], axis=-1).astype(mx.float32)
        if layer_ids
        else mx.zeros((len(tokens), 0))
    )
    return logits, cat


def bigram_table(model: Any) -> np.ndarray:
    """[V, V] target logits for every one-token context (row = previous token)."""
    v = model_parts.vocab_size(model)
    # The model's own forward over V one-token rows: every family's layers, embedding scale and head.
    return np.array(model(mx.arange(v)[:, None])[:, -1].astype(mx.float32))


# ---------------------------------------------------------------- checkpoint writers


def _rand(rng: np.random.Generator, shape: Sequence[int], scale: float | None = None) -> np.ndarray:
    s = scale if scale is not None else shape[-1] ** -0.5
    return rng.normal(0, s, tuple(shape)).astype(np.float32)


def backbone_tensors(
    rng: np.random.Generator, *, layers: int, n_feats: int, hidden: int = HIDDEN, bias: bool = False
) -> dict[str, np.ndarray]:
    """Random backbone tensors with the published names (no prefix; Linear weights [out, in])."""
    heads, kv, hd, inter = 4, 2, 16, 128
    t: dict[str, np.ndarray] = {
        "fc.weight": _rand(rng, (hidden, n_feats * hidden)),
        "hidden_norm.weight": 1 + _rand(rng, (hidden,), 0.1),
        "norm.weight": 1 + _rand(rng, (hidden,), 0.1),
    }
    for i in range(layers):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + _rand(rng, (hidden,), 0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + _rand(rng, (hidden,), 0.1)
        t[p + "self_attn.q_proj.weight"] = _rand(rng, (heads * hd, hidden))
        t[p + "self_attn.k_proj.weight"] = _rand(rng, (kv * hd, hidden))
        t[p + "self_attn.v_proj.weight"] = _rand(rng, (kv * hd, hidden))
        t[p + "self_attn.o_proj.weight"] = _rand(rng, (hidden, heads * hd))
        t[p + "self_attn.q_norm.weight"] = 1 + _rand(rng, (hd,), 0.1)
        t[p + "self_attn.k_norm.weight"] = 1 + _rand(rng, (hd,), 0.1)
        t[p + "mlp.gate_proj.weight"] = _rand(rng, (inter, hidden))
        t[p + "mlp.up_proj.weight"] = _rand(rng, (inter, hidden))
        t[p + "mlp.down_proj.weight"] = _rand(rng, (hidden, inter))
        if bias:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out = t[p + f"self_attn.{name}.weight"].shape[0]
                t[p + f"self_attn.{name}.bias"] = _rand(rng, (out,), 0.1)
    return t


def _layer_config(layers: int, vocab: int = VOCAB) -> dict[str, Any]:
    return {
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
        "attention_bias": False,
    }


def save(path: Path, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    return path


def write_dflash(
    path: Path,
    *,
    variant: str = "v1",
    layer_ids: Sequence[int] = (1, 3),
    block_size: int = 6,
    num_target_layers: int = LAYERS,
    layers: int = 2,
    seed: int = 0,
    sliding_window: int = 4,
    vocab: int = VOCAB,
) -> Path:
    """A z-lab DFlash checkpoint: "v1" (top-level block_size, rope_theta), "v2" (block_size inside
    dflash_config, rope_parameters) or "sliding" (v2 with sliding_attention layers)."""
    rng = np.random.default_rng(seed)
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "num_target_layers": num_target_layers,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        **_layer_config(layers, vocab),
    }
    dcfg: dict[str, Any] = {"mask_token_id": vocab - 1, "target_layer_ids": list(layer_ids)}
    if variant == "v1":
        cfg["block_size"] = block_size
        cfg["rope_theta"] = 1e6
    else:
        dcfg["block_size"] = block_size
        cfg["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
    if variant == "sliding":
        cfg["layer_types"] = ["sliding_attention"] + ["full_attention"] * (layers - 1)
        cfg["sliding_window"] = sliding_window
    cfg["dflash_config"] = dcfg
    return save(path, cfg, backbone_tensors(rng, layers=layers, n_feats=len(layer_ids)))


def dspark_head_tensors(
    rng: np.random.Generator,
    *,
    target: Any,
    rank: int,
    draft_ids: Sequence[int] | None = None,
    confidence_bias: bool = True,
    markov_strength: float = 1.0,
    bigrams: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Markov + confidence heads. With `markov_strength` > 0, w1/w2 encode a bigram table (rank = V): the
    target's one-token logits, or `bigrams` [prev, next] when given, so drafts are often right and the round
    loop gets exercised past slot 0."""
    v = model_parts.vocab_size(target)
    vd = v if draft_ids is None else len(draft_ids)
    if markov_strength > 0:
        assert rank == v
        table = bigram_table(target) if bigrams is None else bigrams  # [prev, next]
        cols = table if draft_ids is None else table[:, list(draft_ids)]
        w1 = np.eye(v, dtype=np.float32)
        w2 = (markov_strength * cols.T).astype(np.float32)  # [vd, r=v]
    else:
        w1 = _rand(rng, (v, rank), 1.0)
        w2 = _rand(rng, (vd, rank))
    t = {
        "markov_head.markov_w1.weight": w1,
        "markov_head.markov_w2.weight": w2,
        "confidence_head.proj.weight": _rand(rng, (1, HIDDEN + rank)),
    }
    if confidence_bias:
        t["confidence_head.proj.bias"] = np.array([0.5], dtype=np.float32)
    return t


def write_dspark(
    path: Path,
    target: Any,
    *,
    packaging: str = "deepspec",
    layer_ids: Sequence[int] = (1, 3),
    block_size: int = 5,
    layers: int = 2,
    seed: int = 0,
    draft_vocab: int | None = None,
    markov_strength: float = 1.0,
    first_slot: int | None = None,
    confidence_bias: bool = True,
    num_target_layers: int = LAYERS,
    bigrams: np.ndarray | None = None,
) -> Path:
    """A DSpark checkpoint in one packaging: "deepspec" (Qwen3DSparkModel, own embed/head), "speculators"
    (speculators_config, reduced draft vocab + d2t when `draft_vocab`), "specforge" (dflash_config with
    projector_type "dspark", target embed/head)."""
    rng = np.random.default_rng(seed)
    v = model_parts.vocab_size(target)
    rank = v if markov_strength > 0 else 16
    tensors = backbone_tensors(rng, layers=layers, n_feats=len(layer_ids))
    draft_ids = None
    if draft_vocab is not None:
        draft_ids = sorted(rng.choice(v, size=draft_vocab, replace=False).tolist())
    tensors.update(
        dspark_head_tensors(
            rng,
            target=target,
            rank=rank,
            draft_ids=draft_ids,
            confidence_bias=confidence_bias,
            markov_strength=markov_strength,
            bigrams=bigrams,
        )
    )
    # Base logits are kept small next to the Markov bias so drafts follow the bigram table.
    embed = np.array(model_parts.embedding(target).weight)
    head = head_weight(target) * (0.2 if markov_strength > 0 else 1.0)
    markov = {"markov_rank": rank, "markov_head_type": "vanilla"}
    conf = {"enable_confidence_head": True, "confidence_head_with_markov": True}
    if packaging == "deepspec":
        cfg: dict[str, Any] = {
            "architectures": ["Qwen3DSparkModel"],
            "model_type": "qwen3",
            "num_target_layers": num_target_layers,
            "layer_types": ["full_attention"] * layers,
            "block_size": block_size,
            "mask_token_id": v - 1,
            "target_layer_ids": list(layer_ids),
            "num_anchors": 512,
            "tie_word_embeddings": False,
            "rope_theta": 1e6,
            "sliding_window": None,
            **markov,
            **conf,
            **_layer_config(layers, v),
        }
        if first_slot is not None:
            cfg["logits_start"] = first_slot
        tensors["embed_tokens.weight"] = embed
        tensors["lm_head.weight"] = head
    elif packaging == "speculators":
        cfg = {
            "architectures": ["DSparkSpeculator"],
            "speculators_model_type": "dspark",
            "speculators_config": {
                "algorithm": "dspark",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": "tiny/target", "architectures": ["Qwen3ForCausalLM"]},
            },
            "transformer_layer_config": {"model_type": "qwen3", "rope_theta": 1e6, **_layer_config(layers, v)},
            "draft_vocab_size": draft_vocab or v,
            "block_size": block_size,
            "aux_hidden_state_layer_ids": list(layer_ids),
            "mask_token_id": v - 1,
            "sample_from_anchor": first_slot in (None, 0),
            **markov,
            **conf,
        }
        tensors["verifier_norm.weight"] = np.ones((HIDDEN,), np.float32)
        if draft_ids is not None:
            d = np.array(draft_ids, dtype=np.int64)
            tensors["d2t"] = d - np.arange(len(d))
            tensors["lm_head.weight"] = head[d]
    elif packaging == "specforge":
        cfg = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "num_target_layers": num_target_layers,
            "rope_theta": 1e6,
            "dflash_config": {
                "projector_type": "dspark",
                "block_size": block_size,
                "mask_token_id": v - 1,
                "target_layer_ids": list(layer_ids),
                **markov,
                **conf,
                **({} if first_slot is None else {"logits_start": first_slot}),
            },
            **_layer_config(layers, v),
        }
    else:
        raise ValueError(packaging)
    return save(path, cfg, tensors)


def head_weight(target: Any) -> np.ndarray:
    """The target's LM head matrix [V, H] (the embedding when tied)."""
    owner = model_parts._owner(target)
    w = owner.lm_head.weight if "lm_head" in owner else model_parts.embedding(target).weight
    return np.array(w.astype(mx.float32))


# ---------------------------------------------------------------- Gemma-4 DSpark (DeepSpec Gemma4DSparkModel)

# The Gemma-4 text fields a serialised Gemma4TextConfig carries beside a tiny target's own config.json
# (tests.fakes.tiny_models.hf_config): its defaults, as the drafter's deep copy would hold them.
GEMMA4_TEXT_DEFAULTS: dict[str, Any] = {
    "hidden_activation": "gelu_pytorch_tanh",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_k_eq_v": False,
    "num_global_key_value_heads": None,
    "use_double_wide_mlp": False,
    "enable_moe_block": False,
    "use_bidirectional_attention": None,
    "initializer_range": 0.02,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
}


def gemma4_dspark_config(
    text_config: dict[str, Any],
    *,
    layers: int = 2,
    layer_ids: Sequence[int] = (0, 5),
    block_size: int = 5,
    mask_token_id: int | None = None,
    markov_rank: int = 0,
) -> dict[str, Any]:
    """config.json of a DeepSpec `Gemma4DSparkModel`: a copy of the target's Gemma-4 text config with the
    fields DeepSpec's `build_draft_config` sets (dense layers, all full attention, DSpark keys)."""
    cfg = json.loads(json.dumps(text_config))
    cfg.update(
        architectures=["Gemma4DSparkModel"],
        target_model_type="gemma4",
        target_text_model_type=cfg.get("model_type", "gemma4_text"),
        num_target_layers=cfg["num_hidden_layers"],
        num_hidden_layers=layers,
        enable_moe_block=False,
        hidden_size_per_layer_input=0,
        block_size=block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * layers,
        mask_token_id=cfg["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=list(layer_ids),
        num_anchors=512,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        markov_rank=markov_rank,
        markov_head_type="vanilla",
        dtype="bfloat16",
    )
    return cfg


def gemma4_mlp_widths(cfg: dict[str, Any]) -> list[int]:
    """Each drafter layer's MLP width: Gemma-4's MLP is double-wide on KV-shared layers (the last
    `num_kv_shared_layers` of the drafter's own depth) when `use_double_wide_mlp`."""
    n, inter = cfg["num_hidden_layers"], cfg["intermediate_size"]
    first_shared = n - int(cfg.get("num_kv_shared_layers") or 0)
    double = bool(cfg.get("use_double_wide_mlp")) and first_shared > 0
    return [2 * inter if double and i >= first_shared else inter for i in range(n)]


def gemma4_backbone_tensors(rng: np.random.Generator, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Random backbone tensors of a `Gemma4DSparkModel` with its state_dict names (no prefix; Linear weights
    [out, in]; `layer_scalar` [1] is a persistent buffer; `v_norm` has no weight; no `v_proj` with k=v)."""
    h, nh, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["global_head_dim"]
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    kv = cfg["num_global_key_value_heads"] if k_eq_v else cfg["num_key_value_heads"]
    m = len(cfg["target_layer_ids"])
    t: dict[str, np.ndarray] = {
        "fc.weight": _rand(rng, (h, m * h)),
        "hidden_norm.weight": 1 + _rand(rng, (h,), 0.1),
        "norm.weight": 1 + _rand(rng, (h,), 0.1),
    }
    for i, inter in enumerate(gemma4_mlp_widths(cfg)):
        p = f"layers.{i}."
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            t[p + f"{norm}_layernorm.weight"] = 1 + _rand(rng, (h,), 0.1)
        t[p + "layer_scalar"] = np.array([0.5 + rng.random()], dtype=np.float32)
        t[p + "self_attn.q_proj.weight"] = _rand(rng, (nh * hd, h))
        t[p + "self_attn.k_proj.weight"] = _rand(rng, (kv * hd, h))
        if not k_eq_v:
            t[p + "self_attn.v_proj.weight"] = _rand(rng, (kv * hd, h))
        t[p + "self_attn.o_proj.weight"] = _rand(rng, (h, nh * hd))
        t[p + "self_attn.q_norm.weight"] = 1 + _rand(rng, (hd,), 0.1)
        t[p + "self_attn.k_norm.weight"] = 1 + _rand(rng, (hd,), 0.1)
        t[p + "mlp.gate_proj.weight"] = _rand(rng, (inter, h))
        t[p + "mlp.up_proj.weight"] = _rand(rng, (inter, h))
        t[p + "mlp.down_proj.weight"] = _rand(rng, (h, inter))
    return t


def write_gemma4_dspark(
    path: Path,
    target: Any,
    text_config: dict[str, Any],
    *,
    layers: int = 2,
    layer_ids: Sequence[int] = (0, 5),
    block_size: int = 5,
    seed: int = 0,
    bigrams: np.ndarray | None = None,
) -> Path:
    """A DeepSpec Gemma-4 DSpark checkpoint for `target` (a tiny Gemma-4 whose config is `text_config`): own
    copies of the target's embedding and (damped) head, a Markov head from `bigrams` (rank = V) or a random
    rank-16 one, a confidence head with bias."""
    rng = np.random.default_rng(seed)
    v = model_parts.vocab_size(target)
    rank = v if bigrams is not None else 16
    cfg = gemma4_dspark_config(text_config, layers=layers, layer_ids=layer_ids, block_size=block_size, markov_rank=rank)
    tensors = gemma4_backbone_tensors(rng, cfg)
    tensors.update(
        dspark_head_tensors(
            rng, target=target, rank=rank, markov_strength=1.0 if bigrams is not None else 0.0, bigrams=bigrams
        )
    )
    tensors["embed_tokens.weight"] = np.array(model_parts.embedding(target).weight.astype(mx.float32))
    # Base logits are kept small next to the Markov bias so drafts follow the transition table.
    tensors["lm_head.weight"] = head_weight(target) * (0.2 if bigrams is not None else 1.0)
    return save(path, cfg, tensors)
