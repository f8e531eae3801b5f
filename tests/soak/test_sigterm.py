"""SIGTERM ends a real `serve` within seconds, even with long generations in flight, and their clients are told
the server is shutting down (in their dialect) instead of waiting on a connection that never answers."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlx_dspark.adapters.hf.cache import cache_root
from mlx_dspark.adapters.storage.server_registry import ServerRegistry
from tests.soak import traffic
from tests.soak.traffic import Call, Outcome

EXIT_BOUND_S = 15.0  # the bound on a shutdown; measured ~2 s (uvicorn's graceful wait is 2 s)
LONG = "Count from 1 to 1000, one number per line."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_healthy(base: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"serve did not become healthy:\n{log.read_text()[-3000:]}")


async def _both_decoding(base: str, streamed: Outcome, timeout: float = 120.0) -> None:
    """Until both requests decode and the streamed one has text (bounded)."""
    async with httpx.AsyncClient() as http:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = (await http.get(f"{base}/ui/api/status", timeout=5)).json()
            if status["active_requests"] >= 2 and streamed.partial:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the two generations never both started")


@pytest.mark.slow
def test_sigterm_ends_the_server_within_seconds_and_tells_its_clients(tmp_path: Path) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "mlx_dspark.entrypoints", "serve", "--model", "default", "--mode", "baseline"]
    with log.open("wb") as out:
        proc = subprocess.Popen([*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    registered = ServerRegistry(cache_root(None)).folder / f"{proc.pid}.json"
    try:
        _wait_healthy(base, proc, log)
        assert registered.exists() and base in registered.read_text()  # `top` finds it
        calls = [
            Call("chat", True, LONG, 2000, model="default"),
            Call("messages", False, LONG, 2000, model="default"),
        ]

        async def main() -> tuple[list[Outcome], float, int | None]:
            async with httpx.AsyncClient() as http:
                outs = [Outcome(c) for c in calls]
                clients = [asyncio.create_task(traffic.send(http, base, c, o)) for c, o in zip(calls, outs)]
                await _both_decoding(base, outs[0])
                proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                # Bounded: a client still waiting when the bound passes is a hang, and fails below.
                done, _ = await asyncio.wait(clients, timeout=EXIT_BOUND_S)
                code = await asyncio.to_thread(_exit_code, proc, EXIT_BOUND_S - (time.monotonic() - sent))
                outcomes = [c.result() for c in clients if c in done]
                for c in clients:
                    c.cancel()
                return outcomes, time.monotonic() - sent, code

        outcomes, seconds, code = asyncio.run(main())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # uvicorn shuts down gracefully, then raises the signal it caught again: -SIGTERM is its clean exit.
    assert code in (0, -signal.SIGTERM), f"serve did not exit within {EXIT_BOUND_S} s:\n{log.read_text()[-3000:]}"
    assert seconds < EXIT_BOUND_S
    assert not registered.exists()
    assert len(outcomes) == 2, "a client was still waiting when the server had gone"
    streamed, whole = outcomes
    assert streamed.status == 200 and streamed.sse_error and streamed.partial, streamed
    assert streamed.error is not None and "shutting down" in streamed.error
    assert whole.status == 529 and whole.error is not None and "shutting down" in whole.error, whole


def _exit_code(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return proc.wait(max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        return None
