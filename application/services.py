"""The wired ports every use case may ask for, by type; `bootstrap.build` fills them (tests pass fakes).

Use cases import this type, never the composition root; most take only the ports they use.
"""

from __future__ import annotations

import attrs

from mlx_dspark.application.chat_service import FamilySelector
from mlx_dspark.application.ports import CalibrationStore, ModelLoader
from mlx_dspark.application.prefix_cache import PrefixCaches
from mlx_dspark.application.settings import Settings
from mlx_dspark.domain.ports import Clock, TelemetrySink


@attrs.frozen(kw_only=True)
class Services:
    """Everything use cases need, typed by port so mypy checks each adapter against its Protocol."""

    settings: Settings
    clock: Clock
    telemetry: TelemetrySink
    loader: ModelLoader
    calibration: CalibrationStore
    families: FamilySelector
    prefix_caches: PrefixCaches
