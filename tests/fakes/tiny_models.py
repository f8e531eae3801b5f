"""Tiny random mlx-lm models of each target family (no downloads): hidden 64, vocab 192, 2–4 layers.

`tiny_model(family, seed)` is deterministic for a seed; weights are scaled up so greedy argmaxes have
clear margins (random init gives near-flat logits, where float noise would decide ties).
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dspark.adapters.mlx.ternary import portable_ternary

VOCAB = 192
HIDDEN = 64
GEMMA_WINDOW = 8
EMBED_GAIN = 0.25

# The seed families (README's family table), each in its published layout's structure at tiny sizes.
# "qwen3_ternary" is a Qwen3 with ternary weights in MLX's 2-bit format (PrismML's Ternary Bonsai layout).
SEED_FAMILIES = (
    "gemma4_text", "lfm2", "lfm2_moe", "muse_glimmer", "minicpm", "nemotron_h", "qwen3_next", "qwen3_5_moe",
    "qwen3_ternary", "bitnet",
)  # fmt: skip
TERNARY_GROUP = 32
MODEL_TYPE = {"qwen3_ternary": "qwen3"}  # families that are another model type's layout
QUANTIZED = ("qwen3_ternary", "bitnet")  # projections are QuantizedLinear (no dense twin, no row products)
FAMILIES = ("llama", "qwen3", "gemma3_text", "qwen3_5", "qwen3_moe", *SEED_FAMILIES)
# How each family's cache can be cut back: "kv" anywhere; "window" (sliding layers) only within the window;
# "recurrent" (DeltaNet, short-conv, Mamba state) never, so rollback restores a snapshot or re-runs.
STATE = {
    "llama": "kv",
    "qwen3": "kv",
    "qwen3_moe": "kv",
    "minicpm": "kv",
    "gemma3_text": "window",
    "gemma4_text": "window",
    "muse_glimmer": "window",
    "qwen3_5": "recurrent",
    "qwen3_next": "recurrent",
    "qwen3_ternary": "kv",
    "qwen3_5_moe": "recurrent",
    "lfm2_moe": "recurrent",
    "bitnet": "kv",
    "lfm2": "recurrent",
    "nemotron_h": "recurrent",
}

_COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "num_hidden_layers": 3, "head_dim": 16, "tie_word_embeddings": False},
    "qwen3": {
        **_COMMON,
        "num_hidden_layers": 3,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
    "gemma3_text": {
        **_COMMON,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 16,
        "sliding_window": GEMMA_WINDOW,
        "sliding_window_pattern": 2,  # layers 0, 2 slide over 8 tokens; 1, 3 are global
    },
    "qwen3_5": {
        "text_config": {
            **_COMMON,
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 4,
            "head_dim": 16,
            "full_attention_interval": 2,  # layers 0, 2 gated DeltaNet; 1, 3 attention
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "tie_word_embeddings": False,
            "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        }
    },
    "qwen3_moe": {
        **_COMMON,
        "num_hidden_layers": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "norm_topk_prob": True,
    },
    # Gemma-4 E-series: sliding/global pattern with wider global heads, per-layer input embeddings, the last
    # layers reusing earlier layers' KV (num_kv_shared_layers), double-wide MLPs there, a final softcap.
    "gemma4_text": {
        **_COMMON,
        "num_hidden_layers": 6,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_key_value_heads": 1,
        "sliding_window": GEMMA_WINDOW,
        "sliding_window_pattern": 3,  # layers 2, 5 are global
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
        "final_logit_softcapping": 30.0,
    },
    # LFM2: short-convolution blocks with attention at a few depths (1.2B: 16 layers, 6 attention).
    "lfm2": {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": HIDDEN,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "rope_theta": 1000000.0,
    },
    # Muse-Glimmer: three local (sliding) layers per global one, centered norms, output multiplier and softcap.
    "muse_glimmer": {
        **_COMMON,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "sliding_window": GEMMA_WINDOW,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "tie_word_embeddings": False,
    },
    # MiniCPM: muP-style scaled embeddings, depth-scaled residuals, logits divided by hidden / dim_model_base.
    "minicpm": {
        **_COMMON,
        "num_hidden_layers": 3,
        "dim_model_base": 16,
        "scale_depth": 1.4,
        "scale_emb": 12.0,
        "tie_word_embeddings": False,
    },
    # Nemotron-H: Mamba-2 blocks, MLPs and a few attention layers, and routed experts (Nemotron-3 Nano's MoE).
    "nemotron_h": {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "E", "*", "-", "M", "E"],
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "n_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    },
    # Qwen3-Next: gated DeltaNet with attention every fourth layer (here every second), routed + shared experts.
    "qwen3_next": {
        **_COMMON,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "norm_topk_prob": True,
    },
}

# Qwen3.6-35B-A3B's layout: the Qwen3.5 hybrid with routed and shared experts in every layer.
CONFIGS["qwen3_5_moe"] = {
    "text_config": {
        **CONFIGS["qwen3_5"]["text_config"],
        "model_type": "qwen3_5_moe_text",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    }
}
# LFM2.5-8B-A1B's layout: LFM2's conv/attention pattern with dense first layers, then routed experts.
CONFIGS["lfm2_moe"] = {
    **{k: v for k, v in CONFIGS["lfm2"].items() if not k.startswith("block_")},
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "use_expert_bias": True,
    "num_dense_layers": 1,
}
CONFIGS["qwen3_ternary"] = {**CONFIGS["qwen3"], "quantization": {"group_size": TERNARY_GROUP, "bits": 2}}
# BitNet b1.58 (microsoft/bitnet-b1.58-2B-4T's layout): BitLinear projections, packed 4 ternary weights a byte.
CONFIGS["bitnet"] = {
    **_COMMON,
    "num_hidden_layers": 3,
    "head_dim": 16,
    "tie_word_embeddings": True,
    "hidden_act": "relu2",
    "quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "offline"},
}


def hf_config(family: str) -> dict[str, Any]:
    """The family's config.json as published: its model_type and (for the ternary row) its quantization."""
    return {"model_type": MODEL_TYPE.get(family, family), **CONFIGS[family]}


