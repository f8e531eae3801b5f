"""A deterministic clock and a telemetry sink that records everything."""

from __future__ import annotations

from mlx_dspark.domain.events import TelemetryEvent


class FakeClock:
    """Advances by `tick` seconds on every reading."""

    def __init__(self, tick: float = 0.001) -> None:
        self.t = 0.0
        self.tick = tick

    def now(self) -> float:
        self.t += self.tick
        return self.t


class RecordingTelemetrySink:
    def __init__(self) -> None:
        self.events: list[tuple[str, TelemetryEvent]] = []

    def emit(self, request_id: str, event: TelemetryEvent) -> None:
        self.events.append((request_id, event))
