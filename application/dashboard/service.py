"""The dashboard's use cases bundled for the web entrypoint (bootstrap.build_dashboard builds one)."""

from __future__ import annotations

import attrs

from mlx_dspark.application.dashboard.models import ModelManager
from mlx_dspark.application.dashboard.modes import ModeSet
from mlx_dspark.application.dashboard.ports import MachineProbe, TelemetryFeed
from mlx_dspark.application.dashboard.sessions import SessionService


@attrs.define(kw_only=True)
class Dashboard:
    sessions: SessionService
    modes: ModeSet
    models: ModelManager
    probe: MachineProbe
    feed: TelemetryFeed | None
    model_bytes: dict[str, int] = attrs.Factory(dict)  # model identity → weight bytes (measured once)
