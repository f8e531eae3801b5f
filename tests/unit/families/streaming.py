"""What the family-codec tests share: the shell tool they call, and feeding a parser text in random chunks."""

from __future__ import annotations

import random
from typing import Any

from mlx_dspark.domain.chat import ChatEvent, ToolSpec

SHELL = ToolSpec(
    name="shell",
    description="Run a command",
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["command"],
    },
)


def feed_in_chunks(parser: Any, text: str, rng: random.Random, longest: int) -> list[ChatEvent]:
    """Every event of `parser` over `text` fed in chunks of 1..`longest` characters, the finish included."""
    events: list[ChatEvent] = []
    i = 0
    while i < len(text):
        n = rng.randint(1, longest)
        events += parser.feed(text[i : i + n])
        i += n
    return events + parser.finish()
