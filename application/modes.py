"""Use case: turn settings into a ready Generator — load the target, pick the mode's draft source and cap policy."""

from __future__ import annotations

from collections.abc import Callable

from mlx_dspark.application.bootstrap import Services
from mlx_dspark.application.generation import Generator
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.settings import Settings
from mlx_dspark.domain.costmodel.draft_cap import CapPolicy, FixedCap
from mlx_dspark.domain.errors import InvalidRequest, ModelUnavailable
from mlx_dspark.domain.ports import DraftSource

SPECULATIVE_KINDS = ("dspark", "dflash", "lookup")


def parse_max_draft(value: str | int | None) -> int | None:
    """`--max-draft N|auto`: an int cap, or None for the measured policy."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        n = int(value)
    except ValueError as exc:
        raise InvalidRequest(
            message=f"--max-draft must be an integer or 'auto', got {value!r}", param="max_draft"
        ) from exc
    if n < 0:
        raise InvalidRequest(message="--max-draft must be >= 0", param="max_draft")
    return n


def load_source(services: Services, settings: Settings, model: LoadedModel, kind: str) -> DraftSource | None:
    """The draft source of one mode ("baseline" → None)."""
    if kind == "baseline":
        return None
    return services.loader.load_drafter(kind, settings.model.drafter, model, bits=settings.model.drafter_bits)


def build_generator(
    services: Services,
    settings: Settings,
    *,
    model: LoadedModel | None = None,
    mode: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Generator:
    """A Generator for the configured model and mode.

    Args:
        services: the wired adapters.
        settings: model/mode/drafter/max-draft choices.
        model: an already loaded target (reuse across modes), else loaded from settings.
        mode: overrides settings.model.mode.
        progress: receives one-line progress messages (loading, calibration).

    Raises:
        ModelUnavailable: the model or the mode's drafter cannot be found.
        IncompatibleDrafter: the drafter does not fit the target.
    """
    say = progress or (lambda _msg: None)
    if model is None:
        say(f"loading {settings.model.model}")
        model = services.loader.load_target(settings.model.model)
    mode = mode or settings.model.mode
    cap = parse_max_draft(settings.model.max_draft)
    if mode == "auto":
        return _auto_generator(services, settings, model, cap, say)
    source = load_source(services, settings, model, mode)
    return _generator(services, model, mode, source, cap)


def _generator(
    services: Services, model: LoadedModel, mode: str, source: DraftSource | None, cap: int | None
) -> Generator:
    factory: Callable[[], CapPolicy] | None = None
    if source is not None and cap is not None:
        fixed = min(cap, source.max_block)

        def factory() -> CapPolicy:
            return FixedCap(fixed)

    return Generator(
        model,
        source=source,
        mode=mode,
        clock=services.clock,
        telemetry=services.telemetry,
        cap_policy_factory=factory,
    )


def _auto_generator(
    services: Services, settings: Settings, model: LoadedModel, cap: int | None, say: Callable[[str], None]
) -> Generator:
    """Interim auto rule until the measured race is wired: the strongest available drafter, else lookup."""
    available = list(services.loader.available_drafters(model))
    for kind in SPECULATIVE_KINDS:
        if kind in available:
            try:
                source = load_source(services, settings, model, kind)
            except ModelUnavailable as exc:
                say(f"{kind} unavailable: {exc}")
                continue
            return _generator(services, model, kind, source, cap)
    return _generator(services, model, "baseline", None, cap)

