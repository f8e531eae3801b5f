"""Row products (`row_products`): few-row projections as one-row products, installed per model, lossless.

On the CPU they run through the same graph as on CUDA (only the kernels differ), so every test forces the
switch on; what they save is measured on the device (scripts/round_anatomy.py, the `rowwise` kind).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx import nn

from mlx_dspark.adapters.mlx import compiled_forward, key_buckets, row_products
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from tests.fakes.tiny_models import FAMILIES, QUANTIZED
from tests.integration.drafters import helpers
from tests.integration.mlx import test_key_buckets as buckets_suite


@pytest.fixture
def rows_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The switch on (with key buckets and compiled verifies, as "auto" runs on CUDA); yields the row counts
    of every row product built."""
    monkeypatch.setenv(row_products.ENV, "on")
    monkeypatch.setenv(key_buckets.ENV, "on")
    monkeypatch.setenv(compiled_forward.ENV, "on")
    built: list[int] = []
    product = row_products.product

    def spy(weight: mx.array, x: mx.array) -> mx.array:
        built.append(x.size // x.shape[-1])
        return product(weight, x)

    monkeypatch.setattr(row_products, "product", spy)
    yield built


def test_the_kernel_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(row_products.SKINNY_ENV, "auto")
    assert not row_products.skinny_enabled()  # it has not measurably won yet (the module docstring)
    monkeypatch.setenv(row_products.SKINNY_ENV, "ON")
    assert row_products.skinny_enabled()
    monkeypatch.setenv(row_products.SKINNY_ENV, "sometimes")
    with pytest.raises(ValueError, match="auto, on or off"):
        row_products.skinny_enabled()


def test_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(row_products.ENV, "on")
    assert row_products.enabled()
    monkeypatch.setenv(row_products.ENV, "OFF")
    assert not row_products.enabled()
    monkeypatch.setenv(row_products.ENV, "auto")
    assert not row_products.enabled()  # CUDA only: the CPU's BLAS runs one GEMM faster than many products
    monkeypatch.setenv(row_products.ENV, "often")
    with pytest.raises(ValueError, match="auto, on or off"):
        row_products.enabled()


@pytest.mark.parametrize("shape", [(1, 8, 64), (3, 4, 64), (5, 64), (1, 32, 64)])
def test_a_row_product_is_the_projection(shape: tuple[int, ...]) -> None:
    x = mx.random.normal(shape, key=mx.random.key(0))
    weight = mx.random.normal((96, 64), key=mx.random.key(1))
    got = row_products.product(weight, x)
    assert got.shape == (*shape[:-1], 96)
    assert mx.allclose(got, x @ weight.T, atol=1e-4, rtol=1e-5).item()


@pytest.mark.parametrize("bias", [True, False])
def test_only_few_row_projections_take_the_row_path(
    rows_on: list[int], monkeypatch: pytest.MonkeyPatch, bias: bool
) -> None:
    linear = nn.Linear(64, 96, bias=bias)
    plain = nn.Linear(64, 96, bias=bias)
    plain.update(linear.parameters())
    linear.__class__ = row_products.RowLinear

    def check(rows: int, taken: bool) -> None:
        rows_on.clear()
        x = mx.random.normal((1, rows, 64), key=mx.random.key(rows))
        got = linear(x)
        assert (rows_on == [rows]) is taken, (rows, rows_on)
        if taken:
            assert mx.allclose(got, plain(x), atol=1e-4, rtol=1e-5).item()
        else:  # MLX's own projection, bit for bit
            assert mx.array_equal(got, plain(x)).item()

    for rows, taken in [(1, False), (2, True), (row_products.MAX_ROWS, True), (row_products.MAX_ROWS + 1, False)]:
        check(rows, taken)
    # A weight re-read more than the byte budget allows keeps its GEMM (a large model's device time).
    monkeypatch.setattr(row_products, "MAX_BYTES", 4 * linear.weight.nbytes)
    for rows, taken in [(2, True), (4, True), (5, False)]:
        check(rows, taken)


def test_install_changes_this_model_only(monkeypatch: pytest.MonkeyPatch) -> None:
    model = helpers.tiny_target("qwen3", seed=2)
    other = helpers.tiny_target("qwen3", seed=2)
    quantized = nn.QuantizedLinear(64, 64, bias=False)
    model.extra = [quantized]
    linears = [m for _, m in model.named_modules() if type(m) is nn.Linear]
    monkeypatch.setenv(row_products.ENV, "off")
    assert row_products.install(model) == 0
    monkeypatch.setenv(row_products.ENV, "on")
    assert row_products.install(model) == len(linears) > 0
    assert all(type(m) is row_products.RowLinear for m in linears)
    assert type(quantized) is nn.QuantizedLinear
    assert row_products.install(model) == 0  # idempotent
    assert not any(type(m) is row_products.RowLinear for _, m in other.named_modules())
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert mx.allclose(model(tokens), other(tokens), atol=1e-4, rtol=1e-4).item()


def test_the_target_and_the_drafters_install_it(tmp_path: Path, rows_on: list[int]) -> None:
    model = helpers.tiny_target("qwen3", seed=2)
    MlxTargetModel(model)
    assert any(type(m) is row_products.RowLinear for _, m in model.named_modules())
    for kind, opts in [("dspark", {"packaging": "deepspec"}), ("dflash", {"variant": "v2"})]:
        source = buckets_suite.tiny_source(tmp_path, model, kind, opts)
        assert any(type(m) is row_products.RowLinear for _, m in source.drafter.named_modules()), kind


@pytest.mark.parametrize(
    ("kind", "opts"),
    [("dspark", {"packaging": "deepspec"}), ("dflash", {"variant": "v2"})],
    ids=["dspark", "dflash"],
)
def test_greedy_decoding_with_row_products_equals_plain_decoding(
    tmp_path: Path, rows_on: list[int], kind: str, opts: dict[str, Any]
) -> None:
    model = helpers.tiny_target("qwen3", seed=2)
    source = buckets_suite.tiny_source(tmp_path, model, kind, opts)

    def taken() -> None:  # verifies and draft blocks ran their projections as row products
        assert any(rows > 1 for rows in rows_on), rows_on
        rows_on.clear()

    buckets_suite.assert_decodes_as_plain(model, source, seed=5, check=taken)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_with_row_products_as_mlx_lm_does(rows_on: list[int], family: str) -> None:
    # The rollback suite (right, partly wrong and random drafts; sliding windows, recurrent state).
    from tests.integration.mlx import test_target_greedy as suite

    suite.test_speculative_equals_plain_and_mlx_lm(family)
    # Quantized projections keep MLX's own kernels (no cuBLASLt call to save); dense ones take row products.
    assert any(rows > 1 for rows in rows_on) == (family not in QUANTIZED)


@pytest.fixture
def skinny_spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The few-row kernel taken as checked for float32, with MLX's own product standing in for it (the kernel
    itself runs on CUDA only: the device bench measures it); yields the row counts it served."""
    monkeypatch.setattr(row_products, "_skinny_ok", {mx.float32: True})
    served: list[int] = []

    def stand_in(weight: mx.array, x: mx.array) -> mx.array:
        served.append(x.size // x.shape[-1])
        return x @ weight.T

    monkeypatch.setattr(row_products, "skinny", stand_in)
    yield served


def test_few_rows_take_the_kernel_and_more_take_row_products(rows_on: list[int], skinny_spy: list[int]) -> None:
    linear = nn.Linear(64, 96)
    plain = nn.Linear(64, 96)
    plain.update(linear.parameters())
    linear.__class__ = row_products.RowLinear
    for rows, kernel, products in [
        (1, [], []),
        (2, [2], []),
        (row_products.SKINNY_ROWS, [row_products.SKINNY_ROWS], []),
        (row_products.SKINNY_ROWS + 1, [], [row_products.SKINNY_ROWS + 1]),
    ]:
        rows_on.clear()
        skinny_spy.clear()
        x = mx.random.normal((1, rows, 64), key=mx.random.key(rows))
        assert mx.allclose(linear(x), plain(x), atol=1e-4, rtol=1e-5).item()  # the bias is added either way
        assert (skinny_spy, rows_on) == (kernel, products), rows
    # Another dtype than the checked one, or rows that are not whole 16-byte vectors: never the kernel.
    skinny_spy.clear()
    linear(mx.random.normal((4, 64)).astype(mx.bfloat16))
    odd = row_products.RowLinear(62, 8)
    odd(mx.random.normal((4, 62)))
    assert skinny_spy == []


def test_an_unavailable_kernel_is_refused_once_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(row_products, "_skinny_ok", {})
    monkeypatch.setenv(row_products.ENV, "on")
    monkeypatch.setenv(row_products.SKINNY_ENV, "on")
    model = helpers.tiny_target("qwen3", seed=2)
    with pytest.warns(UserWarning, match="few-row kernel is unavailable"):  # MLX's CPU runs no CUDA kernel
        row_products.install(model)
    assert row_products._skinny_ok == {mx.float32: False}
    assert not row_products.check_skinny(mx.float32)  # remembered: no second try, no second warning
    assert not row_products.check_skinny(mx.int32)  # a dtype the kernel has no form for


def test_a_kernel_that_disagrees_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(row_products, "_skinny_ok", {})
    monkeypatch.setattr(row_products, "skinny", lambda weight, x: (x @ weight.T) * 1.05)
    with pytest.warns(UserWarning, match="disagrees"):
        assert not row_products.check_skinny(mx.float32)
    monkeypatch.setattr(row_products, "_skinny_ok", {})
    monkeypatch.setattr(row_products, "skinny", lambda weight, x: x @ weight.T)
    assert row_products.check_skinny(mx.float32)
