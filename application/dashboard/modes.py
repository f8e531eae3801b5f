"""One GenerationService per decoding mode over the engine's loaded model, built on demand on the engine thread.

The chat page's mode selector and the race use these; they share the engine's model (and its KV cache),
so their jobs are exclusive: they run alone on the engine's own service, never in a batching lane.
"""

from __future__ import annotations

import attrs

from mlx_dspark.application.generation import GenerationService
from mlx_dspark.application.services import Services
from mlx_dspark.application.settings import MODES, Settings
from mlx_dspark.domain.errors import InvalidRequest, quoted

SELECTABLE = tuple(m for m in MODES if m != "auto")


class ModeSet:
    """Generators by mode for the model the engine serves (rebuilt when the model changes).

    Args:
        services: the wired adapters (drafter loading, calibration, telemetry).
        settings: the server's settings (drafter choice, max draft).
    """

    def __init__(self, services: Services, settings: Settings) -> None:
        self._services = services
        self._settings = settings
        self._identity: str | None = None
        self._by_mode: dict[str, GenerationService] = {}

    def get(self, served: GenerationService, mode: str | None) -> GenerationService:
        """The generator of `mode` ("" / None / "auto" / the served mode → the served generator).

        Raises:
            InvalidRequest: an unknown mode.
            ModelUnavailable: the mode's drafter cannot be found for this model.
        """
        if not mode or mode in ("auto", "served") or mode == served.mode:
            return served
        if mode not in SELECTABLE:
            raise InvalidRequest(
                message=f"mode must be one of {', '.join(SELECTABLE)}; got {quoted(mode)}", param="mode"
            )
        if self._identity != served.model.identity:
            self._identity, self._by_mode = served.model.identity, {}
        if mode not in self._by_mode:
            from mlx_dspark.application.modes import build_generator

            settings = attrs.evolve(self._settings, model=attrs.evolve(self._settings.model, mode=mode))
            self._by_mode[mode] = build_generator(self._services, settings, model=served.model, mode=mode)
        return self._by_mode[mode]

    def forget(self) -> None:
        self._identity, self._by_mode = None, {}
