"""Anthropic error envelopes: `{"type": "error", "error": {"type", "message"}}` with the matching status.

Context overflow keeps the two exact messages Claude Code parses (compaction, and its own max_tokens retry).
"""

from __future__ import annotations

from typing import Any

from mlx_dspark.domain.chat import OutputTooLong
from mlx_dspark.domain.errors import CapacityExceeded, ContextTooLong, DomainError, InvalidRequest, ModelUnavailable

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def envelope(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


def context_message(exc: ContextTooLong) -> str:
    if isinstance(exc, OutputTooLong):
        return (
            f"input length and `max_tokens` exceed context limit: {exc.prompt_tokens} + {exc.max_tokens} > {exc.limit}"
        )
    return f"prompt is too long: {exc.requested} tokens > {exc.limit} maximum"


def from_exception(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and body for an error raised while handling a request."""
    if isinstance(exc, ContextTooLong):
        return 400, envelope(400, context_message(exc))
    if isinstance(exc, InvalidRequest):
        return 400, envelope(400, exc.message)
    if isinstance(exc, ModelUnavailable):
        return 404, envelope(404, exc.message)
    if isinstance(exc, CapacityExceeded):
        return 529, envelope(529, exc.message)
    if isinstance(exc, DomainError):
        return 500, envelope(500, exc.message)
    return 500, envelope(500, "internal server error")
