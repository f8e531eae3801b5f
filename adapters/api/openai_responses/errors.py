"""Responses error envelopes (OpenAI's `{"error": {…}}`), and `response.failed` errors mid-stream.

Codex recognises `code: "context_length_exceeded"`; Pi recognises the "maximum context length" wording.
"""

from __future__ import annotations

from typing import Any

from mlx_dspark.adapters.api import common
from mlx_dspark.domain.errors import ContextTooLong

envelope = common.openai_envelope


def _context(exc: ContextTooLong) -> tuple[str, str]:
    message = (
        f"Your input exceeds the context window of this model: maximum context length is {exc.limit} tokens, "
        f"the request needs {exc.requested} tokens."
    )
    return message, "input"


def classify(exc: BaseException) -> common.OpenAIError:
    """(status, message, param, code) for an error."""
    return common.openai_classify(
        exc, context=_context, overloaded_code="server_is_overloaded", server_code="server_error"
    )


def from_exception(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, message, param, code = classify(exc)
    return status, envelope(status, message, param=param, code=code)
