"""The dependency rule is a test: import-linter contracts hold, and each one catches a planted violation.

The layer folders are assembled into a throwaway `mlx_dspark` tree so the check works for any install mode.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("domain", "adapters", "application", "entrypoints")
LINT = Path(sys.executable).with_name("lint-imports")


def _assemble(tmp: Path) -> Path:
    pkg = tmp / "src" / "mlx_dspark"
    for layer in LAYERS:
        shutil.copytree(ROOT / layer, pkg / layer, ignore=shutil.ignore_patterns("__pycache__", "_package"))
    shutil.copy(ROOT / "entrypoints" / "_package" / "__init__.py", pkg / "__init__.py")
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return pkg


def _lint(tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tmp / "src")}
    return subprocess.run(
        [str(LINT), str(tmp / "pyproject.toml"), "--no-cache"],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_contracts_hold_on_the_real_tree(tmp_path):
    _assemble(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


PLANTS = {
    "Domain is pure": ("domain/tokens.py", "import mlx.core\n"),
    "Driven adapters are wired only by the composition root": (
        "application/generation.py",
        "import mlx_dspark.adapters.telemetry.structlog_sink\n",
    ),
    "Only entrypoints use the composition root": (
        "application/modes.py",
        "import mlx_dspark.application.bootstrap\n",
    ),
    "Layers": ("domain/budget.py", "import mlx_dspark.application.settings\n"),
    "Dialects do not know each other": (
        "adapters/api/openai_chat/__init__.py",
        "import mlx_dspark.adapters.api.anthropic_messages\n",
    ),
    "Frameworks stay at the edge": ("adapters/telemetry/structlog_sink.py", "import litestar\n"),
    "No double import through the bare root folders": ("application/settings.py", "import domain.tokens\n"),
    "The serving path does not use the lab": (
        "application/chat_service.py",
        "import mlx_dspark.application.lab.bench\n",
    ),
}


@pytest.mark.parametrize("contract", sorted(PLANTS))
def test_a_planted_violation_breaks_its_contract(tmp_path, contract):
    pkg = _assemble(tmp_path)
    rel, line = PLANTS[contract]
    target = pkg / rel
    target.write_text(target.read_text() + "\n" + line)
    if contract == "No double import through the bare root folders":
        # The bare folder must exist on the path for the import to resolve.
        shutil.copytree(pkg / "domain", tmp_path / "src" / "domain")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in result.stdout, result.stdout
