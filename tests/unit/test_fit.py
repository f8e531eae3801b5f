"""The fit estimator's arithmetic against figures computed by hand."""

from __future__ import annotations

import pytest

from mlx_dspark.domain import fit
from tests.fakes.configs import LLAMA8B

GIB = 1 << 30
# embed + lm_head: 2 × 128256×4096 bf16; per layer 4096×6144 + 4096×4096 + 3×4096×14336 bf16
LLAMA8B_WEIGHTS = 2 * 128256 * 4096 * 2 + 32 * 2 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)


def test_llama_shape_and_kv_cache() -> None:
    shape = fit.shape_from_config(LLAMA8B)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.max_context) == (32, 8, 128, 8192)
    assert shape.sliding_layers == 0 and shape.bits is None and shape.dtype == "bfloat16"
    # K and V × 8 heads × 128 × 2 bytes × 32 layers = 131072 bytes per token
    assert fit.kv_cache_bytes(shape, 1) == 131072
    assert fit.kv_cache_bytes(shape, 4096) == 512 * (1 << 20)
    assert fit.kv_cache_bytes(shape, 8192) == GIB


def test_weight_bytes_from_safetensors_dtypes() -> None:
    assert LLAMA8B_WEIGHTS == 16_059_990_016
    tensors = {"embed": ("BF16", [128256, 4096]), "lm_head": ("BF16", [128256, 4096])}
    for i in range(32):
        tensors[f"{i}.a"] = ("BF16", [4096, 6144])
        tensors[f"{i}.o"] = ("BF16", [4096, 4096])
        tensors[f"{i}.m"] = ("BF16", [3, 4096, 14336])
    assert fit.weight_bytes(tensors) == LLAMA8B_WEIGHTS
    # MLX 4-bit: a 4096×4096 matrix packs into 4096×512 uint32 plus fp16 scales and biases per 64 columns
    packed = {"w": ("U32", [4096, 512]), "scales": ("F16", [4096, 64]), "biases": ("F16", [4096, 64])}
    assert fit.weight_bytes(packed) == 4096 * 512 * 4 + 2 * 4096 * 64 * 2 == 9_437_184


def test_llama_rows_against_usable_memory() -> None:
    shape = fit.shape_from_config(LLAMA8B)
    overhead = 512 * (1 << 20) + int(0.05 * LLAMA8B_WEIGHTS)
    assert overhead == 1_339_870_412
    at_20 = fit.estimate(shape, LLAMA8B_WEIGHTS, 20 * GIB)
    assert [r.context for r in at_20.rows] == [4096, 8192]  # 32k is past the model's maximum
    r4k, r8k = at_20.rows
    assert r4k.total == LLAMA8B_WEIGHTS + 512 * (1 << 20) + overhead == 17_936_731_340
    assert r8k.total == LLAMA8B_WEIGHTS + GIB + overhead == 18_473_602_252
    # 20 GiB: 80% is 17.18e9, so both are tight but fit; 24 GiB: 4k is comfortable; 16 GiB: neither fits
    assert [r.verdict for r in at_20.rows] == [fit.Verdict.YELLOW, fit.Verdict.YELLOW]
    assert [r.verdict for r in fit.estimate(shape, LLAMA8B_WEIGHTS, 24 * GIB).rows] == [
        fit.Verdict.GREEN,
        fit.Verdict.GREEN,
    ]
    assert {r.verdict for r in fit.estimate(shape, LLAMA8B_WEIGHTS, 16 * GIB).rows} == {fit.Verdict.RED}


def test_a_drafter_is_counted_in_every_row() -> None:
    shape = fit.shape_from_config(LLAMA8B)
    plain = fit.estimate(shape, LLAMA8B_WEIGHTS, 24 * GIB)
    with_drafter = fit.estimate(shape, LLAMA8B_WEIGHTS, 24 * GIB, drafter=28_000_000)
    assert [b.total - a.total for a, b in zip(plain.rows, with_drafter.rows)] == [28_000_000, 28_000_000]


def test_sliding_window_layers_hold_at_most_their_window() -> None:
    gemma = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_size": 1152,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 32768,
    }
    shape = fit.shape_from_config(gemma)
    assert (shape.sliding_layers, shape.sliding_window) == (22, 512)  # 26 // 6 = 4 global layers
    # per token per layer: K and V × 1 head × 256 × 2 bytes = 1024
    assert fit.kv_cache_bytes(shape, 4096) == 4 * 4096 * 1024 + 22 * 512 * 1024 == 28_311_552
    assert fit.kv_cache_bytes(shape, 32768) == 4 * 32768 * 1024 + 22 * 512 * 1024
    assert [r.context for r in fit.estimate(shape, 1, GIB).rows] == [4096, 8192, 32768]


