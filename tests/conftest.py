"""Shared test setup: swap in the optimized BLAS before anything imports mlx.core (as the CLI does)."""

from mlx_dspark.adapters.mlx.blas import ensure_fast_blas

ensure_fast_blas()
