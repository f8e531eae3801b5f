"""Fused sibling projections (`fused_projections`): q/k/v and gate/up as one product each, the same logits bit for
bit on this CPU's kernels, nothing held past a layer, nothing fused that would change a result or read a lazily
loaded rank's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_dspark.adapters.hf.loader import HfModelLoader
from mlx_dspark.adapters.mlx import forward_cost, fused_projections
from mlx_dspark.adapters.mlx.blas import blas_status
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.settings import ModelSettings
from tests.fakes.tiny_models import FAMILIES, tiny_model
from tests.integration.families.test_family_checkpoints import write_checkpoint

SHIM = (blas_status() or None) is not None and blas_status().name == "openblas-shim"  # type: ignore[union-attr]
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]


def forwards(model: nn.Module, prompt: int = 12) -> list[mx.array]:
    """Logits of a prefill of `prompt` tokens, then of 1, 4 and 16 rows after it (a step, verifies, a DFlash
    block)."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([PROMPT[:prompt]]), cache=cache)]
    for rows in (1, 4, 16):
        out.append(model(mx.array([PROMPT[:rows]]), cache=cache))
    mx.eval(out)
    return out


def groups_of(model: nn.Module) -> int:
    return sum(
        isinstance(m, nn.Module) and n.endswith(("qkv_fused", "gate_up_fused")) for n, m in model.named_modules()
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_the_same_logits_bit_for_bit(family: str) -> None:
    model, plain = tiny_model(family, seed=3), tiny_model(family, seed=3)
    before = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    fused = fused_projections.install(model)
    assert fused == groups_of(model)
    if family in ("llama", "qwen3", "gemma3_text"):  # dense attention and MLP in every layer
        assert fused == 2 * len(model.layers)
    assert sum(v.nbytes for _, v in tree_flatten(model.parameters())) == before  # the originals are gone
    # Products of up to 16 rows run the BLAS shim's kernel, whose sums do not depend on the weight's width;
    # a wider prefill runs OpenBLAS's GEMM, whose edge tiles may round another width's columns differently
    # (a plain step and a verify share the fused weights, so decoding is exact either way).
    exact = SHIM
    for got, want in zip(forwards(model), forwards(plain), strict=True):
        assert mx.array_equal(got, want).item() if exact else mx.allclose(got, want, atol=1e-4).item(), family
    for got, want in zip(forwards(model, 24), forwards(plain, 24), strict=True):
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), family


def test_quantized_projections_fuse_too() -> None:
    model, plain = tiny_model("llama", seed=4), tiny_model("llama", seed=4)
    for m in (model, plain):
        nn.quantize(m, group_size=32, bits=4)
    assert fused_projections.install(model) == 2 * len(model.layers)
    assert type(model.layers[0].self_attn["qkv_fused"]) is nn.QuantizedLinear
    for got, want in zip(forwards(model, 24), forwards(plain, 24), strict=True):
        assert mx.array_equal(got, want).item()  # MLX's quantized kernels: one column's sum, whatever the width


def test_biases_are_fused_with_their_columns() -> None:
    siblings = [nn.Linear(32, width, bias=True) for width in (48, 16, 16)]
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = siblings
    x = mx.random.normal((2, 5, 32), key=mx.random.key(0))
    want = [m(x) for m in siblings]
    assert fused_projections.install(parent) == 1
    assert [p.output_dims for p in (parent.q_proj, parent.k_proj, parent.v_proj)] == [48, 16, 16]
    for got, expected in zip((parent.q_proj(x), parent.k_proj(x), parent.v_proj(x)), want, strict=True):
        assert mx.allclose(got, expected, atol=1e-5, rtol=1e-5).item()


class Counting:
    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, x: mx.array) -> mx.array:
        self.calls += 1
        return self.inner(x)


def test_siblings_share_one_product_and_nothing_is_held_after_the_layer() -> None:
    model = tiny_model("qwen3", seed=5)
    fused_projections.install(model)
    attention = model.layers[0].self_attn
    shared = attention.q_proj._holder[0]
    counting = shared.fused = Counting(shared.fused)
    forwards(model)
    assert counting.calls == 4  # one product per forward for q, k and v together
    assert shared._local.x is None and shared._local.parts is None


def test_a_part_given_another_input_computes_its_own() -> None:
    plain = [nn.Linear(32, 8, bias=False) for _ in range(2)]
    parent = nn.Module()
    parent.gate_proj, parent.up_proj = plain
    a, b = (mx.random.normal((3, 32), key=mx.random.key(i)) for i in (1, 2))
    want_gate, want_up = plain[0](a), plain[1](b)
    fused_projections.install(parent)
    assert mx.allclose(parent.gate_proj(a), want_gate, atol=1e-5).item()
    assert mx.allclose(parent.up_proj(b), want_up, atol=1e-5).item()  # not a's columns


def test_siblings_that_differ_are_left_as_they_are() -> None:
    parent = nn.Module()
    parent.q_proj, parent.k_proj = nn.Linear(32, 32), nn.Linear(32, 16)
    parent.v_proj = nn.QuantizedLinear(32, 16, group_size=32, bits=4)
    parent.gate_proj, parent.up_proj = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=True)
    assert fused_projections.install(parent) == 0
    assert type(parent.q_proj) is nn.Linear and type(parent.gate_proj) is nn.Linear


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama", seed=1)
    monkeypatch.setenv(fused_projections.ENV, "off")
    assert fused_projections.install(model) == 0 and groups_of(model) == 0
    monkeypatch.setenv(fused_projections.ENV, "sometimes")
    with pytest.raises(ValueError, match="on or off"):
        fused_projections.enabled()
    monkeypatch.setenv(fused_projections.ENV, "ON")
    assert fused_projections.install(model) == 2 * len(model.layers)
    assert fused_projections.install(model) == 0  # idempotent


def test_the_target_fuses_and_counts_its_attention_width_as_before() -> None:
    model, plain = tiny_model("qwen3", seed=2), tiny_model("qwen3", seed=2)
    want = forward_cost.forward_cost(plain.layers)
    MlxTargetModel(model)
    assert groups_of(model) == 2 * len(model.layers)
    assert forward_cost.forward_cost(model.layers) == want
    MlxTargetModel(plain, fuse=False)
    assert groups_of(plain) == 0


def test_a_lazily_loading_loader_leaves_the_weights_unread(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "llama", "llama", tiny_model("llama", seed=0))
    settings = ModelSettings(cache_dir=str(tmp_path / "cache"))
    lazy = HfModelLoader(settings, lazy=True, auto_install=False).load_target(str(path))
    eager = HfModelLoader(settings, auto_install=False).load_target(str(path))
    assert groups_of(lazy.handle) == 0  # a tensor-parallel rank shards it next, reading only its shard
    assert groups_of(eager.handle) == 2 * len(eager.handle.layers)


def test_each_group_s_originals_are_released_before_the_next_is_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory never holds both copies of more than one group (a 1.5B float32 target: +3.3 GB peak otherwise)."""
    import gc
    import weakref

    model = tiny_model("llama", seed=6)
    fuse = fused_projections._fuse
    earlier: list[weakref.ref[nn.Module]] = []
    alive: list[int] = []

    def spy(modules: list[nn.Module]) -> nn.Module:
        gc.collect()
        alive.append(sum(ref() is not None for ref in earlier))
        earlier.extend(weakref.ref(m) for m in modules)
        return fuse(modules)

    monkeypatch.setattr(fused_projections, "_fuse", spy)
    assert fused_projections.install(model) == 2 * len(model.layers)
    assert alive == [0] * len(alive)
