"""`mlx-dspark top`: a terminal gauge of a running server — tok/s, model memory, queue, acceptance.

Reads the dashboard's /ui/api/status (the numbers the web header shows), with the same API key rule. The tok/s
bar's full scale is the 1-2-5 step above the highest of the peak seen, the served model's plain decoding rate and
its roofline ceiling (the server knows those once a race or a roofline has measured them; they are marked on the
bar), so it moves only when a reading crosses a step, and the scale is printed under the bar.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

BAR = 30


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-dspark top", description="Live gauge of a running mlx-dspark server.")
    p.add_argument(
        "--url",
        help="server base URL (default: MLX_DSPARK_HOST/PORT when set, else the newest running `mlx-dspark serve`, "
        "else http://127.0.0.1:8080)",
    )
    p.add_argument("--api-key", help="the server's API key (default MLX_DSPARK_API_KEY)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true", help="print one reading and exit (for scripts)")
    return p


def _bytes(n: float) -> str:
    units = ["B", "KB", "MB", "GB", "TB"]
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} {units[i]}" if i == 0 or n >= 100 else f"{n:.1f} {units[i]}"


def full_scale(value: float) -> float:
    """The 1-2-5 step at or above `value` (1, 2, 5, 10, 20, 50…); 10 when nothing has run yet."""
    if value <= 0:
        return 10.0
    decade = 10.0 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * decade >= value * (1 - 1e-9):
            return step * decade
    return 10 * decade


def bar(shown: float, full: float, marks: dict[str, float]) -> str:
    """BAR cells filled up to `shown` of `full`, with each mark's character at its value."""
    filled = min(BAR, round(BAR * shown / full)) if shown else 0
    cells = ["█"] * filled + ["·"] * (BAR - filled)
    for char, value in marks.items():
        cells[min(BAR - 1, int(BAR * value / full))] = char
    return "".join(cells)


def render(status: dict[str, Any], peak_tok_s: float) -> str:
    """One screen of the gauge (plain text; no colour so it reads the same in a log)."""
    live = float(status.get("live_tok_s") or 0.0)
    shown = live or float(status.get("last_tok_s") or 0.0)
    plain = float(status.get("plain_tok_s") or 0.0)
    ceiling = float(status.get("ceiling_tok_s") or 0.0)
    full = full_scale(max(peak_tok_s, shown, plain, ceiling))
    marks = {char: value for char, value in (("│", plain), ("┆", ceiling)) if value}
    refs = {"│ plain decoding": plain, "┆ roofline ceiling": ceiling}
    named = "   ".join(f"{name} {value:.1f}" for name, value in refs.items() if value)
    scale = f"scale   0-{full:g} tok/s   " + (named or "(a race or a roofline marks plain decoding on it)")
    totals = status.get("totals") or {}
    drafted = totals.get("drafted", 0)
    acceptance = f"{100 * totals.get('accepted', 0) / drafted:.1f}%" if drafted else "—"
    memory = status.get("memory") or {}
    state = "ready" if status.get("ready") else ("error: " + str(status["error"]) if status.get("error") else "loading")
    lines = [
        f"mlx-dspark  {status.get('model')}  mode {status.get('mode')}  [{state}]",
        f"tok/s   {bar(shown, full, marks)} {shown:7.1f} {'live' if live else 'last request'}",
        scale,
        f"memory  model {_bytes(status.get('model_bytes') or 0)}   MLX active {_bytes(memory.get('active', 0))}"
        f"   peak {_bytes(memory.get('peak', 0))}",
        f"queue   {status.get('queue_depth', 0)} waiting   {status.get('active_requests', 0)} decoding",
        f"totals  {totals.get('requests', 0)} requests   {totals.get('generated_tokens', 0)} tokens   "
        f"acceptance {acceptance}   cache hits {totals.get('cache_hits', 0)}",
    ]
    return "\n".join(lines) + "\n"


def fetch(url: str, api_key: str | None) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + "/ui/api/status")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=10) as response:
        data: dict[str, Any] = json.loads(response.read())
    return data


def server_url(given: str | None) -> tuple[str, str | None]:
    """The server to watch, and a note when the choice was not obvious: --url, then MLX_DSPARK_HOST/PORT, then
    the newest server `serve` registered (it may run on any port), then the serve default."""
    host = os.environ.get("MLX_DSPARK_HOST") or "127.0.0.1"
    if given:
        return given, None
    if os.environ.get("MLX_DSPARK_PORT"):
        return f"http://{host}:{os.environ['MLX_DSPARK_PORT']}", None
    from mlx_dspark.application import bootstrap
    from mlx_dspark.application.settings import load_settings

    live = bootstrap.server_registry(load_settings()).live()
    if not live:
        return f"http://{host}:8080", None
    url = str(live[0]["url"])
    if len(live) == 1:
        return url, None
    others = ", ".join(str(e["url"]) for e in live[1:])
    return url, f"several servers run; watching the newest, {url} (also: {others}; choose with --url)"


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    url, note = server_url(args.url)
    if note:
        sys.stderr.write(f"mlx-dspark top: {note}\n")
    key = args.api_key or os.environ.get("MLX_DSPARK_API_KEY") or None
    tty = sys.stdout.isatty() and not args.once
    peak = 0.0
    try:
        while True:
            try:
                status = fetch(url, key)
            except urllib.error.HTTPError as exc:
                reason = "wrong or missing --api-key" if exc.code == 401 else f"HTTP {exc.code}"
                sys.stderr.write(f"mlx-dspark top: {url}: {reason}\n")
                return 1
            except (urllib.error.URLError, OSError) as exc:
                sys.stderr.write(f"mlx-dspark top: cannot reach {url}: {getattr(exc, 'reason', exc)}\n")
                return 1
            peak = max(peak, float(status.get("live_tok_s") or 0.0), float(status.get("last_tok_s") or 0.0))
            frame = render(status, peak)
            sys.stdout.write(("\x1b[H\x1b[2J" if tty else "") + frame)
            sys.stdout.flush()
            if args.once:
                return 0
            time.sleep(max(args.interval, 0.1))
    except KeyboardInterrupt:
        return 0
