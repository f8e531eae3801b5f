"""`mlx-dspark serve`: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages on one local port."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from mlx_dspark.entrypoints.cli.common import add_model_args, run_guarded, settings_from, start

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SHUTDOWN_GRACE_S = 2.0  # after SIGTERM/SIGINT, how long open connections may take to close


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-dspark serve", description="Serve a model to coding agents and SDKs.")
    add_model_args(p)
    p.add_argument("--host", help="address to bind (default 127.0.0.1; anything else exposes the server)")
    p.add_argument("--port", type=int, help="port (default 8080)")
    p.add_argument(
        "--api-key", help="require this key (Bearer or x-api-key) on every route but /health and a bare HEAD /"
    )
    p.add_argument("--context-window", type=int, help="override the model's context window (tokens)")
    p.add_argument("--max-tokens-cap", type=int, help="cap every request's max_tokens")
    p.add_argument(
        "--cors-origin", dest="cors_origins", action="append", help="allow browser calls from ORIGIN (repeatable)"
    )
    p.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        help="accept this Host name too, e.g. behind a proxy (repeatable; IP addresses and localhost always pass)",
    )
    p.add_argument("--keepalive", dest="keepalive_s", type=float, help="seconds between stream keep-alives (default 5)")
    p.add_argument("--max-body-bytes", type=int, help="largest accepted request body (default 8 MiB)")
    p.add_argument("--max-queue", type=int, help="requests that may wait for the engine (default 16; then 429/529)")
    p.add_argument(
        "--max-batch", type=int, help="requests decoded together in one batched forward (default 8; 1 = one at a time)"
    )
    p.add_argument(
        "--warmup",
        choices=["auto", "on", "off"],
        help="run every cap's rounds once before the first request (default auto: where the GPU compiles kernels)",
    )
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)

    def body() -> int:
        import uvicorn

        from mlx_dspark.application import bootstrap
        from mlx_dspark.entrypoints.http.app import create_app

        settings = settings_from(args)
        services = start(settings)
        if bootstrap.follow_rank_zero(services, settings):  # --distributed, rank > 0: no server of its own
            return 0
        server = settings.server
        if server.host not in LOOPBACK and not server.api_key:
            sys.stderr.write(f"mlx-dspark: warning: serving on {server.host} without --api-key\n")
        app = create_app(bootstrap.build_server(services, settings))
        engine = app.state["ctx"].engine
        url = f"http://{server.host}:{server.port}"
        registry = bootstrap.server_registry(settings)
        # `top` finds this server by it (a wildcard bind is reached on the loopback).
        entry = registry.register(url.replace("://0.0.0.0:", "://127.0.0.1:"), settings.model.model)

        class Server(uvicorn.Server):  # type: ignore[misc]
            def handle_exit(self, sig: int, frame: Any) -> None:
                # In-flight generations end now with the dialect's "shutting down" error, so uvicorn's graceful
                # wait for open requests is short; its own timeout bounds the rest.
                engine.stop(timeout=0)
                registry.unregister(entry)  # uvicorn ends the process with the signal: no `finally` runs
                super().handle_exit(sig, frame)

        config = uvicorn.Config(
            app,
            host=server.host,
            port=server.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        sys.stderr.write(f"mlx-dspark: serving on {url} (model loads in the background)\n")
        try:
            Server(config).run()
        finally:
            registry.unregister(entry)
        return 0

    return run_guarded(body)
