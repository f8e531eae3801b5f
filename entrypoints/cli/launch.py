"""`mlx-dspark claude|codex|pi [-- ARGS]`: start (or reuse) the server and run the client pointed at it.

The client's configuration lives only in its own process: environment variables, `-c` overrides and
files in a temporary directory that is removed afterwards. The user's config files are never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from mlx_dspark.application.launchers import PLANS, LaunchPlan, Target
from mlx_dspark.entrypoints.cli.common import add_model_args, progress_line, settings_from

STARTUP_TIMEOUT_S = 600.0


def parser(client: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"mlx-dspark {client}", description=f"Run {client} against the local server (arguments after -- go to it)."
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="the server's key (a fresh server is started with it)")
    p.add_argument("--context-window", type=int, help="context window to announce to the client (default 32768)")
    p.add_argument("--max-output-tokens", type=int, default=8192, help="output cap to announce to the client")
    if client == "pi":
        p.add_argument(
            "--api",
            default="openai-completions",
            choices=("openai-completions", "openai-responses", "anthropic-messages"),
        )
    p.add_argument("--print-env", action="store_true", help="print the environment the client would get, then exit")
    p.add_argument("--print-config", action="store_true", help="print the client's command and files, then exit")
    return p


def _get_json(url: str, api_key: str | None, timeout: float = 2.0) -> tuple[int, object]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # loopback only: the server we start or reuse
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def _served_model(base: str, api_key: str | None) -> str | None:
    status, body = _get_json(f"{base}/v1/models", api_key)
    if status == 200 and isinstance(body, dict) and body.get("data"):
        return str(body["data"][0]["id"])
    return None


def _start_server(args: argparse.Namespace, base: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "mlx_dspark.entrypoints", "serve", "--host", args.host, "--port", str(args.port)]
    for flag in ("model", "mode", "drafter", "api_key", "context_window"):
        value = getattr(args, flag, None)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    progress_line(f"starting the server: {shlex.join(cmd)}")
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mlx-dspark: the server exited with status {proc.returncode}")
        status, _ = _get_json(f"{base}/health", None)
        if status == 200:
            return proc
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("mlx-dspark: the server did not become healthy in time")


def _materialize(plan: LaunchPlan, tmp: str) -> tuple[list[str], dict[str, str]]:
    for rel, content in plan.files.items():
        path = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
    argv = [a.replace("{tmp}", tmp) for a in plan.argv]
    env = {k: v.replace("{tmp}", tmp) for k, v in plan.env.items()}
    return argv, env


def main(client: str, argv: Sequence[str]) -> int:
    argv = list(argv)
    client_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, client_args = argv[:cut], argv[cut + 1 :]
    args = parser(client).parse_args(argv)
    print_env, print_config = args.print_env, args.print_config
    base = f"http://{args.host}:{args.port}"
    settings = settings_from(argparse.Namespace(model=args.model, mode=args.mode))
    reuse = not (print_env or print_config) and _get_json(f"{base}/health", None)[0] == 200
    model = (_served_model(base, args.api_key) if reuse else None) or settings.model.model
    target = Target(
        base_url=base,
        model=model,
        api_key=args.api_key,
        context_window=args.context_window or 32768,
        max_output_tokens=args.max_output_tokens,
    )
    plan_fn = PLANS[client]
    plan = (
        plan_fn(target, client_args, os.environ, api=args.api)  # type: ignore[operator]
        if client == "pi"
        else plan_fn(target, client_args, os.environ)
    )
    if print_env:
        for key in plan.removed_env:
            sys.stdout.write(f"unset {key}\n")
        for key, value in plan.shown_env.items():
            sys.stdout.write(f"export {key}={shlex.quote(value)}\n")
        return 0
    if print_config:
        sys.stdout.write(f"# command\n{shlex.join(plan.argv)}\n")
        for rel, content in plan.files.items():
            sys.stdout.write(f"# file {{tmp}}/{rel}\n{content}")
        return 0
    server = None if reuse else _start_server(args, base)
    if server is None:
        progress_line(f"reusing the server at {base} (model {model})")
    try:
        with tempfile.TemporaryDirectory(prefix=f"mlx-dspark-{client}-") as tmp:
            child_argv, env = _materialize(plan, tmp)
            try:
                return subprocess.call(child_argv, env=env)
            except FileNotFoundError:
                sys.stderr.write(f"mlx-dspark: {child_argv[0]!r} is not installed or not on PATH\n")
                return 127
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
