"""Context-window errors with the numbers each client's exact wording needs."""

from __future__ import annotations

import attrs

from mlx_dspark.domain.errors import ContextTooLong


@attrs.define(auto_exc=True, kw_only=True)
class PromptTooLong(ContextTooLong):
    """The prompt alone does not fit (`requested` = prompt tokens, `limit` = context window)."""


@attrs.define(auto_exc=True, kw_only=True)
class OutputTooLong(ContextTooLong):
    """The prompt fits but prompt + max_tokens does not (`requested` = their sum)."""

    prompt_tokens: int
    max_tokens: int
