"""Incremental detokenization: turn committed token ids into text deltas without re-decoding everything."""

from __future__ import annotations

from collections.abc import Sequence

from mlx_dspark.application.ports import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Emits text for new tokens once it is stable (no half-decoded multi-byte character at the end)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (keeps leading-space handling right)
        self._read = 0  # ids before this are already emitted

    def add(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        done = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        if full.endswith(REPLACEMENT) or len(full) < len(done):
            return ""
        delta = full[len(done) :]
        # Slide the window so each call decodes a bounded number of ids; a few ids of left context
        # keep tokenizers that strip a leading space from decoding the next piece differently.
        self._read = len(self._ids)
        self._prefix = max(0, self._read - 6)
        return delta

    def flush(self) -> str:
        done = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        self._read = len(self._ids)
        return full[len(done) :] if len(full) > len(done) else ""
