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
