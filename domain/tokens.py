"""Values that describe one generation: sampling parameters, stop rules and finish reasons."""

from __future__ import annotations

import enum
import math

import attrs

from mlx_dspark.domain.errors import InvalidRequest

GREEDY_EPSILON = 1e-5
MAX_TOP_K = 1_000_000  # above every vocabulary in use; a larger k means the same as off


class FinishReason(enum.StrEnum):
    """Why generation (or a chat turn) ended: one vocabulary from the decode loop to every API dialect.

    A str enum, so `generate --json` and logs show the plain value. The decode loop produces the first
    five; the chat use case turns STOP into TOOL_CALLS when the turn ended with tool calls.
    """

    STOP = "stop"  # an end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    STOP_SEQUENCE = "stop_sequence"  # a caller's stop string matched
    CONTEXT = "context"  # the context window is full
    CANCELLED = "cancelled"
    TOOL_CALLS = "tool_calls"  # the turn ended with tool calls (chat only)


def _check_temperature(_: object, __: attrs.Attribute[float], value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise InvalidRequest(message=f"temperature must be a finite number >= 0, got {value}", param="temperature")


def _check_top_p(_: object, __: attrs.Attribute[float], value: float) -> None:
    if not (0 < value <= 1):
        raise InvalidRequest(message=f"top_p must be in (0, 1], got {value}", param="top_p")


def _check_top_k(_: object, __: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= MAX_TOP_K:
        raise InvalidRequest(message=f"top_k must be between 0 (off) and {MAX_TOP_K}, got {value}", param="top_k")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How the target's distribution is turned into tokens.

    Truncation (top-k, then top-p) is applied identically to the target's p and the drafter's q.
    """

    temperature: float = attrs.field(default=0.0, validator=_check_temperature)
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    top_k: int = attrs.field(default=0, validator=_check_top_k)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def seeded(self) -> bool:
        """Sampled with a seed: the same request must give the same tokens, so nothing it draws may depend on
        wall time (a cap decides how many uniforms a round draws)."""
        return not self.greedy and self.seed is not None


def _check_max_tokens(_: object, __: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise InvalidRequest(message=f"max_tokens must be >= 1, got {value}", param="max_tokens")


@attrs.frozen(kw_only=True)
class StopRule:
    """When generation ends at the token level. Stop strings are matched on text by the application."""

    max_tokens: int = attrs.field(validator=_check_max_tokens)
    eos_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
