"""The scheduler's width decision reaches every telemetry face: one structlog info line, a
`batch_speculation` item on the live stream, and the `batch_speculating` / `batch_drafting_rows` metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mlx_dspark.adapters.telemetry.broadcast import BroadcastTelemetrySink
from mlx_dspark.adapters.telemetry.structlog_sink import StructlogTelemetrySink
from mlx_dspark.application.dashboard.metrics import render
from mlx_dspark.domain.events import BatchSpeculation, BatchStepped
from tests.unit.test_telemetry_sink import Lines

OFF = BatchSpeculation(width=8, speculate=False, cap=0, plain_tok_s=60.0, speculative_tok_s=41.5, reason="calibrated")


def samples(text: str, name: str) -> list[tuple[dict[str, Any], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_the_decision_is_one_info_line() -> None:
    log = Lines()
    StructlogTelemetrySink(log).emit("batch", OFF)
    assert log.lines == [
        (
            "info",
            "batch.speculation",
            {"width": 8, "speculate": False, "cap": 0, "plain_tok_s": 60.0, "speculative_tok_s": 41.5,
             "reason": "calibrated"},
        )
    ]


def test_the_live_stream_and_the_metrics_show_the_decision_and_the_drafting_rows() -> None:
    sink = BroadcastTelemetrySink(clock=lambda: 1.0)
    seen: list[dict[str, Any]] = []
    sink.subscribe(seen.append)
    sink.emit("batch", BatchStepped(width=4, prefilling=0, drafting=3))
    sink.emit("batch", OFF)
    sink.emit("batch", BatchStepped(width=8, prefilling=0, drafting=0))
    kinds = [item["type"] for item in seen]
    assert kinds == ["batch", "batch_speculation", "batch"]
    decision = seen[1]
    assert (decision["width"], decision["speculate"], decision["reason"]) == (8, False, "calibrated")
    text = render(sink.snapshot(), model="m", mode="dspark", ready=True, queue_depth=0, memory={}, model_bytes=0)
    assert samples(text, "mlx_dspark_batch_speculating") == [({"width": "8"}, 0.0)]
    assert samples(text, "mlx_dspark_batch_drafting_rows_total") == [({}, 3.0)]
