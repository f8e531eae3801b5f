"""Use case: turn settings into a ready GenerationService — load the target, pick the mode's draft source and cap policy.

Fixed modes get a cap policy from this machine's measured cost curves (`--max-draft auto`) or a fixed cap;
`--mode auto` races the available draft sources and plain decoding and runs the measured winner.
"""

from __future__ import annotations

from collections.abc import Callable

from mlx_dspark.application.auto_mode import choose_source, measured_cap_factory
from mlx_dspark.application.bootstrap import Services
from mlx_dspark.application.generation import GenerationService
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.settings import Settings
from mlx_dspark.domain.errors import DomainError, InvalidRequest
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
) -> GenerationService:
    """A GenerationService for the configured model and mode.

    Args:
        services: the wired adapters.
        settings: model/mode/drafter/max-draft choices.
        model: an already loaded target (reuse across modes), else loaded from settings.
        mode: overrides settings.model.mode.
        progress: receives one-line progress messages (loading, calibration, the auto race).

    Raises:
        ModelUnavailable: the model or the mode's drafter cannot be found.
        IncompatibleDrafter: the drafter does not fit the target.
    """
    say = progress or (lambda _msg: None)

    def measured(msg: str, fraction: float) -> None:
        say(f"{msg} ({fraction:.0%})")

    if model is None:
        say(f"loading {settings.model.model}")
        model = services.loader.load_target(settings.model.model)
    mode = mode or settings.model.mode
    cap = parse_max_draft(settings.model.max_draft)
    bits = settings.model.drafter_bits
    if mode == "auto":
        candidates = auto_candidates(services, settings, model, say)
        choice = choose_source(services, model, candidates, drafter_bits=bits, max_draft=cap, progress=measured)
        say(f"auto mode runs {choice.mode}" + (" (measured earlier)" if choice.from_cache else ""))
        return GenerationService(
            model,
            source=choice.source,
            mode=choice.mode,
            clock=services.clock,
            telemetry=services.telemetry,
            cap_policy_factory=choice.cap_policy_factory,
        )
    source = load_source(services, settings, model, mode)
    if source is not None and cap == 0:
        source = None  # --max-draft 0 is plain decoding, whatever the mode
    factory = measured_cap_factory(services, model, mode, source, max_draft=cap, drafter_bits=bits, progress=measured)
    return GenerationService(
        model,
        source=source,
        mode=mode,
        clock=services.clock,
        telemetry=services.telemetry,
        cap_policy_factory=factory,
    )


def auto_candidates(
    services: Services, settings: Settings, model: LoadedModel, say: Callable[[str], None]
) -> dict[str, DraftSource | None]:
    """Plain decoding plus every draft source that loads for this target (failures are reported, not fatal)."""
    candidates: dict[str, DraftSource | None] = {"baseline": None}
    available = set(services.loader.available_drafters(model))
    for kind in SPECULATIVE_KINDS:
        if kind not in available:
            continue
        try:
            source = load_source(services, settings, model, kind)
        except DomainError as exc:
            say(f"{kind} skipped: {exc}")
            continue
        if source is not None:
            candidates[kind] = source
    return candidates
