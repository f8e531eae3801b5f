"""Each family's tiny model written as a checkpoint in its published layout (config.json, safetensors, tokenizer)
and loaded back through the project's loader: the same logits as the model it was written from. The ternary
rows: a Qwen3 whose weights are {-s, 0, +s} per group in MLX's 2-bit affine format (PrismML's Bonsai layout),
and BitNet b1.58's BitLinear packing, which loads off Metal as exact 2-bit layers (adapters/mlx/ternary.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten

from mlx_dspark.adapters.hf.loader import HfModelLoader
from mlx_dspark.application.settings import ModelSettings
from tests.fakes.tiny_models import FAMILIES, TERNARY_GROUP, VOCAB, hf_config, tiny_model
from tests.integration.hf import tiny_models as hf_tiny

IDS = [3, 1, 4, 1, 5, 9, 2, 6]


def write_checkpoint(path: Path, family: str, model: nn.Module, **config_extra: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {**hf_config(family), **config_extra}
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], "vocab_size": VOCAB}
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    hf_tiny.hf_tokenizer().save_pretrained(str(path))
    return path


def load(tmp_path: Path, path: Path) -> nn.Module:
    return HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "cache"))).load_checkpoint(str(path)).model


def logits(model: nn.Module) -> np.ndarray:
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_published_layout_loads_to_the_same_model(tmp_path: Path, family: str) -> None:
    model = tiny_model(family, seed=0)
    published = tiny_model(family, seed=0, portable=False)  # BitNet: BitLinear's packed bytes, as released
    loaded = load(tmp_path, write_checkpoint(tmp_path / family, family, published))
    np.testing.assert_allclose(logits(loaded), logits(model), rtol=1e-5, atol=1e-5)


def test_the_ternary_row_is_ternary_in_mlx_2bit_and_loads_quantized(tmp_path: Path) -> None:
    model = tiny_model("qwen3_ternary", seed=0)
    q = model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and q.bits == 2
    w = mx.dequantize(q.weight, q.scales, q.biases, group_size=TERNARY_GROUP, bits=2)
    ratio = w / mx.repeat(q.scales, TERNARY_GROUP, axis=1)
    assert set(np.unique(np.round(np.array(ratio), 6))) == {-1.0, 0.0, 1.0}  # truly ternary
    loaded = load(tmp_path, write_checkpoint(tmp_path / "bonsai", "qwen3_ternary", model))
    assert isinstance(loaded.layers[0].mlp.down_proj, nn.QuantizedLinear)
    np.testing.assert_allclose(logits(loaded), logits(model), rtol=1e-5, atol=1e-5)
