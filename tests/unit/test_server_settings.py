"""Server limits are settings: defaults, MLX_DSPARK_* variables, `serve` flags; the key never shows."""

from __future__ import annotations

import pytest

from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.entrypoints.cli import serve
from mlx_dspark.entrypoints.cli.common import settings_from


def test_defaults() -> None:
    server = load_settings({}, {}).server
    assert (server.keepalive_s, server.max_body_bytes, server.max_queue) == (5.0, 8 * 1024 * 1024, 16)
    assert server.allowed_hosts == () and server.cors_origins == ()


def test_environment_then_flags() -> None:
    env = {
        "MLX_DSPARK_KEEPALIVE_S": "0.5",
        "MLX_DSPARK_MAX_BODY_BYTES": "1024",
        "MLX_DSPARK_MAX_QUEUE": "3",
        "MLX_DSPARK_ALLOWED_HOSTS": "gpu-box.lan,proxy.lan",
    }
    server = load_settings({}, env).server
    assert (server.keepalive_s, server.max_body_bytes, server.max_queue) == (0.5, 1024, 3)
    assert server.allowed_hosts == ("gpu-box.lan", "proxy.lan")
    assert load_settings({"max_queue": 7}, env).server.max_queue == 7


def test_serve_flags_reach_the_settings() -> None:
    args = serve.parser().parse_args(
        [
            "--keepalive",
            "2",
            "--max-body-bytes",
            "4096",
            "--max-queue",
            "1",
            "--allowed-host",
            "a.lan",
            "--allowed-host",
            "b.lan",
            "--cors-origin",
            "http://localhost:3000",
        ]
    )
    server = settings_from(args).server
    assert (server.keepalive_s, server.max_body_bytes, server.max_queue) == (2.0, 4096, 1)
    assert server.allowed_hosts == ("a.lan", "b.lan") and server.cors_origins == ("http://localhost:3000",)


@pytest.mark.parametrize("field", ["keepalive_s", "max_body_bytes", "max_queue"])
def test_limits_must_be_positive(field: str) -> None:
    with pytest.raises(InvalidRequest, match=field):
        load_settings({field: 0}, {})


def test_the_api_key_is_not_in_the_settings_repr() -> None:
    settings = load_settings({"api_key": "sk-never-print-me"}, {})
    assert settings.server.api_key == "sk-never-print-me"
    assert "sk-never-print-me" not in repr(settings) and "sk-never-print-me" not in str(settings)
