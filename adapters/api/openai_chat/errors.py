"""OpenAI error envelopes: `{"error": {"message", "type", "param", "code"}}` with the matching status.

Context overflow says "maximum context length is N tokens" with code `context_length_exceeded`, the forms
Codex and Pi recognise.
"""

from __future__ import annotations

from typing import Any

from mlx_dspark.adapters.api import common
from mlx_dspark.domain.errors import (
    CapacityExceeded,
    ContextTooLong,
    DomainError,
    InvalidRequest,
    ModelUnavailable,
    Overloaded,
)

envelope = common.openai_envelope


def context_message(exc: ContextTooLong) -> str:
    return (
        f"This model's maximum context length is {exc.limit} tokens. However, your messages resulted in "
        f"{exc.requested} tokens. Please reduce the length of the messages (context_length_exceeded)."
    )


def from_exception(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and body for an error raised while handling a request."""
    if isinstance(exc, ContextTooLong):
        return 400, envelope(400, context_message(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return 400, envelope(400, exc.message, param=exc.param)
    if isinstance(exc, ModelUnavailable):
        return 404, envelope(404, exc.message, param="model", code="model_not_found")
    if isinstance(exc, Overloaded):
        return 429, envelope(429, exc.message, code="rate_limit_exceeded")
    if isinstance(exc, CapacityExceeded):
        return 503, envelope(503, exc.message, code="server_overloaded")
    if isinstance(exc, DomainError):
        return 500, envelope(500, exc.message)
    return 500, envelope(500, "internal server error")
