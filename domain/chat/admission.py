"""Admission by size: a proven lower bound on a conversation's prompt tokens, from its bytes alone.

Tokenizing a 50 MB prompt takes minutes and gigabytes; refusing it must take milliseconds. A tokenizer's
tokens each decode to at most `max_token_bytes` UTF-8 bytes, so a text of B bytes needs at least
B / max_token_bytes tokens. Normalizers may shorten the text first (NFKC, accent stripping) by a small
factor; `NORMALIZER_SLACK` covers that. Every message also costs at least one token of the template's
markers. A request whose floor reaches the context window cannot fit and is refused before rendering.
"""

from __future__ import annotations

import json

from mlx_dspark.domain.chat.conversation import Conversation

NORMALIZER_SLACK = 2  # a normalizer shortens a text by at most this factor before the model sees it


def _utf8(text: str) -> int:
    # len(text) is a lower bound on its UTF-8 bytes (one to four per character) and costs nothing.
    return len(text)


def conversation_bytes(conversation: Conversation) -> int:
    """A lower bound on the UTF-8 bytes of every text the template renders (system, messages, calls, tools)."""
    total = _utf8(conversation.system)
    for m in conversation.messages:
        total += _utf8(m.text) + _utf8(m.thinking)
        for call in m.tool_calls:
            total += _utf8(call.name) + _utf8(json.dumps(call.arguments, ensure_ascii=False))
    for tool in conversation.tools:
        total += _utf8(tool.name) + _utf8(tool.description) + _utf8(json.dumps(tool.parameters, ensure_ascii=False))
    return total


def prompt_token_floor(conversation: Conversation, max_token_bytes: int) -> int:
    """Tokens the rendered prompt has at least: its bytes over the longest token's (with the normalizer's
    slack), and one per message. 0 when the tokenizer's longest token is unknown (no bound)."""
    if max_token_bytes <= 0:
        return 0
    by_bytes = conversation_bytes(conversation) // (max_token_bytes * NORMALIZER_SLACK)
    return max(by_bytes, len(conversation.messages))
