"""The built-in, versioned bench prompt set (bench_prompts.jsonl), the drafters' held-out prompts
(train_heldout.jsonl) and loading of user prompt files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import attrs

from mlx_dspark.domain.errors import InvalidRequest

PROMPT_CLASSES = ("chat", "code", "math")
HELDOUT = "heldout"


@attrs.frozen(kw_only=True)
class BenchPrompt:
    """One bench prompt.

    Attributes:
        id: stable id ("chat-03").
        cls: its class ("chat", "code", "math", or "file" for user prompts).
        prompt: the user message.
    """

    id: str
    cls: str
    prompt: str


@attrs.frozen(kw_only=True)
class PromptSet:
    """A named, versioned list of prompts."""

    name: str
    version: str
    prompts: tuple[BenchPrompt, ...]


def builtin_prompts() -> PromptSet:
    """The built-in set shipped as package data."""
    text = resources.files(__package__).joinpath("bench_prompts.jsonl").read_text(encoding="utf-8")
    return _parse(text, "builtin")


def heldout_prompts() -> PromptSet:
    """The drafters' held-out evaluation prompts (train_heldout.jsonl, 10 per class; no training set
    holds them), for the bench's auto protocol."""
    text = resources.files(__package__).joinpath("train_heldout.jsonl").read_text(encoding="utf-8")
    return _parse(text, HELDOUT)


def per_class(prompts: PromptSet, n: int) -> PromptSet:
    """The first `n` prompts of each class, in order."""
    if n < 1:
        raise InvalidRequest(message=f"--per-class must be >= 1, got {n}", param="per_class")
    seen: dict[str, int] = {}
    kept = []
    for p in prompts.prompts:
        seen[p.cls] = seen.get(p.cls, 0) + 1
        if seen[p.cls] <= n:
            kept.append(p)
    return attrs.evolve(prompts, prompts=tuple(kept))


def interleaved(prompts: PromptSet) -> PromptSet:
    """The prompts round-robin over their classes (in first-seen order): any first N mix the classes, as N
    concurrent requests of a real server would, instead of the first class alone."""
    by_class: dict[str, list[BenchPrompt]] = {}
    for p in prompts.prompts:
        by_class.setdefault(p.cls, []).append(p)
    queues = list(by_class.values())
    mixed = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    return attrs.evolve(prompts, prompts=tuple(mixed))


def _parse(text: str, origin: str) -> PromptSet:
    name, version = origin, "unversioned"
    prompts: list[BenchPrompt] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise InvalidRequest(message=f"{origin}:{n}: not JSON: {exc}", param="prompts") from exc
        if isinstance(row, str):
            prompts.append(BenchPrompt(id=f"file-{len(prompts) + 1:02d}", cls="file", prompt=row))
        elif isinstance(row, dict) and "set" in row:
            name, version = str(row["set"]), str(row.get("version", version))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(
                BenchPrompt(
                    id=str(row.get("id") or f"file-{len(prompts) + 1:02d}"),
                    cls=str(row.get("class") or "file"),
                    prompt=row["prompt"],
                )
            )
        else:
            raise InvalidRequest(message=f"{origin}:{n}: expected {{'prompt': ...}} or a string", param="prompts")
    if not prompts:
        raise InvalidRequest(message=f"{origin}: no prompts", param="prompts")
    return PromptSet(name=name, version=version, prompts=tuple(prompts))


def load_prompts(spec: str | Sequence[str]) -> PromptSet:
    """Prompts by class names from the built-in set ("chat,code,math") or from a JSONL / text file.

    A file holds one JSON object per line ({"prompt", "class"?, "id"?}) or JSON strings; a file that is
    not JSONL is read as one prompt per non-empty line.

    Raises:
        InvalidRequest: an unknown class, or a file with no prompts.
    """
    parts = [p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec) if p.strip()]
    if parts and parts[0].split(":", 1)[0] == HELDOUT:
        # "heldout" or "heldout:chat,code": the drafters' held-out evaluation prompts (never trained on).
        first = parts[0].split(":", 1)
        wanted = [*([first[1]] if len(first) > 1 and first[1] else []), *parts[1:]] or list(PROMPT_CLASSES)
        bad = [c for c in wanted if c not in PROMPT_CLASSES]
        if bad:
            raise InvalidRequest(message=f"unknown prompt class(es) {bad} in {spec!r}", param="prompts")
        base = heldout_prompts()
        return attrs.evolve(base, prompts=tuple(p for p in base.prompts if p.cls in wanted))
    if parts and all(p in PROMPT_CLASSES for p in parts):
        base = builtin_prompts()
        chosen = tuple(p for p in base.prompts if p.cls in parts)
        return attrs.evolve(base, prompts=chosen)
    if len(parts) == 1 and Path(parts[0]).is_file():
        path = Path(parts[0])
        text = path.read_text(encoding="utf-8")
        try:
            return _parse(text, path.name)
        except InvalidRequest:
            lines = tuple(
                BenchPrompt(id=f"file-{i:02d}", cls="file", prompt=line.strip())
                for i, line in enumerate(text.splitlines(), 1)
                if line.strip()
            )
            if not lines:
                raise
            return PromptSet(name=path.name, version="unversioned", prompts=lines)
    raise InvalidRequest(
        message=f"--prompts takes classes from {', '.join(PROMPT_CLASSES)}, heldout[:classes] or a file; got {spec!r}",
        param="prompts",
    )


def sample_text() -> str:
    """Realistic English + code + math text (the built-in prompts joined) for calibration token streams."""
    return "\n\n".join(p.prompt for p in builtin_prompts().prompts)
