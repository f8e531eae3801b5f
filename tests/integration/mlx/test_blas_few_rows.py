"""The BLAS shim's few-row path (`adapters/mlx/blas.py`): MLX's float32 products of 1-16 rows against a weight
(x @ W.T, what every projection of a decoding step or a verify is) run our own kernel, which reads the weight
once and sums every (row, column) in one order whatever the number of rows. So a verify's rows equal a one-token
step's bit for bit, and the products equal NumPy's within float32 rounding. Runs where the shim is in use (the
Linux CPU wheel); elsewhere MLX's own BLAS serves and there is nothing of ours to test."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.adapters.mlx.blas import blas_status

pytestmark = pytest.mark.skipif(
    (blas_status() or None) is None or blas_status().name != "openblas-shim",  # type: ignore[union-attr]
    reason="the BLAS shim is not in use here",
)


def served() -> int:
    """How many products the shim's kernel has run in this process."""
    status = blas_status()
    assert status is not None
    return ctypes.c_long.in_dll(ctypes.CDLL(status.detail), "mlx_dspark_few_rows").value


@pytest.mark.parametrize(("n", "k"), [(96, 64), (1536, 576), (7, 70), (4099, 130)])
def test_few_row_products_are_numpys_and_do_not_depend_on_the_row_count(n: int, k: int) -> None:
    rng = np.random.default_rng(n + k)
    w = mx.array(rng.standard_normal((n, k), dtype=np.float32))
    x = mx.array(rng.standard_normal((20, k), dtype=np.float32))
    alone = [np.array(x[i : i + 1] @ w.T) for i in range(17)]
    for m in (1, 2, 3, 4, 5, 8, 13, 16, 17):
        before = served()
        got = np.array(x[:m] @ w.T)
        assert served() - before == (1 if m <= 16 else 0), m  # 17 rows and more: OpenBLAS's GEMM
        want = np.array(x[:m], dtype=np.float64) @ np.array(w, dtype=np.float64).T
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
        if m <= 16:  # our kernel: each row as it is alone, bit for bit
            for i in range(m):
                assert np.array_equal(got[i], alone[i][0]), (m, i)


def test_other_products_keep_openblas() -> None:
    # Transposed inputs, a bias or a scale, and products of a few columns (a convolution's window) go to the GEMM.
    before = served()
    rng = np.random.default_rng(0)
    a = mx.array(rng.standard_normal((3, 80), dtype=np.float32))
    b = mx.array(rng.standard_normal((80, 40), dtype=np.float32))
    c = mx.array(rng.standard_normal((3, 40), dtype=np.float32))
    np.testing.assert_allclose(np.array(a @ b), np.array(a) @ np.array(b), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(
        np.array(mx.addmm(c, a, b, alpha=0.5, beta=2.0)),
        2.0 * np.array(c) + 0.5 * (np.array(a) @ np.array(b)),
        rtol=1e-4,
        atol=1e-3,
    )
    one = mx.array(rng.standard_normal((1, 80), dtype=np.float32))
    np.testing.assert_allclose(np.array(one @ b), np.array(one) @ np.array(b), rtol=1e-4, atol=1e-3)
    small = mx.array(rng.standard_normal((1, 4), dtype=np.float32))
    wide = mx.array(rng.standard_normal((4, 6), dtype=np.float32))
    np.testing.assert_allclose(np.array(small @ wide), np.array(small) @ np.array(wide), rtol=1e-5, atol=1e-5)
    assert served() == before
