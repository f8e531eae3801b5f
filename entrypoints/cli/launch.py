"""`mlx-dspark claude|codex|pi [-- ARGS]`: start (or reuse) the server and run the client pointed at it.

The client's configuration lives only in its own process: environment variables, `-c` overrides and
files in a temporary directory that is removed afterwards. The user's config files are never touched.
A server started here runs in its own session (Ctrl-C in the agent does not reach it) and logs to a file,
never into the agent's terminal; the client is told the context window the server really enforces.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from mlx_dspark.application.launchers import PLANS, LaunchPlan, Target
from mlx_dspark.entrypoints.cli.common import add_model_args, progress_line, settings_from

STARTUP_TIMEOUT_S = 600.0  # a first start may convert a GGUF file and calibrate drafters
FALLBACK_WINDOW = 32768  # only for --print-* with no server running and no --context-window
LOG_TAIL_LINES = 20


def parser(client: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"mlx-dspark {client}", description=f"Run {client} against the local server (arguments after -- go to it)."
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="the server's key (a fresh server is started with it)")
    p.add_argument("--context-window", type=int, help="cap the context window of a server started here")
    p.add_argument(
        "--max-output-tokens",
        type=int,
        help="output cap announced to the client and enforced by a server started here (default: window / 4)",
    )
    p.add_argument("--server-log", help="where a server started here logs (default: a new file in the temp dir)")
    if client == "pi":
        p.add_argument(
            "--api",
            default="openai-completions",
            choices=("openai-completions", "openai-responses", "anthropic-messages"),
        )
    p.add_argument("--print-env", action="store_true", help="print the environment the client would get, then exit")
    p.add_argument("--print-config", action="store_true", help="print the client's command and files, then exit")
    return p


def _get_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    """(status, parsed body) of a GET; (0, None) when nothing answers. Error bodies are parsed too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # loopback only: the server we start or reuse
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def model_flags(args: argparse.Namespace) -> list[str]:
    """Every model/mode flag given on this command line, spelled the way `serve` takes it.

    Read from the one declaration of those flags (`add_model_args`), so a new flag is passed on too.
    """
    probe = argparse.ArgumentParser(add_help=False)
    add_model_args(probe)
    out: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest, None) if action.option_strings else None
        if value is None or value is False:
            continue
        flag = max(action.option_strings, key=len)
        out += [flag] if action.nargs == 0 else [flag, str(value)]
    return out


def serve_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "mlx_dspark.entrypoints", "serve", "--host", args.host, "--port", str(args.port)]
    cmd += model_flags(args)
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.context_window:
        cmd += ["--context-window", str(args.context_window)]
    if args.max_output_tokens:  # Codex sends no output cap of its own: the server enforces the announced one
        cmd += ["--max-tokens-cap", str(args.max_output_tokens)]
    return cmd


