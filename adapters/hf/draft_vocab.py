"""A draft model's draft vocabulary: the tokens text uses most, counted once per tokenizer and cached.

A large vocabulary's head is a large share of a small draft model's step (Qwen2.5-Coder-0.5B: 136M of its 494M
parameters), and most of its rows are tokens text rarely uses. With `--draft-vocab N` the draft model drafts from
the N most frequent tokens only (`DraftModelSource(vocab_ids=...)`): a target token outside them ends the block
early, which costs acceptance, never exactness.

The counts come from text every install has, in a fixed order: the Python standard library's sources (code,
docstrings) and the Markdown docs of installed packages (prose). Every added and special token is always in.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlx_dspark.adapters.hf.cache import atomic_write_bytes

CORPUS_BYTES = 12 << 20  # ~3M tokens: enough to rank 32k tokens; ~5 s once per tokenizer on 2 cores
FILE_BYTES = 64 << 10  # no one file dominates the counts
VERSION = 1  # bump when the corpus or the rule changes: cached vocabularies are then recounted


def wanted_size(vocab: int, size: int | None) -> int:
    """The draft vocabulary to use for a model of `vocab` tokens: `size` when it is smaller than the vocabulary,
    else 0 (the whole head). Off unless asked: on this project's CPU (2026-12-07, Qwen2.5-Coder-0.5B drafting for
    the 1.5B, cap 3) 32k tokens made a draft 14% cheaper and cost 7% of the tokens a round (3.23 -> 3.01): even."""
    return size if size is not None and 0 < size < vocab else 0


def corpus_files() -> Iterator[Path]:
    """The counted files, in a fixed order: the standard library's `.py` sources, then `.md` files under the
    installed packages."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    yield from sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    for root in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")):
        yield from sorted(Path(root).rglob("*.md"))


def corpus_texts(budget: int | None = None) -> list[str]:
    """Up to `budget` (CORPUS_BYTES) characters of the corpus, FILE_BYTES at most from one file."""
    budget = CORPUS_BYTES if budget is None else budget
    texts: list[str] = []
    total = 0
    for path in corpus_files():
        try:
            text = path.read_bytes()[:FILE_BYTES].decode("utf-8", errors="ignore")
        except OSError:
            continue
        texts.append(text)
        total += len(text)
        if total >= budget:
            break
    return texts


def count_tokens(encode_batch: Any, texts: list[str]) -> Counter[int]:
    """Token counts of `texts` through `encode_batch(list[str]) -> list[list[int]]`."""
    counts: Counter[int] = Counter()
    for start in range(0, len(texts), 256):
        for ids in encode_batch(texts[start : start + 256]):
            counts.update(ids)
    return counts


def ranked(counts: Counter[int], size: int, always: set[int], vocab: int) -> tuple[int, ...]:
    """`always` plus the most frequent ids (ties by id) up to `size` in all, sorted."""
    chosen = {i for i in always if 0 <= i < vocab}
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if 0 <= token < vocab:
            chosen.add(token)
    return tuple(sorted(chosen))


def _encoder(tokenizer: Any) -> Any:
    """A batch encoder without special tokens: the fast backend's when there is one."""
    hf = getattr(tokenizer, "_hf", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        return lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return lambda texts: [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def always_ids(tokenizer: Any) -> set[int]:
    """Every added and special token and the EOS ids: chat templates and tool calls are made of them."""
    hf = getattr(tokenizer, "_hf", tokenizer)
    added = getattr(hf, "added_tokens_decoder", {}) or {}
    ids = {int(i) for i in added}
    ids |= set(getattr(tokenizer, "special_ids", ()) or ())
    ids |= set(getattr(tokenizer, "eos_ids", ()) or ())
    return ids


def draft_vocabulary(tokenizer: Any, identity: str, vocab: int, size: int, cache_dir: Path) -> tuple[int, ...]:
    """The `size` token ids a draft model of `identity` drafts from, counted once and then read from the cache.

    Args:
        tokenizer: the model's tokenizer (the HF adapter, or anything with `encode`).
        identity: the model's identity (the cache key, with the size and VERSION).
        vocab: rows of the model's head (ids at or past it are never chosen).
        size: tokens wanted (the added and special tokens count toward it).
        cache_dir: the mlx-dspark cache root.
    """
    key = hashlib.sha256(f"{identity}|{size}|{VERSION}|{sys.version_info[:2]}".encode()).hexdigest()[:24]
    path = cache_dir / "draft-vocab" / f"{key}.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("identity") == identity and len(cached.get("ids", ())) > 0:
            return tuple(int(i) for i in cached["ids"])
    except (OSError, ValueError, AttributeError):
        pass  # absent or unreadable: count again
    counts = count_tokens(_encoder(tokenizer), corpus_texts())
    ids = ranked(counts, size, always_ids(tokenizer), vocab)
    body = {"identity": identity, "size": size, "version": VERSION, "corpus_tokens": sum(counts.values()), "ids": ids}
    atomic_write_bytes(path, json.dumps(body).encode())
    return ids
