"""BitNet's BitLinear as an exact 2-bit QuantizedLinear: the unpacking against a hand-written reading of the
packed bytes, and the layer's output against scale · x @ W.T."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models.bitlinear_layers import BitLinear

from mlx_dspark.adapters.mlx.ternary import portable_ternary, ternary_linear, unpack_ternary


def packed_layer(out_features: int, in_features: int, scale: float, *, invert: bool, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    w = rng.integers(-1, 2, size=(out_features, in_features))  # the ternary matrix
    quarter = out_features // 4
    packed = np.zeros((quarter, in_features), np.uint8)
    for k in range(4):  # row r + k·out/4 in bits 2k of packed row r, stored as w + 1
        packed |= ((w[k * quarter : (k + 1) * quarter] + 1).astype(np.uint8) << (2 * k)).astype(np.uint8)
    layer = BitLinear(in_features, out_features, bias=False, invert_weight_scales=invert)
    layer.weight = mx.array(packed)
    layer.weight_scale = mx.array([scale], dtype=mx.float32)
    return layer, w


def test_unpacking_reads_the_bytes_as_bitlinear_lays_them_out() -> None:
    layer, w = packed_layer(16, 64, 0.5, invert=False, seed=0)
    assert np.array_equal(np.array(unpack_ternary(layer.weight, 16)), w)


@pytest.mark.parametrize("invert", [False, True])
def test_a_model_s_bitlinears_become_exact_two_bit_layers(invert: bool) -> None:
    layer, w = packed_layer(32, 96, 0.37, invert=invert, seed=1)  # 96: the 32-wide group
    model = nn.Sequential(layer)
    assert portable_ternary(model) == 1
    q = model.layers[0]
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (2, 32)
    x = mx.random.normal((3, 96), key=mx.random.key(2))
    scale = 1 / 0.37 if invert else 0.37
    np.testing.assert_allclose(np.array(q(x)), scale * np.array(x) @ w.T, rtol=1e-5, atol=1e-5)


def test_a_width_no_group_divides_is_refused() -> None:
    with pytest.raises(ValueError, match="no 2-bit group size"):
        ternary_linear(mx.zeros((4, 48), dtype=mx.int8), 1.0, None)
