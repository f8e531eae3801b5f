"""The BLAS setup keeps OpenBLAS's idle workers from spinning, unless the user chose a timeout."""

from __future__ import annotations

import os
import subprocess
import sys


def _timeout_after_setup(env: dict[str, str]) -> str:
    code = (
        "import os\n"
        "from mlx_dspark.adapters.mlx.blas import ensure_fast_blas\n"
        "ensure_fast_blas()\n"
        "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT', ''))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_setup_sets_a_short_thread_timeout() -> None:
    from mlx_dspark.adapters.mlx.blas import THREAD_TIMEOUT

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    assert _timeout_after_setup(env) == THREAD_TIMEOUT


def test_a_users_own_timeout_wins() -> None:
    assert _timeout_after_setup({**os.environ, "OPENBLAS_THREAD_TIMEOUT": "20"}) == "20"
