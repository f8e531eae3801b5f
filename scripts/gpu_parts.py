#!/usr/bin/env python3
"""Send a model export to the GPU machine in upload-sized parts, and put it back together there.

The device tool uploads at most 64 MiB a call, the repository tree (~41 MB) included, so a model
(the Qwen2.5-Coder-1.5B GGUF is 1.1 GB; its float32 export 6 GB) travels as parts of <= N MiB, one or a few per
call, kept between calls in an ignored folder. Standard library only: it runs on a bare GPU host.

    python3 scripts/gpu_parts.py split SRC OUT [--part-mib 20] [--name NAME]
        SRC is a directory (every file under it, sorted) or one file. Writes OUT/NAME.partNNNN and
        OUT/NAME.manifest.json (each file's path, size and sha256; each part's size and sha256; the sha256 of
        the whole stream).
    python3 scripts/gpu_parts.py check PARTS_DIR [--manifest FILE]
        Which parts are present and sound, which are missing or corrupt (exit 1 unless all are sound).
    python3 scripts/gpu_parts.py join PARTS_DIR DEST [--manifest FILE]
        Checks every part's hash, streams the parts back into the files under DEST (each file's sha256 and the
        whole stream's checked), written to a temporary folder beside DEST and renamed into place last.

Typical use, one device call per batch of parts (ignored paths under build/ survive between calls while the
machine stays warm): carry `build/parts-send` holding the manifest and the next parts, and run
`mkdir -p build/parts && cp build/parts-send/* build/parts/ && python3 scripts/gpu_parts.py check build/parts`;
after the last batch, `python3 scripts/gpu_parts.py join build/parts build/model`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

SCHEMA = "mlx-dspark/gpu-parts/1"
CHUNK = 1 << 20


class PartsError(RuntimeError):
    """Parts missing, corrupt or not matching their manifest."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _sources(src: Path) -> list[tuple[str, Path]]:
    if src.is_file():
        return [(src.name, src)]
    if not src.is_dir():
        raise PartsError(f"{src} is neither a file nor a directory")
    files = sorted(p for p in src.rglob("*") if p.is_file())
    if not files:
        raise PartsError(f"{src} holds no files")
    return [(p.relative_to(src).as_posix(), p) for p in files]


def _stream(files: list[tuple[str, Path]]) -> Iterator[bytes]:
    for _, path in files:
        with path.open("rb") as f:
            yield from iter(lambda: f.read(CHUNK), b"")


class _Part:
    """One part being written: at most `limit` bytes, hashed as they go."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.room = path, limit
        self._file = path.open("wb")
        self._hash = hashlib.sha256()

    def write(self, view: memoryview) -> memoryview:
        """Write what fits; returns the rest."""
        take = view[: self.room]
        self._file.write(take)
        self._hash.update(take)
        self.room -= len(take)
        return view[len(take) :]

    def close(self) -> dict[str, object]:
        self._file.close()
        return {"file": self.path.name, "size": self.path.stat().st_size, "sha256": self._hash.hexdigest()}


def split(src: Path, out: Path, *, part_mib: float = 20.0, name: str | None = None) -> Path:
    """Cut `src` into parts of at most `part_mib` MiB under `out`; returns the manifest's path."""
    part_bytes = int(part_mib * (1 << 20))
    if part_bytes < 1:
        raise PartsError("--part-mib must be positive")
    files = _sources(src)
    name = name or src.name
    out.mkdir(parents=True, exist_ok=True)
    entries = [{"path": rel, "size": p.stat().st_size, "sha256": _sha256(p)} for rel, p in files]
    whole = hashlib.sha256()
    parts: list[dict[str, object]] = []
    part: _Part | None = None
    for block in _stream(files):
        whole.update(block)
        view = memoryview(block)
        while view:
            if part is None or part.room == 0:
                if part is not None:
                    parts.append(part.close())
                part = _Part(out / f"{name}.part{len(parts):04d}", part_bytes)
            view = part.write(view)
    if part is not None:
        parts.append(part.close())
    manifest = {
        "schema": SCHEMA,
        "name": name,
        "part_bytes": part_bytes,
        "total_bytes": sum(p.stat().st_size for _, p in files),
        "sha256": whole.hexdigest(),
        "files": entries,
        "parts": parts,
    }
    path = out / f"{name}.manifest.json"
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def _manifest(parts_dir: Path, manifest: Path | None) -> dict[str, object]:
    if manifest is None:
        found = sorted(parts_dir.glob("*.manifest.json"))
        if len(found) != 1:
            raise PartsError(f"{parts_dir}: expected one *.manifest.json, found {len(found)} (pass --manifest)")
        manifest = found[0]
    doc = json.loads(manifest.read_text())
    if doc.get("schema") != SCHEMA:
        raise PartsError(f"{manifest}: not a {SCHEMA} manifest")
    return doc  # type: ignore[no-any-return]


