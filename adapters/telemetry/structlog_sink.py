"""Per-round debug lines and one canonical info line per request, through structlog."""

from __future__ import annotations

from collections import Counter
from typing import Any

import structlog

from mlx_dspark.domain.events import CapChanged, DecodeEvent, Finished, RoundFinished, SourceSwitched


class StructlogTelemetrySink:
    """Logs rounds at debug (free when filtered) and a canonical `request.finished` line at info."""

    def __init__(self, logger: Any = None) -> None:
        self._log = logger or structlog.get_logger("mlx_dspark.decode")
        self._caps: dict[str, Counter[int]] = {}

    def emit(self, request_id: str, event: DecodeEvent) -> None:
        if isinstance(event, RoundFinished):
            self._caps.setdefault(request_id, Counter())[event.cap] += 1
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
        elif isinstance(event, CapChanged):
            self._log.info(
                "draft_cap.changed", request_id=request_id, old=event.old, new=event.new, reason=event.reason
            )
        elif isinstance(event, SourceSwitched):
            self._log.info(
                "draft_source.switched", request_id=request_id, old=event.old, new=event.new, reason=event.reason
            )
        elif isinstance(event, Finished):
            u = event.usage
            caps = self._caps.pop(request_id, Counter())
            self._log.info(
                "request.finished",
                request_id=request_id,
                finish_reason=event.reason.value,
                source=u.source,
                prompt_tokens=u.prompt_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
                generated_tokens=u.generated_tokens,
                prefill_s=round(u.prefill_s, 4),
                decode_tok_s=round(u.decode_tokens_per_second, 2),
                rounds=u.rounds,
                mean_accepted=round(u.mean_accepted, 3),
                acceptance=round(u.accepted / u.drafted, 3) if u.drafted else None,
                cap_histogram=dict(sorted(caps.items())),
            )
