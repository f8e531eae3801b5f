"""What the MLX runtime sets up for a process: MLX CUDA's compiled kernels in a lasting folder per MLX version and
GPU (unless the user chose one; elsewhere nothing), and calibrations keyed by what measured them (on the CPU, the
BLAS)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlx_dspark.adapters.mlx import kernel_cache


def test_on_cuda_the_cache_gets_a_lasting_folder_per_mlx_and_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(kernel_cache.ENV, raising=False)
    monkeypatch.setattr(kernel_cache, "_cuda_identity", lambda: "mlx-0.32.4-NVIDIA H200 (SXM)")
    folder = kernel_cache.ensure_persistent(tmp_path)
    assert folder == tmp_path / "mlx-0.32.4-NVIDIA-H200-SXM-" and folder.is_dir()
    assert os.environ[kernel_cache.ENV] == str(folder)


def test_a_users_folder_wins_and_other_devices_are_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "mine"))
    monkeypatch.setattr(kernel_cache, "_cuda_identity", lambda: "mlx-0.32.4-NVIDIA H200")
    assert kernel_cache.ensure_persistent(tmp_path) == tmp_path / "mine"
    monkeypatch.delenv(kernel_cache.ENV)
    monkeypatch.setattr(kernel_cache, "_cuda_identity", lambda: None)  # Metal, the CPU
    assert kernel_cache.ensure_persistent(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
    assert kernel_cache.ENV not in os.environ


def test_the_real_probe_says_none_off_cuda() -> None:
    import mlx.core as mx

    if mx.default_device().type == mx.gpu and mx.cuda.is_available():
        pytest.skip("MLX runs on CUDA here")
    assert kernel_cache._cuda_identity() is None


def test_cpu_calibrations_are_keyed_by_the_blas_they_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    from mlx_dspark.adapters.mlx import blas
    from mlx_dspark.adapters.mlx.runtime import MlxRuntime

    if mx.default_device().type != mx.cpu:
        pytest.skip("a GPU runs no BLAS of ours")
    monkeypatch.setattr(blas, "_status", blas.BlasStatus("openblas-shim", "/cache/libsgemm_shim-aaaa.so"))
    old = MlxRuntime().calibration_environment()["device"]
    monkeypatch.setattr(blas, "_status", blas.BlasStatus("openblas-shim", "/cache/libsgemm_shim-bbbb.so"))
    new = MlxRuntime().calibration_environment()["device"]
    assert old != new and new.endswith("blas=openblas-shim:libsgemm_shim-bbbb.so")
