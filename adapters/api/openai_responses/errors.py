"""Responses error envelopes (OpenAI's `{"error": {…}}`), and `response.failed` errors mid-stream.

Codex recognises `code: "context_length_exceeded"`; Pi recognises the "maximum context length" wording.
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


def classify(exc: BaseException) -> tuple[int, str, str | None, str | None]:
    """(status, message, param, code) for an error."""
    if isinstance(exc, ContextTooLong):
        message = (
            f"Your input exceeds the context window of this model: maximum context length is {exc.limit} tokens, "
            f"the request needs {exc.requested} tokens."
        )
        return 400, message, "input", "context_length_exceeded"
    if isinstance(exc, InvalidRequest):
        return 400, exc.message, exc.param, None
    if isinstance(exc, ModelUnavailable):
        return 404, exc.message, "model", "model_not_found"
    if isinstance(exc, Overloaded):
        return 429, exc.message, None, "rate_limit_exceeded"
    if isinstance(exc, CapacityExceeded):
        return 503, exc.message, None, "server_is_overloaded"
    if isinstance(exc, DomainError):
        return 500, exc.message, None, "server_error"
    return 500, "internal server error", None, "server_error"


def from_exception(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, message, param, code = classify(exc)
    return status, envelope(status, message, param=param, code=code)
