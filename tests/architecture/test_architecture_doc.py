"""architecture.md stays true to the tree, cheaply: every repo path it names in backticks exists, every module of
the four layer folders is named (itself, or by a folder line covering it), and its list of import contracts is
exactly the `[[tool.importlinter.contracts]]` names of pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "architecture.md"
LAYERS = ("domain", "adapters", "application", "entrypoints")
PATH_ROOTS = (*LAYERS, "tests", "scripts")
CONTRACTS_HEADING = "## Import contracts"

_FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`([^`\n]+)`")
_REPO_PATH = re.compile(rf"^(?:{'|'.join(PATH_ROOTS)})/[\w./-]*$")
_FOLDER_LINE = re.compile(r"^- `([^`]+/)`")
_CONTRACT = re.compile(r"^- \*\*(.+?)\*\*")


def _prose() -> str:
    """The document without its fenced blocks (the diagram names things loosely, not as checked paths)."""
    return _FENCE.sub("", DOC.read_text(encoding="utf-8"))


def _named_paths() -> set[str]:
    """Backticked spans that look like repo paths: under a layer, tests/ or scripts/, ending in .py or /."""
    spans = _CODE.findall(_prose())
    return {s for s in spans if _REPO_PATH.match(s) and (s.endswith(".py") or s.endswith("/"))}


def _folder_lines() -> set[str]:
    """Folders that open a bullet line: such a line describes everything below the folder."""
    return {m.group(1) for line in _prose().splitlines() if (m := _FOLDER_LINE.match(line))}


def _modules() -> list[str]:
    """Every .py module of the layer folders except package __init__ files, as repo-relative paths."""
    found = [p for layer in LAYERS for p in (ROOT / layer).rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(p.relative_to(ROOT).as_posix() for p in found if p.name != "__init__.py")


def _doc_contracts() -> list[str]:
    """The contract names listed (as bold bullets) under the import-contracts heading."""
    lines = _prose().splitlines()
    start = lines.index(CONTRACTS_HEADING) + 1
    section: list[str] = []
    for line in lines[start:]:
        if line.startswith("#"):
            break
        section.append(line)
    return [m.group(1) for line in section if (m := _CONTRACT.match(line))]


def test_every_named_path_exists() -> None:
    paths = _named_paths()
    assert paths, "architecture.md names no repo paths in backticks"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"architecture.md names paths that do not exist: {missing}"


def test_every_module_is_described() -> None:
    named = _named_paths()
    folders = _folder_lines()
    uncovered = [m for m in _modules() if m not in named and not any(m.startswith(f) for f in folders)]
    assert not uncovered, f"architecture.md has no line for these modules (or a folder line above them): {uncovered}"


def test_the_listed_contracts_are_pyprojects() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    expected = sorted(c["name"] for c in contracts)
    listed = _doc_contracts()
    assert len(listed) == len(set(listed)), f"architecture.md lists a contract twice: {listed}"
    assert sorted(listed) == expected, f"architecture.md lists {sorted(listed)}, pyproject.toml has {expected}"
