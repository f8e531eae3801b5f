"""End-to-end serving throughput over HTTP (issue 25's serving goals): N requests at once against the same N
one after another, on a real `mlx-dspark serve`, prefill and first token included.

Lab tooling (not in CI). Starts the server (or uses one already answering on --port), sends each trial's N
chat requests sequentially, then concurrently, and reports the aggregate completion tokens per second of both
and their ratio, median over trials of the paired ratios; with several --modes, each mode's own server.

    .venv/bin/python scripts/http_concurrency.py --modes baseline,dspark --concurrency 4 --max-tokens 64 --trials 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"",
    "A train leaves at 3pm going 60 km/h; another at 4pm going 90 km/h. When does the second catch up?",
    "Explain what a hash map is and when you would use one.",
    "List five tips for writing clear commit messages.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "What is the derivative of x^3 * sin(x)? Show the steps.",
    "Write a Python class for a stack with push, pop and peek.",
]


async def _one(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> int:
    body = {
        "model": "default",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": prompt}],
    }
    r = await client.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


async def _sequential(base: str, prompts: Sequence[str], max_tokens: int) -> tuple[int, float]:
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        tokens = 0
        for p in prompts:
            tokens += await _one(client, base, p, max_tokens)
        return tokens, time.perf_counter() - t0


async def _concurrent(base: str, prompts: Sequence[str], max_tokens: int) -> tuple[int, float]:
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_one(client, base, p, max_tokens) for p in prompts))
        return sum(counts), time.perf_counter() - t0


def _serve(mode: str, port: int, log: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "mlx_dspark.entrypoints", "serve", "--port", str(port), "--mode", mode]
    out = open(log, "wb")  # noqa: SIM115 - the server's log lives as long as the server
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}; see {log}")
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("serve did not become healthy")


def measure(mode: str, port: int, n: int, max_tokens: int, trials: int) -> dict[str, Any]:
    proc = _serve(mode, port, f"/tmp/http-concurrency-{mode}.log")
    base = f"http://127.0.0.1:{port}"
    try:
        prompts = PROMPTS[:n]
        asyncio.run(_sequential(base, prompts[:1], 8))  # warm
        rows = []
        for _ in range(trials):
            st, sw = asyncio.run(_sequential(base, prompts, max_tokens))
            ct, cw = asyncio.run(_concurrent(base, prompts, max_tokens))
            rows.append({"sequential_tok_s": st / sw, "concurrent_tok_s": ct / cw, "ratio": (ct / cw) / (st / sw)})
    finally:
        proc.terminate()
        proc.wait(30)
    return {
        "mode": mode,
        "concurrency": n,
        "max_tokens": max_tokens,
        "trials": rows,
        "sequential_tok_s": statistics.median(r["sequential_tok_s"] for r in rows),
        "concurrent_tok_s": statistics.median(r["concurrent_tok_s"] for r in rows),
        "ratio": statistics.median(r["ratio"] for r in rows),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="auto")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--port", type=int, default=18555)
    args = p.parse_args(argv)
    results = [measure(m, args.port, args.concurrency, args.max_tokens, args.trials) for m in args.modes.split(",")]
    for r in results:
        print(
            f"{r['mode']:>9}  N={r['concurrency']}  sequential {r['sequential_tok_s']:.2f} tok/s  "
            f"concurrent {r['concurrent_tok_s']:.2f} tok/s  ratio {r['ratio']:.2f}x"
        )
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