def _tail(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return ""
    return "".join(f"  | {line}\n" for line in lines)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_server(
    args: argparse.Namespace, base: str, log_path: str, timeout_s: float = STARTUP_TIMEOUT_S
) -> tuple[subprocess.Popen[bytes], Mapping[str, Any]]:
    """Start `serve` logging to `log_path` and wait until /health says ready.

    Returns:
        The server process and its /health body (model name, context window).

    Raises:
        SystemExit: with the server's own error when the model fails to load, the process exits, or it is
            not ready in time; the server is stopped first.
    """
    cmd = serve_command(args)
    progress_line(f"starting the server (log: {log_path}): {shlex.join(cmd)}")
    with open(log_path, "ab") as log:
        # Own session: a Ctrl-C meant for the agent must not kill its server.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    try:
        return proc, _wait_ready(proc, base, log_path, timeout_s)
    except BaseException:  # not ready, or Ctrl-C while waiting: never leave the server behind
        _stop(proc)
        raise


def _wait_ready(proc: subprocess.Popen[bytes], base: str, log_path: str, timeout_s: float) -> Mapping[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        code = proc.poll()
        if code is not None:
            raise SystemExit(
                f"mlx-dspark: the server exited with status {code} before it was ready (log: {log_path})\n"
                + _tail(log_path)
            )
        status, body = _get_json(f"{base}/health")
        if status == 200 and isinstance(body, dict):
            return body
        if status == 503 and isinstance(body, dict) and body.get("status") == "error":
            raise SystemExit(f"mlx-dspark: the server could not start: {body.get('error')} (log: {log_path})")
        if time.monotonic() > deadline:
            raise SystemExit(f"mlx-dspark: the server was not ready after {timeout_s:.0f} s (log: {log_path})")
        time.sleep(0.25)


def materialize(plan: LaunchPlan, tmp: str) -> tuple[list[str], dict[str, str]]:
    for rel, content in plan.files.items():
        path = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
    argv = [a.replace("{tmp}", tmp) for a in plan.argv]
    env = {k: v.replace("{tmp}", tmp) for k, v in plan.env.items()}
    return argv, env


def _ignore(signum: int, frame: object) -> None:
    pass


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _agent_signals() -> Iterator[None]:
    """While the agent runs, Ctrl-C is the agent's (it interrupts a turn), not ours; a hangup or SIGTERM
    still stops the server we started. A Python handler (not SIG_IGN) so the agent gets default handling."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _log_path(args: argparse.Namespace) -> str:
    if args.server_log:
        return str(args.server_log)
    fd, path = tempfile.mkstemp(prefix=f"mlx-dspark-server-{args.port}-", suffix=".log")
    os.close(fd)
    return path


def main(client: str, argv: Sequence[str]) -> int:
    argv = list(argv)
    client_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, client_args = argv[:cut], argv[cut + 1 :]
    args = parser(client).parse_args(argv)
    printing = args.print_env or args.print_config
    base = f"http://{args.host}:{args.port}"
    status, health = _get_json(f"{base}/health")
    info: Mapping[str, Any] | None = health if status == 200 and isinstance(health, dict) else None
    server = None
    if info is not None and not printing:
        progress_line(f"reusing the server at {base} (model {info.get('model')})")
        if args.context_window and args.context_window != info.get("context_window"):
            progress_line(f"--context-window {args.context_window} ignored: the running server enforces its own")
    elif info is None and not printing:
        server, info = start_server(args, base, _log_path(args))
    try:
        configured = settings_from(argparse.Namespace(model=args.model, mode=args.mode)).model.model
        model = str(info["model"]) if info and info.get("model") else configured
        window = int(info["context_window"]) if info and info.get("context_window") else None
        window = window or args.context_window or FALLBACK_WINDOW
        target = Target(
            base_url=base,
            model=model,
            api_key=args.api_key,
            context_window=window,
            max_output_tokens=args.max_output_tokens or max(1, window // 4),
        )
        plan_fn = PLANS[client]
        plan = (
            plan_fn(target, client_args, os.environ, api=args.api)  # type: ignore[operator]
            if client == "pi"
            else plan_fn(target, client_args, os.environ)
        )
        if args.print_env:
            for key in plan.removed_env:
                sys.stdout.write(f"unset {key}\n")
            for key, value in plan.shown_env.items():
                sys.stdout.write(f"export {key}={shlex.quote(value)}\n")
            return 0
        if args.print_config:
            sys.stdout.write(f"# command\n{shlex.join(plan.argv)}\n")
            for rel, content in plan.files.items():
                sys.stdout.write(f"# file {{tmp}}/{rel}\n{content}")
            return 0
        progress_line(f"{client} gets model {model} with a context window of {window} tokens")
        with tempfile.TemporaryDirectory(prefix=f"mlx-dspark-{client}-") as tmp:
            child_argv, env = materialize(plan, tmp)
            try:
                with _agent_signals():
                    return subprocess.call(child_argv, env=env)
            except FileNotFoundError:
                sys.stderr.write(f"mlx-dspark: {child_argv[0]!r} is not installed or not on PATH\n")
                return 127
    finally:
        if server is not None:
            _stop(server)
