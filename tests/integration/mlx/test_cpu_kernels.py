"""The CPU kernels (attention, SwiGLU) equal MLX's own (within float32 rounding) and take only the calls they may."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_dspark.adapters.mlx import cpu_kernels
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.tiny_models import VOCAB, tiny_model

TOL = 2e-5


def _qkv(lq: int, lk: int, hq: int = 6, hk: int = 2, d: int = 16, seed: int = 0) -> tuple[mx.array, ...]:
    mx.random.seed(seed)
    q = mx.random.normal((1, hq, lq, d)) * 2
    k = mx.random.normal((1, hk, lk, d)) * 2
    v = mx.random.normal((1, hk, lk, d))
    return q, k, v


@pytest.mark.parametrize(
    ("lq", "lk"),
    [(2, 2), (5, 5), (64, 64), (65, 200), (130, 130), (7, 300), (200, 1000)],  # tile edges, offsets
)
@pytest.mark.parametrize("causal", [True, False])
def test_equals_mlx_sdpa(lq: int, lk: int, causal: bool) -> None:
    q, k, v = _qkv(lq, lk)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal" if causal else None)
    got = cpu_kernels.attention(q, k, v, scale=0.25, causal=causal)
    assert got.shape == want.shape
    assert mx.max(mx.abs(got - want)).item() < TOL


def test_tiles_spread_over_workers_fill_every_batch_row_and_head() -> None:
    mx.random.seed(3)
    q, k, v = mx.random.normal((2, 6, 150, 16)), mx.random.normal((2, 3, 400, 16)), mx.random.normal((2, 3, 400, 16))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert mx.max(mx.abs(cpu_kernels.attention(q, k, v, scale=0.25, causal=True) - want)).item() < TOL


def test_a_causal_query_never_sees_later_keys() -> None:
    q, k, v = _qkv(8, 8, hq=2, hk=1)
    base = cpu_kernels.attention(q, k, v, scale=1.0, causal=True)
    poisoned = mx.concatenate([v[:, :, :7], v[:, :, 7:] + 1e6], axis=2)  # only the last key changes
    changed = cpu_kernels.attention(q, k, poisoned, scale=1.0, causal=True)
    assert mx.max(mx.abs(changed[:, :, :7] - base[:, :, :7])).item() == 0.0
    assert mx.max(mx.abs(changed[:, :, 7] - base[:, :, 7])).item() > 1.0


def test_only_wide_float32_causal_or_unmasked_calls_apply() -> None:
    q, k, _ = _qkv(64, 4096, hq=1, hk=1)
    assert cpu_kernels.applies(q, k, "causal", None)
    assert cpu_kernels.applies(q, k, None, None)
    assert not cpu_kernels.applies(q[:, :, :2], k[:, :, :64], "causal", None)  # below MIN_SCORES
    assert not cpu_kernels.applies(q[:, :, :1], mx.concatenate([k] * 80, axis=2), "causal", None)  # a plain step
    assert not cpu_kernels.applies(q, k, mx.zeros((64, 4096), dtype=mx.bool_), None)  # an array mask
    assert not cpu_kernels.applies(q, k, "causal", mx.zeros((1,)))  # sinks
    assert not cpu_kernels.applies(q.astype(mx.bfloat16), k.astype(mx.bfloat16), "causal", None)


def test_outside_a_target_forward_mlx_sdpa_is_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[int] = []
    real = cpu_kernels.attention
    monkeypatch.setattr(cpu_kernels, "attention", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    monkeypatch.setattr(cpu_kernels, "MIN_SCORES", 1)
    q, k, v = _qkv(4, 4)
    cpu_kernels.install(tiny_model("llama", seed=0))
    with cpu_kernels.active():
        inside = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal")
    outside = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal")
    assert taken == [1]  # only the call inside the block
    assert mx.max(mx.abs(inside - outside)).item() < TOL


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_prefill_through_the_cpu_path_decodes_as_mlx_alone(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = [(i * 37) % (VOCAB - 8) + 8 for i in range(150)]
    model = tiny_model(family, seed=3)
    outs = []
    for least in (1 << 62, 1):  # MLX's kernels everywhere, then the CPU path for every call it may take
        monkeypatch.setattr(cpu_kernels, "MIN_SCORES", least)
        monkeypatch.setattr(cpu_kernels, "MIN_SWIGLU", least)
        target = MlxTargetModel(model, prefill_chunk=32)
        token = target.prefill(prompt, SamplingParams(), 0.5)
        ids = [token]
        for _ in range(12):
            ids.append(target.verify(ids[-1], DraftBlock(), SamplingParams(), [0.5]).next_token)
            target.commit(1)
        outs.append(ids)
    assert outs[0] == outs[1]


def test_the_prefill_chunk_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_dspark.adapters.mlx import target as target_mod

    assert MlxTargetModel(tiny_model("llama", seed=0))._prefill_chunk == target_mod.CPU_PREFILL_CHUNK
    monkeypatch.setattr(cpu_kernels, "on_cpu", lambda: False)
    assert MlxTargetModel(tiny_model("llama", seed=0))._prefill_chunk == target_mod.GPU_PREFILL_CHUNK
    assert MlxTargetModel(tiny_model("llama", seed=0), prefill_chunk=7)._prefill_chunk == 7


def test_swiglu_equals_mlx_and_is_taken_only_inside_a_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    model = tiny_model("llama", seed=0)
    MlxTargetModel(model)  # installs the wrapper in the model's own module
    module = sys.modules[type(model.model.layers[0].mlp).__module__]
    wrapped = module.swiglu
    original = wrapped.__wrapped__
    mx.random.seed(1)
    gate, x = mx.random.normal((3, 70, 400)) * 4, mx.random.normal((3, 70, 400))
    calls: list[int] = []
    real = cpu_kernels._numpy_swiglu
    monkeypatch.setattr(cpu_kernels, "_numpy_swiglu", lambda g, u: calls.append(1) or real(g, u))
    with cpu_kernels.active():
        inside = wrapped(gate, x)
        small = wrapped(gate[:1, :1], x[:1, :1])  # below MIN_SWIGLU
    outside = wrapped(gate, x)
    assert calls == [1]
    assert mx.max(mx.abs(inside - original(gate, x))).item() < 1e-4
    assert mx.max(mx.abs(outside - original(gate, x))).item() == 0.0
    assert small.shape == (1, 1, 400)
    MlxTargetModel(model)
    assert module.swiglu is wrapped  # installed once