def check(parts_dir: Path, manifest: Path | None = None) -> tuple[list[str], list[str]]:
    """(missing parts, corrupt parts) of the manifest's parts under `parts_dir`."""
    doc = _manifest(parts_dir, manifest)
    missing, corrupt = [], []
    for part in doc["parts"]:  # type: ignore[attr-defined]
        path = parts_dir / part["file"]
        if not path.is_file():
            missing.append(part["file"])
        elif path.stat().st_size != part["size"] or _sha256(path) != part["sha256"]:
            corrupt.append(part["file"])
    return missing, corrupt


def join(parts_dir: Path, dest: Path, manifest: Path | None = None) -> Path:
    """The files back under `dest`, every hash checked; nothing lands at `dest` unless all agree."""
    doc = _manifest(parts_dir, manifest)
    missing, corrupt = check(parts_dir, manifest)
    if missing or corrupt:
        raise PartsError(f"cannot join {doc['name']}: missing {missing or 'none'}, corrupt {corrupt or 'none'}")
    if dest.exists():
        raise PartsError(f"{dest} exists; remove it or choose another destination")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        whole = hashlib.sha256()
        parts = iter(doc["parts"])  # type: ignore[call-overload]
        pending = memoryview(b"")
        current = None

        def more() -> memoryview:
            nonlocal current
            if current is not None:
                current.close()
            part = next(parts, None)
            if part is None:
                raise PartsError("the parts end before the manifest's files do")
            current = (parts_dir / part["file"]).open("rb")
            return memoryview(current.read())

        for entry in doc["files"]:  # type: ignore[attr-defined]
            target = tmp / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            left = int(entry["size"])
            with target.open("wb") as f:
                while left:
                    if not pending:
                        pending = more()
                    take = pending[:left]
                    f.write(take)
                    h.update(take)
                    whole.update(take)
                    left -= len(take)
                    pending = pending[len(take) :]
                f.flush()
                os.fsync(f.fileno())
            if h.hexdigest() != entry["sha256"]:
                raise PartsError(f"{entry['path']}: sha256 {h.hexdigest()} is not the manifest's {entry['sha256']}")
        if current is not None:
            current.close()
        if pending or next(parts, None) is not None:
            raise PartsError("the parts hold more bytes than the manifest's files")
        if whole.hexdigest() != doc["sha256"]:
            raise PartsError(f"the joined stream's sha256 {whole.hexdigest()} is not the manifest's {doc['sha256']}")
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_parts.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut a directory or file into parts with a manifest")
    s.add_argument("src", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--part-mib", type=float, default=20.0, help="largest part in MiB (default 20)")
    s.add_argument("--name", help="parts' file stem (default: the source's name)")
    c = sub.add_parser("check", help="which parts are present and sound")
    c.add_argument("parts_dir", type=Path)
    c.add_argument("--manifest", type=Path)
    j = sub.add_parser("join", help="check every hash and put the files back together")
    j.add_argument("parts_dir", type=Path)
    j.add_argument("dest", type=Path)
    j.add_argument("--manifest", type=Path)
    args = p.parse_args(argv)
    try:
        if args.cmd == "split":
            path = split(args.src, args.out, part_mib=args.part_mib, name=args.name)
            doc = json.loads(path.read_text())
            print(f"{len(doc['parts'])} parts of <= {args.part_mib:g} MiB, {doc['total_bytes']} bytes; manifest {path}")
        elif args.cmd == "check":
            missing, corrupt = check(args.parts_dir, args.manifest)
            print(json.dumps({"missing": missing, "corrupt": corrupt}))
            return 0 if not missing and not corrupt else 1
        else:
            print(join(args.parts_dir, args.dest, args.manifest))
    except PartsError as exc:
        print(f"gpu_parts: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
