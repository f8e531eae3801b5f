"""The CPU kernels (attention, SwiGLU) equal MLX's own (within float32 rounding) and take only the calls they may,
with numba's compiled loops and with NumPy's (where numba is missing)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.adapters.mlx import cpu_kernels
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.tiny_models import VOCAB, tiny_model

TOL = 2e-5


@pytest.fixture(params=["numba", "numpy"], autouse=True)
def loops(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test runs on both loop sets: cpu_jit's compiled ones, and NumPy's where numba is absent."""
    compiled = cpu_kernels.jit()
    if request.param == "numba" and compiled is None:
        pytest.fail("numba is a Linux dependency: its loops must build here")
    saved = list(cpu_kernels._JIT)
    cpu_kernels._JIT[:] = [compiled if request.param == "numba" else None]
    yield request.param
    cpu_kernels._JIT[:] = saved


def test_the_compiled_exp_is_within_two_ulp_of_exp_and_saturates_cleanly(loops: str) -> None:
    if loops == "numpy":
        pytest.skip("the compiled exp only")
    from mlx_dspark.adapters.mlx import cpu_jit

    x = np.concatenate([np.linspace(-87.0, 88.0, 200_001, dtype=np.float32), np.float32([0.0, -1e-30, 1e-30])])
    got = np.array([cpu_jit.exp32(v) for v in x[::97]] + [cpu_jit.exp32(v) for v in x[-3:]], dtype=np.float64)
    want = np.exp(np.concatenate([x[::97], x[-3:]]).astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 2 * 2.0**-23
    assert cpu_jit.exp32(np.float32(-87.4)) == 0.0 and cpu_jit.exp32(np.float32(-np.inf)) == 0.0
    assert math.isfinite(cpu_jit.exp32(np.float32(1e4))) and math.isfinite(cpu_jit.exp32(np.float32(np.inf)))


def test_compiled_softmax_rows_zero_every_key_past_the_causal_limit(loops: str) -> None:
    if loops == "numpy":
        pytest.skip("the compiled loops only")
    from mlx_dspark.adapters.mlx import cpu_jit

    rng = np.random.default_rng(0)
    scores = rng.normal(size=(2 * 3, 7)).astype(np.float32) * 30  # 2 heads x a 3-row tile over 7 keys
    totals = np.empty(6, np.float32)
    given = scores.copy()
    cpu_jit.softmax_rows(scores, given[:, :4].max(axis=1), 4, 3, True, totals)
    for r in range(6):
        limit = 4 + r % 3 + 1
        row = np.exp((given[r, :limit] - given[r, :limit].max()).astype(np.float64))  # float32 differences
        assert np.allclose(scores[r, :limit], row, rtol=3e-7, atol=1e-37)
        assert np.all(scores[r, limit:] == 0.0)
        assert totals[r] == pytest.approx(row.sum(), rel=1e-6)


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
        monkeypatch.setattr(cpu_kernels, "MIN_ROPE", least)
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


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(
    ("shape", "dims", "kw"),
    [
        ((1, 6, 300, 64), 64, {"base": 10000.0, "scale": 1.0}),
        ((2, 4, 300, 80), 64, {"base": 1e6, "scale": 0.25}),  # a partial rotation keeps the rest
        ((1, 300, 64), 32, {"base": None, "scale": 1.0, "freqs": "custom"}),  # Llama 3 style frequencies
    ],
)
def test_rope_from_one_table_per_chunk_equals_mlx_bit_for_bit(
    traditional: bool, shape: tuple[int, ...], dims: int, kw: dict[str, object]
) -> None:
    mx.random.seed(2)
    if kw.get("freqs") == "custom":
        kw = {**kw, "freqs": mx.random.uniform(shape=(dims // 2,)) * 100}
    x = mx.random.normal(shape)
    want = cpu_kernels._ORIGINAL_ROPE(x, dims, traditional=traditional, offset=4093, **kw)
    with cpu_kernels.active():
        got = cpu_kernels._rope(x, dims, traditional=traditional, offset=4093, **kw)
        again = cpu_kernels._rope(x * 2, dims, traditional=traditional, offset=4093, **kw)  # the cached table
        moved = cpu_kernels._rope(x, dims, traditional=traditional, offset=17, **kw)  # a new chunk's table
    assert got.shape == want.shape and bool(mx.all(got == want))
    assert bool(mx.all(again == cpu_kernels._ORIGINAL_ROPE(x * 2, dims, traditional=traditional, offset=4093, **kw)))
    assert bool(mx.all(moved == cpu_kernels._ORIGINAL_ROPE(x, dims, traditional=traditional, offset=17, **kw)))


def test_rope_outside_a_forward_or_for_a_batch_or_a_plain_step_is_mlx_own(monkeypatch: pytest.MonkeyPatch) -> None:
    tables: list[int] = []
    real = cpu_kernels._rope_table
    monkeypatch.setattr(cpu_kernels, "_rope_table", lambda *a: tables.append(1) or real(*a))
    x = mx.random.normal((2, 6, 300, 64))
    cpu_kernels._rope(x, 64, traditional=False, base=1e4, scale=1.0, offset=5)  # outside active()
    with cpu_kernels.active():
        cpu_kernels._rope(x, 64, traditional=False, base=1e4, scale=1.0, offset=mx.array([5, 9]))  # per-row offsets
        cpu_kernels._rope(x[:, :, :1], 64, traditional=False, base=1e4, scale=1.0, offset=5)  # one row: below MIN_ROPE
    assert tables == []


def test_the_target_counts_its_gemm_work_from_its_modules_and_times_its_own_gemm() -> None:
    from mlx_dspark.adapters.mlx.forward_cost import forward_cost

    model = tiny_model("llama", seed=0)  # 3 layers, 4 query heads of 16, 2 KV heads, MLP 128 wide
    target = MlxTargetModel(model)
    hidden, heads, kv, dim, mlp = 64, 4, 2, 16, 128
    per_layer = hidden * heads * dim + 2 * hidden * kv * dim + heads * dim * hidden + 3 * hidden * mlp
    cost = target.forward_cost()
    assert cost.weight_params == 3 * per_layer and cost.attention_width == 3 * heads * dim
    assert target.gemm_flops_per_s() > 0
    from mlx import nn

    nn.quantize(model, group_size=32, bits=4)  # packed weights count as the weights they hold
    assert forward_cost(model.layers) == cost
