"""The composition root: the one place that wires driven adapters to ports.

Tests pass fakes as keyword overrides; production code calls build(settings) with none.
"""

from __future__ import annotations

from typing import Any

import attrs
from mlx_dspark.application.generation import MonotonicClock
from mlx_dspark.application.ports import ModelLoader
from mlx_dspark.application.settings import Settings
from mlx_dspark.domain.ports import Clock, TelemetrySink


@attrs.frozen(kw_only=True)
class Services:
    """Everything use cases need, typed by port so mypy checks each adapter against its Protocol."""

    settings: Settings
    clock: Clock
    telemetry: TelemetrySink
    loader: ModelLoader
    extras: dict[str, Any] = attrs.Factory(dict)


def _default_telemetry() -> TelemetrySink:
    from mlx_dspark.adapters.telemetry.structlog_sink import StructlogTelemetrySink

    return StructlogTelemetrySink()


def _default_loader(settings: Settings) -> ModelLoader:
    from mlx_dspark.adapters.hf.loader import HfModelLoader

    return HfModelLoader(settings.model)


def build(settings: Settings, **overrides: Any) -> Services:
    """Wire the real adapters, replacing any named in `overrides` (clock, telemetry, loader, extras).

    Adapters are imported lazily so that building services never imports MLX until a model is loaded.
    """
    unknown = set(overrides) - {f.name for f in attrs.fields(Services)}
    if unknown:
        raise TypeError(f"unknown overrides: {sorted(unknown)}")
    clock: Clock = overrides.get("clock") or MonotonicClock()
    telemetry: TelemetrySink = overrides.get("telemetry") or _default_telemetry()
    loader: ModelLoader = overrides.get("loader") or _default_loader(settings)
    return Services(settings=settings, clock=clock, telemetry=telemetry, loader=loader, extras=overrides.get("extras", {}))
