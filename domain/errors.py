"""The one error hierarchy the core raises; adapters translate foreign errors into these."""

from __future__ import annotations

import attrs


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
