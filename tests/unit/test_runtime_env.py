"""The runtime sizes MLX CUDA's graph cache before MLX starts, unless the user chose a size."""

from __future__ import annotations

import os
import subprocess
import sys


def _size_after_prepare(env: dict[str, str]) -> str:
    code = (
        "import os\n"
        "from mlx_dspark.application import bootstrap\n"
        "bootstrap.runtime().prepare()\n"  # what every entrypoint runs first
        "print(os.environ.get('MLX_CUDA_GRAPH_CACHE_SIZE', ''))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_prepare_sets_a_graph_cache_larger_than_autos_working_set() -> None:
    from mlx_dspark.adapters.mlx.runtime import GRAPH_CACHE_SIZE

    env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_GRAPH_CACHE_SIZE"}
    assert _size_after_prepare(env) == GRAPH_CACHE_SIZE and int(GRAPH_CACHE_SIZE) > 100  # MLX's default: 100


def test_a_users_own_graph_cache_size_wins() -> None:
    assert _size_after_prepare({**os.environ, "MLX_CUDA_GRAPH_CACHE_SIZE": "300"}) == "300"
