"""Shared test setup: swap in the optimized BLAS before anything imports mlx.core (as the CLI does)."""

import os
import tempfile

from mlx_dspark.adapters.mlx.blas import ensure_fast_blas

ensure_fast_blas()

# Servers built without an explicit session database keep their chat sessions out of the user's cache.
_SESSIONS = os.path.join(tempfile.mkdtemp(prefix="mlx-dspark-tests-"), "sessions.sqlite3")
os.environ.setdefault("MLX_DSPARK_SESSION_DB", _SESSIONS)


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    parser.addoption(
        "--heavy",
        action="store_true",
        help="run only the heavy tier (tests marked heavy: the real Qwen2.5-Coder-1.5B; `./dev.sh test --heavy`)",
    )


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Heavy tests run only under --heavy, and --heavy runs only them: CI's `./dev.sh test` never sees them."""
    heavy = config.getoption("--heavy")
    keep = [item for item in items if (item.get_closest_marker("heavy") is not None) == heavy]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
