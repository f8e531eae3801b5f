"""The one canonical log line of an API request: who asked, how the turn ran, and how it ended.

Built up while the request runs (prepared prompt, the generation report, the final usage) and emitted
exactly once: by the driver when the answer is complete, or by the error handler when it is refused.
Never holds a request body or a header value: only counts, timings, names and short error messages; the
caller's own strings (model, path) are cut to a few hundred characters with control characters escaped.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import structlog
from litestar import Request

from mlx_dspark.application.chat_service import ChatItem, Prepared, Report
from mlx_dspark.domain.chat import TurnFinished
from mlx_dspark.domain.errors import clipped

log = structlog.get_logger("mlx_dspark.http")
_STATE_KEY = "request_log"
_MAX_ERROR_CHARS = 200


@attrs.define
class RequestLog:
    dialect: str
    path: str
    request_id: str
    model: str | None = None
    stream: bool | None = None
    started: float = attrs.Factory(time.perf_counter)
    fields: dict[str, Any] = attrs.Factory(dict)
    emitted: bool = False

    @classmethod
    def of(cls, request: Request[Any, Any, Any], dialect: str) -> RequestLog:
        """The request's log record, created on first use and kept in the request's state."""
        record: RequestLog | None = request.state.get(_STATE_KEY)
        if record is None:
            from mlx_dspark.adapters.api.common import new_id

            record = cls(dialect=dialect, path=clipped(request.scope["path"]), request_id=new_id(""))
            request.state[_STATE_KEY] = record
        return record

    @classmethod
    def existing(cls, request: Request[Any, Any, Any]) -> RequestLog | None:
        record: RequestLog | None = request.state.get(_STATE_KEY)
        return record

    def observe(self, item: ChatItem) -> None:
        if isinstance(item, Prepared):
            self.fields["prompt_tokens"] = item.prompt_tokens
            self.fields["max_tokens"] = item.max_tokens
        elif isinstance(item, Report):
            r = item.result
            self.fields.update(
                mode=r.mode,
                source=r.source,
                rounds=r.rounds,
                drafted=r.drafted,
                accepted=r.accepted,
                acceptance=round(r.accepted / r.drafted, 3) if r.drafted else None,
                mean_accepted=round(r.mean_accepted, 3),
                prefill_ms=round(r.prefill_s * 1e3, 2),
                decode_ms=round(r.decode_s * 1e3, 2),
                ttft_ms=round(r.time_to_first_token_s * 1e3, 2),
                decode_tok_s=round(r.tokens_per_second, 2),
                cap_histogram={str(cap): n for cap, n in sorted(r.cap_histogram.items())},
                source_switches=r.source_switches,
                source_rounds=dict(r.source_rounds),
            )
        elif isinstance(item, TurnFinished):
            u = item.usage
            self.fields.update(
                finish_reason=item.reason.value,
                prompt_tokens=u.prompt_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
                completion_tokens=u.completion_tokens,
                reasoning_tokens=u.reasoning_tokens,
            )

    def failed(self, exc: BaseException, status: int) -> None:
        """Record an error: its type always, its message only when it is one of ours (4xx wording)."""
        self.fields["error_type"] = type(exc).__name__
        self.fields["error_status"] = status
        if status < 500:
            self.fields["error"] = clipped(str(exc), _MAX_ERROR_CHARS)

    def emit(self, status: int, *, outcome: str | None = None) -> None:
        """Log the line (once; later calls are ignored)."""
        if self.emitted:
            return
        self.emitted = True
        stated = self.fields.pop("outcome", None)
        outcome = outcome or stated or ("completed" if status < 400 else "rejected" if status < 500 else "failed")
        log.info(
            "request.finished",
            request_id=self.request_id,
            dialect=self.dialect,
            path=self.path,
            model=None if self.model is None else clipped(self.model),  # the caller's, so bounded
            stream=self.stream,
            status=status,
            outcome=outcome,
            duration_ms=round((time.perf_counter() - self.started) * 1e3, 1),
            **self.fields,
        )
