"""A telemetry sink that fans decode events out to live subscribers (the dashboard's SSE stream).

It forwards every event to an inner sink (the structlog lines), keeps a bounded ring of recent events
for late subscribers, per-request summaries, and running totals for /metrics. Published kinds: request,
cache (the prefix reused and where from), prefill (progress of a long prompt; `first_token` once the
prompt is in), round, cap, switch (auto moved the request to another source), batch (the scheduler's
width, published when it changes) and finished (with the source that ran last, the switches and the
rounds per source).
Thread-safe: the engine thread emits, HTTP handlers subscribe and read from the event loop.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from mlx_dspark.domain.events import (
    BatchSpeculation,
    BatchStepped,
    CapChanged,
    Finished,
    PrefillProgress,
    PrefixReused,
    RoundFinished,
    SourceSwitched,
    TelemetryEvent,
    TokensCommitted,
)
from mlx_dspark.domain.ports import TelemetrySink

Listener = Callable[[dict[str, Any]], None]
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds to the first token
LATENCY_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)  # seconds a request took
ROUND_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16)  # tokens one round committed (1 = a plain step's)
_RATE_WINDOW_S = 3.0
_STALE_S = 60.0  # a request closed without Finished (client went away) stops counting as active


class Histogram:
    """Counts of observations per upper bound, with their sum (Prometheus' cumulative form on export)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.count = 0
        self.sum = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break

    def as_json(self) -> dict[str, Any]:
        cumulative, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            cumulative.append([bound, running])
        return {"buckets": cumulative, "count": self.count, "sum": self.sum}


class BroadcastTelemetrySink:
    """Forwards to `inner` and publishes JSON-ready dicts to subscribers.

    Args:
        inner: the sink that logs (or records, in tests); None = publish only.
        history: how many recent events a new subscriber is replayed.
        clock: wall-clock-free monotonic seconds (for rates and prefill timing).
    """

    def __init__(
        self, inner: TelemetrySink | None = None, *, history: int = 2000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._inner = inner
        self._clock = clock
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._recent: deque[dict[str, Any]] = deque(maxlen=history)
        self._active: dict[str, dict[str, Any]] = {}
        self._summaries: deque[dict[str, Any]] = deque(maxlen=200)
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens) of recent commits
        self._seq = 0
        self.totals: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.accepted_by_length: Counter[int] = Counter()
        self.cache_sources: Counter[str] = Counter()  # requests by where their reused prefix came from
        self.batch_widths: Counter[int] = Counter()  # batched ticks by width
        self._batch = (0, 0)  # the scheduler's last (width, prefilling)
        self.batch_speculation: dict[str, Any] = {}  # the scheduler's latest width decision
        self.widest = 0
        self.histograms = {
            "ttft_seconds": Histogram(TTFT_BUCKETS),
            "request_seconds": Histogram(LATENCY_BUCKETS),
            "tokens_per_round": Histogram(ROUND_BUCKETS),
        }

    # ---- TelemetrySink ----------------------------------------------------------------------------------

    def emit(self, request_id: str, event: TelemetryEvent) -> None:
        if self._inner is not None:
            self._inner.emit(request_id, event)
        now = self._clock()
        out: list[dict[str, Any]] = []
        with self._lock:
            self._prune(now)
            if isinstance(event, BatchStepped):
                self._batch_step(event, out)
            elif isinstance(event, BatchSpeculation):
                self._batch_speculation(event, out)
            else:
                self._request_event(request_id, event, now, out)
            for item in out:
                self._seq += 1
                item["seq"] = self._seq
                item["t"] = now
                self._recent.append(item)
            listeners = list(self._listeners)
        for item in out:
            for listener in listeners:
                listener(item)

    def _batch_speculation(self, event: BatchSpeculation, out: list[dict[str, Any]]) -> None:
        self.totals["batch_speculation_changes"] += 1
        self.batch_speculation = {"width": event.width, "speculate": event.speculate, "cap": event.cap}
        out.append(
            {
                "type": "batch_speculation",
                "width": event.width,
                "speculate": event.speculate,
                "cap": event.cap,
                "plain_tok_s": event.plain_tok_s,
                "speculative_tok_s": event.speculative_tok_s,
                "reason": event.reason,
            }
        )

    def _batch_step(self, event: BatchStepped, out: list[dict[str, Any]]) -> None:
        if event.width:
            self.totals["batch_steps"] += 1
            self.totals["batch_rows"] += event.width
            self.totals["batch_drafting_rows"] += event.drafting
            self.batch_widths[event.width] += 1
            self.widest = max(self.widest, event.width)
        now = (event.width, event.prefilling)
        if now != self._batch:  # one step per token would flood the stream; its changes draw the same line
            self._batch = now
            out.append(
                {"type": "batch", "width": event.width, "prefilling": event.prefilling, "active": len(self._active)}
            )

    def _request_event(self, request_id: str, event: TelemetryEvent, now: float, out: list[dict[str, Any]]) -> None:
        state = self._active.get(request_id)
        if state is None:
            state = self._active[request_id] = {"started": now, "prefill_done": None, "tokens": 0, "total": 0}
            out.append({"type": "request", "request_id": request_id, "active": len(self._active)})
        state["last"] = now
        if isinstance(event, PrefixReused):
            source = event.source if event.rows else "none"
            state.update(total=event.prompt_tokens, reused=event.rows, cache_source=source)
            self.cache_sources[source] += 1
            out.append(
                {
                    "type": "cache",
                    "request_id": request_id,
                    "prompt_tokens": event.prompt_tokens,
                    "cached": event.rows,
                    "prefill": event.prompt_tokens - event.rows,
                    "source": source,
                }
            )
        elif isinstance(event, PrefillProgress):
            state.update(total=event.total, reused=event.reused)
            out.append(
                {
                    "type": "prefill",
                    "request_id": request_id,
                    "done": event.done,
                    "total": event.total,
                    "reused": event.reused,
                    "first_token": False,
                }
            )
        elif isinstance(event, TokensCommitted):
            n = len(event.tokens)
            state["tokens"] += n
            self.totals["tokens_committed"] += n
            self._window.append((now, n))
            if state["prefill_done"] is None:
                # The decode loop's first event after the prefill: the prompt is in the cache.
                # (Its duration arrives with `finished`.)
                state["prefill_done"] = now
                self.histograms["ttft_seconds"].add(now - state["started"])
                total = state["total"]
                out.append(
                    {
                        "type": "prefill",
                        "request_id": request_id,
                        "done": total,
                        "total": total,
                        "reused": state.get("reused", 0),
                        "first_token": True,
                    }
                )
        elif isinstance(event, RoundFinished):
            self.histograms["tokens_per_round"].add(event.committed)
            self.totals["rounds"] += 1
            self.totals["drafted"] += event.drafted
            self.totals["accepted"] += event.accepted
            if event.drafted:
                self.accepted_by_length[event.accepted] += 1
            out.append(
                {
                    "type": "round",
                    "request_id": request_id,
                    "index": event.index,
                    "source": event.source,
                    "cap": event.cap,
                    "drafted": event.drafted,
                    "accepted": event.accepted,
                    # per draft position: 1 = accepted, 0 = rejected (positions past the first rejection not tried)
                    "positions": [1] * event.accepted + ([0] if event.accepted < event.drafted else []),
                    "committed": event.committed,
                    "draft_s": event.draft_s,
                    "verify_s": event.verify_s,
                    "depth": event.depth,
                    "tok_s": event.committed / max(event.draft_s + event.verify_s, 1e-9),
                    "batch": self._batch[0] or 1,  # rows in this round's forward (1 = not batched)
                    "active": len(self._active),
                }
            )
        elif isinstance(event, CapChanged):
            self.totals["cap_changes"] += 1
            out.append(
                {
                    "type": "cap",
                    "request_id": request_id,
                    "old": event.old,
                    "new": event.new,
                    "reason": event.reason,
                }
            )
        elif isinstance(event, SourceSwitched):
            self.totals["source_switches"] += 1
            out.append(
                {
                    "type": "switch",
                    "request_id": request_id,
                    "old": event.old,
                    "new": event.new,
                    "reason": event.reason,
                }
            )
        elif isinstance(event, Finished):
            self._active.pop(request_id, None)
            self.histograms["request_seconds"].add(now - state["started"])
            out.append(self._finish(request_id, event, state.get("cache_source", "none")))

    def _prune(self, now: float) -> None:
        for rid in [r for r, st in self._active.items() if now - st.get("last", st["started"]) > _STALE_S]:
            del self._active[rid]

    def _finish(self, request_id: str, event: Finished, cache_source: str) -> dict[str, Any]:
        u = event.usage
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += u.prompt_tokens
        self.totals["cached_prompt_tokens"] += u.cached_prompt_tokens
        self.totals["generated_tokens"] += u.generated_tokens
        self.totals["cache_hits" if u.cached_prompt_tokens else "cache_misses"] += 1
        self.totals["prefill_ms"] += int(u.prefill_s * 1e3)
        self.totals["decode_ms"] += int(u.decode_s * 1e3)
        self.finish_reasons[event.reason.value] += 1
        summary = {
            "type": "finished",
            "request_id": request_id,
            "finish_reason": event.reason.value,
            "prompt_tokens": u.prompt_tokens,
            "cached_prompt_tokens": u.cached_prompt_tokens,
            "cache_source": cache_source if u.cached_prompt_tokens else "none",
            "generated_tokens": u.generated_tokens,
            "rounds": u.rounds,
            "drafted": u.drafted,
            "accepted": u.accepted,
            "mean_accepted": u.mean_accepted,
            "prefill_s": u.prefill_s,
            "decode_s": u.decode_s,
            "tok_s": u.decode_tokens_per_second,
            "source": u.source,
            "source_switches": u.source_switches,
            "source_rounds": dict(u.source_rounds),
        }
        self._summaries.append(summary)
        return summary

    # ---- TelemetryFeed ----------------------------------------------------------------------------------

    def subscribe(self, listener: Listener, *, replay: int = 0, after: int | None = None) -> Callable[[], None]:
        """Call `listener` with every new event (from the emitting thread); returns the unsubscribe function.

        Recent events are delivered first, in order: those numbered past `after` (a reconnecting client's
        last seen `seq`), else the last `replay` ones.
        """
        with self._lock:
            if after is not None:
                backlog = [e for e in self._recent if e["seq"] > after]
            else:
                backlog = list(self._recent)[-replay:] if replay else []
            self._listeners.append(listener)
        for item in backlog:
            listener(item)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def summary(self, request_id: str) -> dict[str, Any] | None:
        """The finished summary of a recent request, or None."""
        with self._lock:
            for s in reversed(self._summaries):
                if s["request_id"] == request_id:
                    return dict(s)
        return None

    def snapshot(self) -> dict[str, Any]:
        """Totals, the live rate and the last request, for /metrics and the header gauge."""
        now = self._clock()
        with self._lock:
            self._prune(now)
            while self._window and now - self._window[0][0] > _RATE_WINDOW_S:
                self._window.popleft()
            live = 0.0
            if self._active and self._window:
                span = max(now - self._window[0][0], 1e-3)
                live = sum(n for _, n in self._window) / span
            last = dict(self._summaries[-1]) if self._summaries else None
            return {
                "totals": dict(self.totals),
                "finish_reasons": dict(self.finish_reasons),
                "accepted_by_length": {str(k): v for k, v in sorted(self.accepted_by_length.items())},
                "cache_sources": dict(self.cache_sources),
                "batch_widths": {str(k): v for k, v in sorted(self.batch_widths.items())},
                "batch_width": self._batch[0],
                "batch_widest": self.widest,
                "batch_speculation": dict(self.batch_speculation),
                "active_requests": len(self._active),
                "histograms": {name: h.as_json() for name, h in self.histograms.items()},
                "live_tok_s": live,
                "last": last,
            }
