"""Per-round, prefill and prefix-reuse debug lines, draft-cap changes, draft-source switches and the batch
scheduler's speculation decisions through structlog.

The canonical line of a request is not written here: the face that owns the request writes it (the HTTP
driver's `request.finished`, with the dialect and status this sink cannot know), so each request logs once.
"""

from __future__ import annotations

from typing import Any

import structlog

from mlx_dspark.domain.events import (
    BatchSpeculation,
    CapChanged,
    PrefillProgress,
    PrefixReused,
    RoundFinished,
    SourceSwitched,
    TelemetryEvent,
)


class StructlogTelemetrySink:
    """Logs rounds at debug (free when filtered), cap-policy and draft-source decisions at info."""

    def __init__(self, logger: Any = None) -> None:
        self._log = logger or structlog.get_logger("mlx_dspark.decode")

    def emit(self, request_id: str, event: TelemetryEvent) -> None:
        if isinstance(event, RoundFinished):
            self._log.debug(
                "round",
                request_id=request_id,
                source=event.source,
                cap=event.cap,
                drafted=event.drafted,
                accepted=event.accepted,
                draft_ms=round(event.draft_s * 1e3, 3),
                verify_ms=round(event.verify_s * 1e3, 3),
            )
        elif isinstance(event, PrefillProgress):
            self._log.debug(
                "prefill.progress", request_id=request_id, done=event.done, total=event.total, reused=event.reused
            )
        elif isinstance(event, PrefixReused):
            self._log.debug(
                "prefix.reused", request_id=request_id, rows=event.rows, source=event.source, prompt=event.prompt_tokens
            )
        elif isinstance(event, BatchSpeculation):
            self._log.info(
                "batch.speculation",
                width=event.width,
                speculate=event.speculate,
                cap=event.cap,
                plain_tok_s=round(event.plain_tok_s, 2),
                speculative_tok_s=round(event.speculative_tok_s, 2),
                reason=event.reason,
            )
        elif isinstance(event, (CapChanged, SourceSwitched)):
            name = "draft_cap.changed" if isinstance(event, CapChanged) else "draft_source.switched"
            self._log.info(name, request_id=request_id, old=event.old, new=event.new, reason=event.reason)
