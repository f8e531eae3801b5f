"""OpenAI error envelopes: `{"error": {"message", "type", "param", "code"}}` with the matching status.

Context overflow says "maximum context length is N tokens" with code `context_length_exceeded`, the forms
Codex and Pi recognise.
"""

from __future__ import annotations

from typing import Any

from mlx_dspark.adapters.api import common
from mlx_dspark.domain.errors import ContextTooLong

envelope = common.openai_envelope


def context_message(exc: ContextTooLong) -> str:
    return (
        f"This model's maximum context length is {exc.limit} tokens. However, your messages resulted in "
        f"{exc.requested} tokens. Please reduce the length of the messages (context_length_exceeded)."
    )


def from_exception(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and body for an error raised while handling a request."""
    status, message, param, code = common.openai_classify(
        exc, context=lambda e: (context_message(e), "messages"), overloaded_code="server_overloaded", server_code=None
    )
    return status, envelope(status, message, param=param, code=code)
