"""Reading what a command wrote to a pseudo-terminal, for the tests of terminal-only output."""

from __future__ import annotations

import os
import select


def read_pty(master: int, first: float = 0.5, then: float = 0.1) -> bytes:
    """Everything readable on `master`: wait up to `first` seconds for output, then `then` between chunks."""
    out = b""
    timeout = first
    while select.select([master], [], [], timeout)[0]:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        out += data
        timeout = then
    return out
