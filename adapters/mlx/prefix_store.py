"""Spilled prefix-cache entries as safetensors files: one per entry, under one folder per model identity.

`<dir>/<model key>/<prefix hash>.safetensors`: the model key hashes the model identity, the prefix hash
covers the state tag and the token ids. The header's metadata names the format, the identity, the tag
and a CRC-32 of the tensor bytes; a file whose name, header, identity, tag, tokens or checksum do not
match is skipped with a warning and never loaded. Writes go to a temp file, fsync, then rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_dspark.adapters.mlx.cache_state import MlxCacheState
from mlx_dspark.domain.cache import StoredPrefix

FORMAT = "mlx-dspark-prefix/1"
SUFFIX = ".safetensors"
_MAX_HEADER = 64 << 20

# mlx dtype -> (safetensors name, numpy dtype holding the same bytes)
_DTYPES: dict[Any, tuple[str, Any]] = {
    mx.float32: ("F32", np.float32),
    mx.float16: ("F16", np.float16),
    mx.bfloat16: ("BF16", np.uint16),
    mx.int32: ("I32", np.int32),
    mx.uint32: ("U32", np.uint32),
    mx.int64: ("I64", np.int64),
    mx.uint8: ("U8", np.uint8),
    mx.int8: ("I8", np.int8),
}
_BY_NAME = {name: (dtype, np_dtype) for dtype, (name, np_dtype) in _DTYPES.items()}


def prefix_hash(tag: str, tokens: tuple[int, ...]) -> str:
    """The file name of an entry: tag and token ids, hashed."""
    digest = hashlib.sha256(tag.encode())
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.hexdigest()[:40]


class SafetensorsPrefixStore:
    """The PrefixStore port over a folder of safetensors files (one model identity per subfolder).

    Args:
        root: the `--prefix-cache-dir`.
        identity: the loaded model's identity (files of other models are never read).
        warn: receives one line per skipped or refused file.
    """

    def __init__(self, root: str | os.PathLike[str], identity: str, *, warn: Callable[[str], None] | None = None):
        self.identity = identity
        self.folder = Path(root) / hashlib.sha256(identity.encode()).hexdigest()[:16]
        self._warn = warn or (lambda _msg: None)

    # The port -------------------------------------------------------------------------------------

    def scan(self) -> list[StoredPrefix]:
        found: list[tuple[float, StoredPrefix]] = []
        if not self.folder.is_dir():
            return []
        for path in self.folder.glob(f"*{SUFFIX}"):
            if path.name.startswith(".tmp-"):
                continue
            try:
                header, data_start = _read_header(path)
                meta = self._check_meta(path, header)
                tokens = _read_tokens(path, header, data_start)
                stored = self._stored(path, meta, tokens)
            except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
                self._warn(f"prefix cache: ignoring {path.name}: {exc}")
                continue
            found.append((path.stat().st_mtime, stored))
        return [s for _, s in sorted(found, key=lambda t: t[0])]

    def save(self, state: Any, *, tag: str, tokens: tuple[int, ...]) -> StoredPrefix:
        if not isinstance(state, MlxCacheState):
            raise TypeError(f"cannot store {type(state).__name__}")
        arrays: dict[str, mx.array] = {"tokens": mx.array(list(tokens), dtype=mx.int32)}
        if state.features is not None:
            arrays["features"] = state.features
        layout = []
        for i, (kind, fields) in enumerate(zip(state.kinds, state.fields)):
            layout.append({"kind": kind, "fields": _encode(fields, f"leaf{i}", arrays)})
        key = prefix_hash(tag, tokens)
        meta = {
            "format": FORMAT,
            "identity": self.identity,
            "tag": tag,
            "key": key,
            "min_length": str(state.min_length),
            "layout": json.dumps(layout),
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{key}{SUFFIX}"
        _write_atomic(path, arrays, meta)
        return StoredPrefix(
            key=key, tag=tag, tokens=tokens, nbytes=path.stat().st_size, min_length=state.min_length
        )

    def load(self, stored: StoredPrefix) -> MlxCacheState | None:
        path = self.folder / f"{stored.key}{SUFFIX}"
        try:
            arrays, meta = _read_all(path)
            self._check_meta(path, {"__metadata__": meta})
            tokens = tuple(int(t) for t in np.array(arrays["tokens"]).tolist())
            if meta["tag"] != stored.tag or tokens != stored.tokens or prefix_hash(meta["tag"], tokens) != stored.key:
                raise ValueError("its tokens or tag differ from the index")
            kinds, fields = [], []
            for leaf in json.loads(meta["layout"]):
                kinds.append(str(leaf["kind"]))
                fields.append(_decode(leaf["fields"], arrays))
            features = arrays.get("features")
            nbytes = sum(a.nbytes for name, a in arrays.items() if name != "tokens")
            return MlxCacheState(
                tag=meta["tag"],
                tokens=tokens,
                kinds=tuple(kinds),
                fields=tuple(fields),
                features=features,
                nbytes=int(nbytes),
                min_length=int(meta["min_length"]),
            )
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error, json.JSONDecodeError) as exc:
            self._warn(f"prefix cache: not loading {path.name}: {exc}")
            return None

    def delete(self, stored: StoredPrefix) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.folder / f"{stored.key}{SUFFIX}").unlink()

    # Internals ------------------------------------------------------------------------------------

    def _check_meta(self, path: Path, header: dict[str, Any]) -> dict[str, str]:
        meta = header.get("__metadata__")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError("not a prefix-cache file of this format")
        if meta.get("identity") != self.identity:
            raise ValueError(f"it belongs to another model ({meta.get('identity')!r})")
        if meta.get("key") != path.name.removesuffix(SUFFIX):
            raise ValueError("its name does not match its contents")
        return meta

    def _stored(self, path: Path, meta: dict[str, str], tokens: tuple[int, ...]) -> StoredPrefix:
        if prefix_hash(meta["tag"], tokens) != meta["key"]:
            raise ValueError("its tokens do not match its name")
        return StoredPrefix(
            key=meta["key"],
            tag=meta["tag"],
            tokens=tokens,
            nbytes=path.stat().st_size,
            min_length=int(meta["min_length"]),
        )


def _encode(value: Any, name: str, arrays: dict[str, mx.array]) -> Any:
    """JSON for a leaf's fields; arrays go to `arrays` under a path-like name."""
    if isinstance(value, mx.array):
        arrays[name] = value
        return {"$array": name}
    if isinstance(value, dict):
        return {"$dict": {k: _encode(v, f"{name}.{k}", arrays) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{name}.{i}", arrays) for i, v in enumerate(value)]
        return {"$tuple": items} if isinstance(value, tuple) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store a cache field of type {type(value).__name__}")


def _decode(value: Any, arrays: dict[str, mx.array]) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if isinstance(value, dict):
        if "$array" in value:
            return arrays[value["$array"]]
        if "$tuple" in value:
            return tuple(_decode(v, arrays) for v in value["$tuple"])
        return {k: _decode(v, arrays) for k, v in value["$dict"].items()}
    return value


def _write_atomic(path: Path, arrays: dict[str, mx.array], meta: dict[str, str]) -> None:
    """A safetensors file (checksummed) written to a temp name, fsynced, then renamed over `path`."""
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    crc = 0
    for name, a in arrays.items():
        spec = _DTYPES.get(a.dtype)
        if spec is None:
            raise TypeError(f"cannot store dtype {a.dtype}")
        st_name, np_dtype = spec
        host = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).astype(np_dtype, copy=False)
        blob = np.ascontiguousarray(host).tobytes()
        header[name] = {"dtype": st_name, "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        crc = zlib.crc32(blob, crc)
        blobs.append(blob)
    header["__metadata__"] = {**meta, "crc32": str(crc)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for blob in blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > _MAX_HEADER:
            raise ValueError("its header is implausibly large")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("its header is not an object")
    return header, 8 + size


def _read_tokens(path: Path, header: dict[str, Any], data_start: int) -> tuple[int, ...]:
    spec = header["tokens"]
    if spec["dtype"] != "I32":
        raise ValueError("its token ids are not int32")
    begin, end = spec["data_offsets"]
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        raw = f.read(end - begin)
    if len(raw) != end - begin:
        raise ValueError("it is truncated")
    return tuple(int(t) for t in np.frombuffer(raw, dtype=np.int32).tolist())


def _read_all(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Every tensor of a file written by `_write_atomic`, after checking its CRC."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    if size > _MAX_HEADER or 8 + size > len(data):
        raise ValueError("it is truncated")
    header = json.loads(data[8 : 8 + size])
    meta = header.pop("__metadata__")
    body = memoryview(data)[8 + size :]
    crc = 0
    arrays: dict[str, mx.array] = {}
    expected_end = 0
    for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = spec["data_offsets"]
        if begin != expected_end or end > len(body):
            raise ValueError("its tensors are not laid out as written")
        expected_end = end
        blob = body[begin:end]
        crc = zlib.crc32(blob, crc)
        dtype, np_dtype = _BY_NAME[spec["dtype"]]
        host = np.frombuffer(blob, dtype=np_dtype).reshape(spec["shape"])
        a = mx.array(host)
        arrays[name] = a.view(mx.bfloat16) if dtype == mx.bfloat16 else a
    if expected_end != len(body) or str(crc) != meta.get("crc32"):
        raise ValueError("its checksum does not match (corrupt)")
    return arrays, meta
