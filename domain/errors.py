"""The one error hierarchy the core raises; adapters translate foreign errors into these.

`quoted` and `clipped` are how a message or a log line shows a value a caller sent: bounded and escaped,
so a megabyte field or a control character never reaches a client's error or a log whole.
"""

from __future__ import annotations

import re

import attrs

QUOTED_CHARS = 200
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clipped(text: str, limit: int = QUOTED_CHARS) -> str:
    """`text` with control characters escaped, cut after `limit` characters with its full length said."""
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text):,} characters)"
    return _CONTROL.sub(_escape, text)


def quoted(value: object, limit: int = QUOTED_CHARS) -> str:
    """A caller's value as a message quotes it: its repr (escaped), at most about `limit` characters of it."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value):,} characters)"
    return clipped(repr(value), limit)


@attrs.define(auto_exc=True, kw_only=True)
class DomainError(Exception):
    """Base of every error the engine reports to a caller."""

    message: str

    def __str__(self) -> str:
        return self.message


@attrs.define(auto_exc=True, kw_only=True)
class InvalidRequest(DomainError):
    """The caller asked for something malformed (bad parameter, unknown field value)."""

    param: str | None = None


@attrs.define(auto_exc=True, kw_only=True)
class ContextTooLong(DomainError):
    """The prompt plus the requested output does not fit the model's context window."""

    limit: int
    requested: int


@attrs.define(auto_exc=True, kw_only=True)
class ModelUnavailable(DomainError):
    """A model or drafter could not be found, read, or matched to its target."""


@attrs.define(auto_exc=True, kw_only=True)
class IncompatibleDrafter(DomainError):
    """A drafter's width, vocabulary or layer count does not fit the target."""


@attrs.define(auto_exc=True, kw_only=True)
class CapacityExceeded(DomainError):
    """The device ran out of memory or the engine is saturated."""


@attrs.define(auto_exc=True, kw_only=True)
class Overloaded(CapacityExceeded):
    """Too many requests are already waiting; the caller should retry later (429 / 529)."""