def test_layer_types_and_nested_text_config_and_quantization() -> None:
    config = {
        "model_type": "gemma3",
        "quantization": {"bits": 4, "group_size": 64},
        "text_config": {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "hidden_size": 512,
            "sliding_window": 1024,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            "max_position_embeddings": 131072,
        },
    }
    shape = fit.shape_from_config(config)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.bits) == (4, 2, 64, 4)
    assert (shape.sliding_layers, shape.sliding_window, shape.max_context) == (3, 1024, 131072)
    rows = fit.estimate(shape, 10, 64 * GIB).rows
    assert [r.context for r in rows] == [4096, 8192, 32768, 131072]


def test_qwen_sliding_window_off_means_full_attention() -> None:
    qwen = {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "sliding_window": 4096,
            "use_sliding_window": False}  # fmt: skip
    assert fit.shape_from_config(qwen).sliding_layers == 0


def test_a_config_without_layer_counts_is_refused() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        fit.shape_from_config({"model_type": "mystery"})


def test_hybrid_ssm_and_shared_kv_layers_count_what_they_cache() -> None:
    """Published shapes, by hand: only attention layers grow with the context; recurrent layers hold a fixed state."""
    qwen3_next = {  # Qwen3-Next-80B-A3B: attention every 4th layer, gated DeltaNet elsewhere
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "hidden_size": 2048, "full_attention_interval": 4, "linear_num_value_heads": 32, "linear_num_key_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 262144,
    }  # fmt: skip
    s = fit.shape_from_config(qwen3_next)
    assert (s.kv_layers, s.state_layers) == (12, 36)
    assert fit.kv_cache_bytes(s, 1000) == 12 * 2 * 2 * 256 * 2 * 1000
    # conv: 3 × (2·16·128 + 32·128) bf16; state: 32 × 128 × 128 float32
    assert s.state_bytes == 36 * (3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 4)
    nemotron = {  # Mamba-2, MLP/MoE and attention blocks by pattern
        "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 2688, "hybrid_override_pattern": "ME*EM-", "mamba_num_heads": 64, "mamba_head_dim": 64,
        "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    }  # fmt: skip
    s = fit.shape_from_config(nemotron)
    assert (s.kv_layers, s.state_layers) == (1, 2)
    assert s.state_bytes == 2 * (3 * (64 * 64 + 2 * 8 * 128) * 2 + 64 * 64 * 128 * 4)
    lfm2 = {
        "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 2048,
        "layer_types": ["conv", "conv", "full_attention", "conv"], "conv_L_cache": 3,
    }  # fmt: skip
    s = fit.shape_from_config(lfm2)
    assert (s.kv_layers, s.state_layers, s.state_bytes) == (1, 3, 3 * 2 * 2048 * 2)
    gemma4 = {  # 35 layers, the last 20 read earlier layers' KV; global layers have their own head shape
        "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
        "global_head_dim": 512, "sliding_window": 512, "sliding_window_pattern": 5, "num_kv_shared_layers": 20,
        "max_position_embeddings": 131072,
    }  # fmt: skip
    s = fit.shape_from_config(gemma4)
    kinds = fit.layer_kinds(gemma4, 35)
    assert kinds[:15].count("full") == 3 and kinds[15:] == ["shared"] * 20
    assert (s.kv_layers, s.sliding_layers) == (15, 12)
    assert fit.kv_cache_bytes(s, 4096) == 3 * 2 * 512 * 2 * 4096 + 12 * 2 * 256 * 2 * 512
    row = fit.estimate(s, GIB, 64 * GIB).rows[0]
    assert row.total == row.weights + row.kv_cache + row.state + row.overhead


def test_moe_active_weights_and_ternary_packed_bytes() -> None:
    tensors = {
        "model.embed_tokens.weight": ("BF16", (1000, 64)),
        "model.layers.0.mlp.switch_mlp.gate_proj.weight": ("BF16", (8, 32, 64)),
        "model.layers.0.mlp.shared_expert.up_proj.weight": ("BF16", (32, 64)),
        "model.layers.0.mlp.experts.3.down_proj.weight": ("BF16", (64, 32)),
    }
    total = fit.weight_bytes(tensors)
    routed = (8 * 32 * 64 + 64 * 32) * 2
    assert (
        fit.active_weight_bytes(tensors, {"num_experts": 8, "num_experts_per_tok": 2}) == total - routed + routed // 4
    )
    assert fit.active_weight_bytes(tensors, {"hidden_size": 64}) == 0  # dense: every weight is read
    # BitNet ternary: four 2-bit weights per stored byte, plus a scale; counted as stored.
    packed = {"q_proj.weight": ("U8", (64 // 4, 64)), "q_proj.weight_scale": ("F32", (1,))}
    assert fit.weight_bytes(packed) == 64 * 64 // 4 + 4
