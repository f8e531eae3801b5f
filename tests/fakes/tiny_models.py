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

VOCAB = 192
HIDDEN = 64
GEMMA_WINDOW = 8

FAMILIES = ("llama", "qwen3", "gemma3_text", "qwen3_5", "qwen3_moe")

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
}


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A freshly initialized tiny mlx-lm model of `family` (float32, eval mode).

    Args:
        family: one of FAMILIES (an mlx-lm `model_type`).
        seed: the MLX random seed used for the weights.
        **overrides: config fields to change (e.g. head_dim=32 for 32-wide KV quantization groups).

    Returns:
        The mlx-lm `Model`, ready for `make_prompt_cache` and generation.
    """
    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = module.ModelArgs.from_dict({"model_type": family, **CONFIGS[family], **overrides})
    mx.random.seed(seed)
    model = module.Model(args)
    # Wider weights give sharper, input-dependent logits; norms (1-D) stay as they are.
    params = [(k, v * 2.5 if v.ndim >= 2 else v) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    model.eval()
    mx.eval(model.parameters())
    return model
