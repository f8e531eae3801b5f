"""Events the decode loop yields; telemetry sinks and API streams consume them. No I/O here."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from mlx_dspark.domain.tokens import FinishReason


@attrs.frozen(kw_only=True)
class TokensCommitted:
    """Tokens the target has accepted as output, in order."""

    tokens: tuple[int, ...]


@attrs.frozen(kw_only=True)
class PrefillProgress:
    """Prompt rows in the target's cache so far, during a long prefill.

    Attributes:
        done: prompt tokens whose rows are cached (reused ones included).
        total: prompt tokens.
        reused: rows served by the prefix cache before the prefill began.
    """

    done: int
    total: int
    reused: int


@attrs.frozen(kw_only=True)
class PrefixReused:
    """Where a request's prompt starts: rows served by the prefix cache before its prefill (one per request).

    Attributes:
        prompt_tokens: the prompt's tokens.
        rows: prompt tokens whose rows were reused (0 = a miss: the whole prompt is prefilled).
        source: "live" (the target still held them), "memory" or "disk" (a saved state), "none" on a miss.
    """

    prompt_tokens: int
    rows: int
    source: str


@attrs.frozen(kw_only=True)
class RoundFinished:
    """One draft → verify → accept round."""

    index: int
    source: str
    cap: int
    drafted: int
    accepted: int
    committed: int
    draft_s: float
    verify_s: float
    depth: int


@attrs.frozen(kw_only=True)
class CapChanged:
    """The draft-cap policy changed its mind."""

    old: int
    new: int
    reason: str


@attrs.frozen(kw_only=True)
class SourceSwitched:
    """Auto mode moved to another draft source ("baseline" = plain decoding)."""

    old: str
    new: str
    reason: str


@attrs.frozen(kw_only=True)
class Usage:
    """Token accounting of one request."""

    prompt_tokens: int
    generated_tokens: int
    cached_prompt_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    mean_accepted: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    source: str = "baseline"  # the draft source that ran ("baseline" = plain decoding)
    source_switches: int = 0  # in-request moves of auto mode from one source to another
    source_rounds: Mapping[str, int] = attrs.field(factory=dict)  # rounds each source ran (auto)

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes from prefill; decode speed counts the rest.
        if self.decode_s <= 0:
            return 0.0
        return max(self.generated_tokens - 1, 0) / self.decode_s


@attrs.frozen(kw_only=True)
class Finished:
    """The request ended."""

    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None


@attrs.frozen(kw_only=True)
class BatchStepped:
    """One tick of the continuous-batching scheduler (emitted on the engine thread, not per request).

    Attributes:
        width: rows that got their next token in this tick's one forward (1: a lone row on the serial
            target; 0: the batch drained and the scheduler went idle).
        prefilling: rows that ran a prompt chunk in this tick.
        drafting: rows of the forward that verified drafts (speculative rows; the rest took plain steps).
    """

    width: int
    prefilling: int
    drafting: int = 0


@attrs.frozen(kw_only=True)
class BatchSpeculation:
    """The scheduler's decision for speculative rows at a batch width (emitted when it changes).

    Attributes:
        width: rows in the batched forward the decision is for.
        speculate: whether rows with an adaptive cap draft at this width (False: plain batched steps).
        cap: the best drafts per row at this width under the calibrated curves (0 = plain).
        plain_tok_s: expected aggregate tok/s of plain batched steps at this width.
        speculative_tok_s: expected aggregate tok/s at `cap` (at the best cap > 0 when not speculating).
        reason: "calibrated" (the cost curves decided), "probe" (one tick drafting to keep measuring
            acceptance) or "uncalibrated" (no curves: rows keep their own cap policies).
    """

    width: int
    speculate: bool
    cap: int
    plain_tok_s: float
    speculative_tok_s: float
    reason: str


DecodeEvent = TokensCommitted | PrefillProgress | RoundFinished | CapChanged | SourceSwitched | Finished
# What telemetry sinks receive: the decode loop's events, plus the use case's and the scheduler's own.
TelemetryEvent = DecodeEvent | PrefixReused | BatchStepped | BatchSpeculation
