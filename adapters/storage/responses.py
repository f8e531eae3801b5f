"""The ResponseStore port in memory: the latest finished Responses turns, least recently used forgotten first.

A server restart forgets them; a client continuing a forgotten turn is told to send the whole conversation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from mlx_dspark.domain.chat import Message


class MemoryResponseStore:
    """At most `limit` conversations, keyed by response id (safe from any thread)."""

    def __init__(self, limit: int = 64) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._limit = limit
        self._turns: OrderedDict[str, tuple[Message, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, response_id: str, history: tuple[Message, ...]) -> None:
        with self._lock:
            self._turns[response_id] = history
            self._turns.move_to_end(response_id)
            while len(self._turns) > self._limit:
                self._turns.popitem(last=False)

    def recall(self, response_id: str) -> tuple[Message, ...] | None:
        with self._lock:
            history = self._turns.get(response_id)
            if history is not None:
                self._turns.move_to_end(response_id)
            return history
