"""The dashboard's use cases bundled for the web entrypoint (bootstrap.build_dashboard builds one)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from mlx_dspark.application.dashboard.models import ModelManager
from mlx_dspark.application.dashboard.modes import ModeSet
from mlx_dspark.application.dashboard.ports import MachineProbe, TelemetryFeed
from mlx_dspark.application.dashboard.race import LaneTiming
from mlx_dspark.application.dashboard.sessions import SessionService
from mlx_dspark.application.generation import GenerationService


@attrs.define(kw_only=True)
class Dashboard:
    sessions: SessionService
    modes: ModeSet
    models: ModelManager
    probe: MachineProbe
    feed: TelemetryFeed | None
    model_bytes: dict[str, int] = attrs.Factory(dict)  # model identity → weight bytes (measured once)
    plain_tok_s: dict[str, float] = attrs.Factory(dict)  # model identity → plain decoding alone, latest median
    ceiling_tok_s: dict[str, float] = attrs.Factory(dict)  # model identity → the latest roofline's ceiling

    def served(self, generator: GenerationService) -> None:
        """The engine's `on_serve` hook (engine thread): measure what the gauge shows of a newly served model,
        so /ui/api/status and /metrics answer without the engine even while a long exclusive job holds it."""
        identity = generator.model.identity
        if identity not in self.model_bytes:
            self.model_bytes[identity] = int(self.probe.model_bytes(generator.model.handle))

    def remember_race(self, generator: GenerationService, events: Iterator[Any]) -> Iterator[Any]:
        """A race's events, passed on; plain decoding's solo median is kept for the gauge's scale (`top`)."""
        for event in events:
            if isinstance(event, LaneTiming) and event.mode == "baseline" and event.samples:
                self.plain_tok_s[generator.model.identity] = event.median
            yield event

    def remember_roofline(self, generator: GenerationService, events: Iterator[dict[str, Any]]) -> Iterator[Any]:
        """A roofline's events, passed on; its ceiling and plain decoding's median are kept for the gauge."""
        for event in events:
            if event.get("type") == "result":
                identity = generator.model.identity
                if event.get("ceiling_tok_s"):
                    self.ceiling_tok_s[identity] = float(event["ceiling_tok_s"])
                for lane in event.get("lanes") or ():
                    if lane["mode"] == "baseline" and lane["tok_s"]:
                        self.plain_tok_s[identity] = float(lane["tok_s"])
            yield event
