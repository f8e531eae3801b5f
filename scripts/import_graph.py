"""Draw the package-level import graph of the four layer folders, for this tree or a git revision, as text.

    python scripts/import_graph.py                 # the working tree
    python scripts/import_graph.py --rev d9289ff~1  # the tree before the step engine (issue 25's "before")

A node is a module's package two levels down (`application.engine`, `adapters.mlx`) or a top-level module of a
layer (`application.generation`); an edge `a → b` says some module of `a` imports one of `b` (`mlx_dspark.` dropped),
with how many import statements. farm-studio does not follow the `mlx_dspark.*` names onto the folders (setup.py
maps them), so this reads the sources' own imports with `ast`.
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

LAYERS = ("domain", "adapters", "application", "entrypoints")
ROOT = Path(__file__).resolve().parents[1]


def sources(rev: str | None) -> Iterator[tuple[str, str]]:
    """(path, text) of every .py file of the layer folders, at `rev` (None: the working tree)."""
    if rev is None:
        for layer in LAYERS:
            for path in sorted((ROOT / layer).rglob("*.py")):
                yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")
        return
    blob = subprocess.run(["git", "archive", rev, *LAYERS], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                handle = tar.extractfile(member)
                if handle is not None:
                    yield member.name, handle.read().decode("utf-8")


def node(module: str) -> str:
    """`application.engine.step` → `application.engine`; `application.generation` stays itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def module_of(path: str) -> str:
    parts = path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def edges(rev: str | None) -> collections.Counter[tuple[str, str]]:
    out: collections.Counter[tuple[str, str]] = collections.Counter()
    for path, text in sources(rev):
        if "/_package/" in path:  # the `mlx_dspark` package itself (re-exports), not a layer module
            continue
        here = node(module_of(path))
        for stmt in ast.walk(ast.parse(text)):
            names: list[str] = []
            if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                names = [stmt.module]
            elif isinstance(stmt, ast.Import):
                names = [a.name for a in stmt.names]
            for name in names:
                if name.startswith("mlx_dspark.") and name.split(".")[1] in LAYERS:
                    there = node(name.removeprefix("mlx_dspark."))
                    if there != here and there.split(".")[0] in LAYERS:
                        out[(here, there)] += 1
    return out


def draw(graph: collections.Counter[tuple[str, str]]) -> str:
    """One block per source node, grouped by layer: `node → target (n), …`."""
    by: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for (a, b), n in graph.items():
        by[a].append((b, n))
    lines = []
    for layer in reversed(LAYERS):
        for a in sorted(k for k in by if k.split(".")[0] == layer):
            targets = ", ".join(f"{b} ({n})" for b, n in sorted(by[a]))
            lines.append(f"{a} → {targets}")
    upward = [f"{a} → {b}" for a, b in graph if LAYERS.index(a.split(".")[0]) < LAYERS.index(b.split(".")[0])]
    lines.append(f"upward edges: {', '.join(upward) if upward else 'none'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision (default: the working tree)")
    args = parser.parse_args()
    print(draw(edges(args.rev)))


if __name__ == "__main__":
    main()
