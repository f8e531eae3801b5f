"""Shared test setup: swap in the optimized BLAS before anything imports mlx.core (as the CLI does)."""

import os
import tempfile

from mlx_dspark.adapters.mlx.blas import ensure_fast_blas

ensure_fast_blas()

# Servers built without an explicit session database keep their chat sessions out of the user's cache.
_SESSIONS = os.path.join(tempfile.mkdtemp(prefix="mlx-dspark-tests-"), "sessions.sqlite3")
os.environ.setdefault("MLX_DSPARK_SESSION_DB", _SESSIONS)
