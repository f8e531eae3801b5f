"""The wired ports every use case may ask for, by type; `bootstrap.build` fills them (tests pass fakes). And the
server face's objects (`Server`), which `bootstrap.build_server` composes over them.

Use cases import these types, never the composition root; most take only the ports they use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from mlx_dspark.application.chat_service import ChatService, FamilySelector
from mlx_dspark.application.ports import CalibrationStore, ModelLoader, ResponseStore
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


if TYPE_CHECKING:  # both import the generation use case, which imports this module's neighbours
    from mlx_dspark.application.dashboard.service import Dashboard
    from mlx_dspark.application.engine import EngineThread


@attrs.frozen(kw_only=True)
class Server:
    """The server face, composed once: the engine thread, the one chat use case every dialect and the app's chat
    call, the dashboard's use cases (sessions over the same chat use case), the Responses turn store."""

    settings: Settings
    services: Services
    engine: EngineThread
    chat: ChatService
    dashboard: Dashboard
    responses: ResponseStore
