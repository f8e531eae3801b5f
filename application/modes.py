"""Use case: settings → a ready GenerationService (load the target, the mode's source selector and cap policy).

Fixed modes get a cap policy from this machine's measured cost curves (`--max-draft auto`) or a fixed cap;
`--mode auto` races the available draft sources and plain decoding and runs an AutoSelector over them.
Also the one place that decides which modes a command runs (`bench_modes`) and which sources auto races.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlx_dspark.application.auto_mode import measure_and_choose, measured_cap_factory
from mlx_dspark.application.chat_service import ChatService
from mlx_dspark.application.draft_models import DRAFT
from mlx_dspark.application.draft_models import configured as draft_configured
from mlx_dspark.application.draft_models import load_source as load_draft_model_source
from mlx_dspark.application.generation import ChatPrompt, GenerationService
from mlx_dspark.application.ports import LoadedModel, ModelLoader
from mlx_dspark.application.services import Services
from mlx_dspark.application.settings import MODES, Settings
from mlx_dspark.domain.drafting.selection import PLAIN
from mlx_dspark.domain.errors import DomainError, InvalidRequest
from mlx_dspark.domain.ports import DraftSource

SPECULATIVE_KINDS = ("dspark", "dflash", "lookup", DRAFT)
BENCH_MODES = (PLAIN, "lookup", "dflash", "dspark", DRAFT, "auto")


def _chat_prompt(services: Services, settings: Settings) -> ChatPrompt:
    """Chat messages through the family codec, as the server renders them (every face sends the same tokens)."""
    return ChatService(services.families, settings.server).messages_prompt


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


def load_source(
    loader: ModelLoader, settings: Settings, model: LoadedModel, kind: str, *, only_own_kind: bool = False
) -> DraftSource | None:
    """The draft source of one mode ("baseline" → None).

    Args:
        only_own_kind: `--drafter` applies only to a drafter of its own kind; other kinds load their
            packaged drafter (auto mode). Otherwise a drafter of another kind is refused by the loader.
    """
    if kind == PLAIN:
        return None
    if kind == DRAFT:
        return load_draft_model_source(loader, model, settings.model.draft_model)
    spec = settings.model.drafter
    if spec and only_own_kind and kind != "lookup" and loader.drafter_kind(spec) not in (None, kind):
        spec = None
    return loader.load_drafter(kind, spec, model, bits=settings.model.drafter_bits)


def build_generator(
    services: Services,
    settings: Settings,
    *,
    model: LoadedModel | None = None,
    mode: str | None = None,
    progress: Callable[[str], None] | None = None,
    fraction: Callable[[str, float], None] | None = None,
) -> GenerationService:
    """A GenerationService for the configured model and mode.

    Args:
        services: the wired adapters.
        settings: model/mode/drafter/max-draft choices.
        model: an already loaded target (reuse across modes), else loaded from settings.
        mode: overrides settings.model.mode.
        progress: receives one-line progress messages (loading, calibration, the auto race).
        fraction: receives (label, fraction done) of calibration and the auto race, for one progress bar;
            without it those go to `progress` as "label (N%)" lines.

    Raises:
        ModelUnavailable: the model or the mode's drafter cannot be found.
        IncompatibleDrafter: the drafter does not fit the target.
    """
    say = progress or (lambda _msg: None)

    def measured(msg: str, done: float) -> None:
        if fraction is not None:
            fraction(msg, done)
        else:
            say(f"{msg} ({done:.0%})")

    if model is None:
        say(f"loading {settings.model.model}")
        model = services.loader.load_target(settings.model.model)
    mode = mode or settings.model.mode
    cap = parse_max_draft(settings.model.max_draft)
    bits = settings.model.drafter_bits
    if mode == "auto":
        candidates = auto_candidates(services.loader, settings, model, say)
        choice = measure_and_choose(
            services.calibration,
            model,
            candidates,
            services.clock,
            drafter_bits=bits,
            max_draft=cap,
            progress=measured,
        )
        # The race's winner is where each request starts: auto may move a request to another source any round.
        say(f"auto mode starts on {choice.mode}" + (" (measured earlier)" if choice.from_cache else ""))
        return GenerationService(
            model,
            selector=choice.selector,
            clock=services.clock,
            telemetry=services.telemetry,
            prefix_cache=services.prefix_caches(model),
            chat_prompt=_chat_prompt(services, settings),
        )
    source = load_source(services.loader, settings, model, mode)
    if source is not None and cap == 0:
        source = None  # --max-draft 0 is plain decoding, whatever the mode
    factory = measured_cap_factory(
        services.calibration, services.clock, model, mode, source, max_draft=cap, drafter_bits=bits, progress=measured
    )
    return GenerationService(
        model,
        source=source,
        mode=mode,
        clock=services.clock,
        telemetry=services.telemetry,
        cap_policy_factory=factory,
        prefix_cache=services.prefix_caches(model),
            chat_prompt=_chat_prompt(services, settings),
    )


def auto_candidates(
    loader: ModelLoader,
    settings: Settings,
    model: LoadedModel,
    say: Callable[[str], None],
    *,
    kinds: Sequence[str] | None = None,
) -> dict[str, DraftSource | None]:
    """Plain decoding plus every draft source that loads for this target.

    Args:
        kinds: the sources to try (default: every available one, failures reported and skipped); when
            given, a source that fails to load raises.
    """
    candidates: dict[str, DraftSource | None] = {PLAIN: None}
    available = available_sources(loader, settings, model)
    wanted = [k for k in kinds if k != PLAIN] if kinds is not None else [k for k in SPECULATIVE_KINDS if k in available]
    for kind in wanted:
        try:
            source = load_source(loader, settings, model, kind, only_own_kind=True)
        except DomainError as exc:
            if kinds is not None:
                raise
            say(f"{kind} skipped: {exc}")
            continue
        if source is not None:
            candidates[kind] = source
    return candidates


def available_sources(loader: ModelLoader, settings: Settings, model: LoadedModel) -> set[str]:
    """The draft sources that can run on `model` as configured: the loader's, and a draft model when the target
    has one (given with --draft-model, or its default partner)."""
    available = set(loader.available_drafters(model))
    if draft_configured(model.name, settings.model.draft_model):
        available.add(DRAFT)
    return available


def bench_modes(
    loader: ModelLoader, settings: Settings, model: LoadedModel, requested: Sequence[str] | None
) -> tuple[list[str], bool]:
    """The modes `mlx-dspark bench` runs: the requested ones (checked), else plain decoding, every available
    drafter and auto; plain decoding always first, since speedups are against it.

    Returns:
        The modes and whether they were asked for explicitly (then a mode that fails to build is an error).
    """
    if requested:
        modes = list(requested)
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise InvalidRequest(message=f"unknown mode(s) {bad}; choose from {', '.join(MODES)}", param="modes")
    else:
        available = available_sources(loader, settings, model)
        modes = [m for m in BENCH_MODES if m in {PLAIN, "auto"} or m in available]
    if PLAIN not in modes:
        modes.insert(0, PLAIN)
    return modes, bool(requested)


def bench_runners(
    services: Services,
    settings: Settings,
    model: LoadedModel,
    requested: Sequence[str] | None,
    progress: Callable[[str], None],
    fraction: Callable[[str, float], None] | None = None,
) -> dict[str, GenerationService]:
    """One GenerationService per bench mode on one loaded target (a mode that cannot load is skipped,
    unless it was asked for); `progress` and `fraction` as in `build_generator`."""
    modes, explicit = bench_modes(services.loader, settings, model, requested)
    runners: dict[str, GenerationService] = {}
    for mode in modes:
        try:
            runners[mode] = build_generator(
                services, settings, model=model, mode=mode, progress=progress, fraction=fraction
            )
        except DomainError as exc:
            if explicit:
                raise
            progress(f"skipping {mode}: {exc}")
    return runners
