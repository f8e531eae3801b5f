"""The README stays a user's document: short, opening with the two commands a fresh machine runs, and every
relative link in it pointing at a file of the checkout (measurements and their history live in
docs/benchmarks.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 230
FIRST_COMMANDS = ("./dev.sh demo", "./dev.sh test")

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _text() -> str:
    return README.read_text(encoding="utf-8")


def test_the_readme_stays_short() -> None:
    lines = _text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES}): move detail to docs/"


def test_the_first_two_commands_are_the_demo_and_the_tests() -> None:
    first_block = _FENCE.search(_text())
    assert first_block is not None, "README.md has no code block"
    commands = [line.strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert len(commands) >= 2
    for command, expected in zip(commands[:2], FIRST_COMMANDS, strict=True):
        assert command.split("#")[0].strip() == expected, f"README.md starts with {command!r}, not {expected!r}"


def test_every_relative_link_points_at_a_file() -> None:
    prose = _FENCE.sub("", _text())
    targets = [t for t in _LINK.findall(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    assert "docs/benchmarks.md" in targets, "README.md should link the benchmarks"
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
