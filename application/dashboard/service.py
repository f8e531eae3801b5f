"""The dashboard's use cases bundled for the web entrypoint (bootstrap.build_dashboard builds one)."""

from __future__ import annotations

import attrs

from mlx_dspark.application.dashboard.models import ModelManager
from mlx_dspark.application.dashboard.modes import ModeSet
from mlx_dspark.application.dashboard.ports import MachineProbe, TelemetryFeed
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

    def served(self, generator: GenerationService) -> None:
        """The engine's `on_serve` hook (engine thread): measure what the gauge shows of a newly served model,
        so /ui/api/status and /metrics answer without the engine even while a long exclusive job holds it."""
        identity = generator.model.identity
        if identity not in self.model_bytes:
            self.model_bytes[identity] = int(self.probe.model_bytes(generator.model.handle))