def _gain(family: str, name: str) -> float:
    # Gemma-4 post-norms every block's output, so a x2.5 table scaled by sqrt(H) would drown the layers
    # and the tied head would echo the input token; a smaller table keeps the layers in charge.
    if family == "gemma4_text" and "embed_tokens" in name:
        return EMBED_GAIN
    return 2.5


def tiny_model(family: str, seed: int = 0, *, portable: bool = True, **overrides: Any) -> nn.Module:
    """A freshly initialized tiny mlx-lm model of `family` (float32, eval mode).

    Args:
        family: one of FAMILIES (an mlx-lm `model_type`).
        seed: the MLX random seed used for the weights.
        portable: BitNet's BitLinears as exact 2-bit layers off Metal (as the loader does); False keeps the
            published packing (for writing a checkpoint).
        **overrides: config fields to change (e.g. head_dim=32 for 32-wide KV quantization groups); in a family
            whose config nests a `text_config` (Qwen3.5), they change the text config, where mlx-lm reads them
            (set at the top level, mlx-lm would drop them unread).

    Returns:
        The mlx-lm `Model`, ready for `make_prompt_cache` and generation.
    """
    kind = MODEL_TYPE.get(family, family)
    module = importlib.import_module(f"mlx_lm.models.{kind}")
    config = CONFIGS[family]
    if "text_config" in config:
        config = {**config, "text_config": {**config["text_config"], **overrides}}
    else:
        config = {**config, **overrides}
    args = module.ModelArgs.from_dict({"model_type": kind, **config})
    mx.random.seed(seed)
    model = module.Model(args)
    # Wider weights give sharper, input-dependent logits; norms (1-D) stay as they are.
    floats = [(k, v) for k, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    model.update(tree_unflatten([(k, v * _gain(family, k) if v.ndim >= 2 else v) for k, v in floats]))
    if kind == "bitnet":
        _random_bitlinears(model)
        if portable and not mx.metal.is_available():  # as the loader does: BitLinear's kernel is Metal-only
            portable_ternary(model)
    if family == "qwen3_ternary":
        ternarize(model, TERNARY_GROUP)
    model.eval()
    mx.eval(model.parameters())
    return model


def _random_bitlinears(model: nn.Module) -> None:
    """Random ternary codes in every BitLinear (2 bits each, 4 a byte) and a per-layer scale near 1/sqrt(in)."""
    from mlx_lm.models.bitlinear_layers import BitLinear

    for _, mod in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if isinstance(mod, BitLinear):
            fields = mx.random.randint(0, 3, (4, *mod.weight.shape)).astype(mx.uint8)
            mod.weight = sum((fields[k] << (2 * k) for k in range(4)), mx.zeros(mod.weight.shape, mx.uint8))
            mod.weight_scale = mx.array([2.5 / mod.in_features**0.5])


def ternarize(model: nn.Module, group: int) -> None:
    """Every projection of the decoder layers becomes a 2-bit QuantizedLinear holding exact ternary weights:
    codes {0, 1, 2} with scale s and bias -s per group give {-s, 0, +s}. BitNet b1.58's absmean rule:
    s = the group's mean |w|, each weight round(clip(w / s, -1, 1))."""
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in list(parent.children().items()):
                if not isinstance(mod, nn.Linear):
                    continue
                w = mod.weight
                out_dim, in_dim = w.shape
                grouped = w.reshape(out_dim, in_dim // group, group)
                s = mx.abs(grouped).mean(axis=-1)
                codes = mx.where(mx.abs(grouped) > 0.5 * s[..., None], mx.sign(grouped), 0) + 1
                codes = codes.astype(mx.uint32).reshape(out_dim, in_dim // 16, 16)
                q = nn.QuantizedLinear(in_dim, out_dim, bias=False, group_size=group, bits=2)
                q.weight = (codes << (2 * mx.arange(16, dtype=mx.uint32))).sum(axis=-1).astype(mx.uint32)
                q.scales, q.biases = s, -s
                setattr(parent, name, q)
