"""The issue's responsiveness goal, measured (not in CI: it times things; set MLX_DSPARK_SOAK_GOALS=1).

A 1-token request to a real `serve` of the default model, alone and beside a 50 MB prompt, medians over 20 tries
each: beside it must answer in under twice its time alone, with the default body limit (the 50 MB body is refused
at its Content-Length). Also measured, not held to the goal: the limit raised to 64 MiB, where the body is read,
parsed off the event loop and refused by the admission floor before anything tokenizes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.soak.test_sigterm import _free_port, _wait_healthy

TRIES = 20
HUGE_BYTES = 50_000_000
ONE_TOKEN = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "Say hi."}]}
HEADERS = {"content-type": "application/json"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("MLX_DSPARK_SOAK_GOALS"), reason="a timing measurement: set MLX_DSPARK_SOAK_GOALS=1"
    ),
]


async def _one_token(http: httpx.AsyncClient, base: str) -> float:
    started = time.monotonic()
    r = await http.post(f"{base}/v1/chat/completions", json=ONE_TOKEN, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
    return time.monotonic() - started


async def _huge(base: str, body: Path) -> tuple[str, float]:
    """Send the huge body from another process (curl), so that this client's own event loop and GIL stay out of
    the measurement: its status (000 when the server closed the connection first) and its seconds."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "content-type: application/json",
        "--data-binary", f"@{body}", f"{base}/v1/chat/completions",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    return out.decode(), time.monotonic() - started


async def _measure(base: str, body: Path) -> dict[str, object]:
    async with httpx.AsyncClient() as http:
        for _ in range(3):
            await _one_token(http, base)
        alone, beside, huge = [], [], []
        for _ in range(TRIES):  # alternated, so a machine whose load drifts weighs on both alike
            alone.append(await _one_token(http, base))
            upload = asyncio.create_task(_huge(base, body))
            await asyncio.sleep(0.05)  # curl has started and is sending
            beside.append(await _one_token(http, base))
            huge.append(await upload)
    return {
        "alone_median_s": statistics.median(alone),
        "beside_median_s": statistics.median(beside),
        "ratio": statistics.median(beside) / statistics.median(alone),
        "huge_outcomes": sorted({str(h[0]) for h in huge}),
        "huge_median_s": statistics.median(h[1] for h in huge),
    }


@pytest.mark.parametrize("limit", [None, 64 << 20], ids=["default-limit", "64MiB-limit"])
def test_a_one_token_request_beside_a_50mb_prompt_answers_within_twice_its_time_alone(
    tmp_path: Path, limit: int | None
) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "mlx_dspark.entrypoints", "serve", "--model", "default", "--mode", "baseline"]
    command += ["--port", str(port)] + (["--max-body-bytes", str(limit)] if limit else [])
    content = "x" * HUGE_BYTES
    body = json.dumps({"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    huge = tmp_path / "huge.json"
    huge.write_text(body)
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    try:
        _wait_healthy(base, proc, log)
        result = asyncio.run(_measure(base, huge))
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps({"limit": limit, **result}))  # the numbers, shown with -s
    if limit is None:  # the goal is the default server's; a raised limit is measured and reported, not held to it
        assert result["ratio"] < 2.0, result  # type: ignore[operator]
