"""The composition root: the one place that wires driven adapters to ports (only entrypoints import it).

It only composes: every function returns wired objects (services, the runtime, the embedded-model
installer, the trainer, the dashboard) and calls nothing on them. Tests pass fakes as keyword overrides;
production code calls build(settings) with none.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs

from mlx_dspark.application.chat_service import ChatService, FamilySelector
from mlx_dspark.application.engine import RowsBackend, RowsFactory
from mlx_dspark.application.generation import MonotonicClock
from mlx_dspark.application.ports import (
    CalibrationStore,
    DrafterTrainer,
    EmbeddedModels,
    LoadedModel,
    ModelLoader,
    PrefixStore,
    ReferenceDecoder,
    Runtime,
)
from mlx_dspark.application.prefix_cache import PrefixCaches
from mlx_dspark.application.services import Server, Services
from mlx_dspark.application.settings import Settings
from mlx_dspark.domain.ports import TargetModel, TelemetrySink

__all__ = [
    "Services",
    "build",
    "build_dashboard",
    "build_trainer",
    "draft_reference_decoder",
    "embedded_models",
    "reference_decoder",
    "runtime",
]

if TYPE_CHECKING:
    from mlx_dspark.application.dashboard.service import Dashboard


def _default_prefix_caches(settings: Settings) -> PrefixCaches:
    """Prefix caches sized from free memory (unless set), spilling to safetensors files when a dir is set."""
    import structlog

    log = structlog.get_logger("mlx_dspark.prefix_cache")

    def default_budget() -> int:
        from mlx_dspark.adapters.mlx.device import default_prefix_cache_bytes

        return default_prefix_cache_bytes()

    def store(identity: str) -> PrefixStore | None:
        root = settings.cache.prefix_cache_dir
        if not root:
            return None
        from mlx_dspark.adapters.mlx.prefix_store import SafetensorsPrefixStore

        return SafetensorsPrefixStore(root, identity, warn=log.warning)

    return PrefixCaches(settings.cache, default_budget=default_budget, store_factory=store, warn=log.warning)


def _default_families() -> FamilySelector:
    from mlx_dspark.adapters.families import select_codec

    return select_codec


def _default_telemetry() -> TelemetrySink:
    from mlx_dspark.adapters.telemetry.structlog_sink import StructlogTelemetrySink

    return StructlogTelemetrySink()


def _default_loader(settings: Settings) -> ModelLoader:
    from mlx_dspark.adapters.hf.loader import HfModelLoader

    if settings.model.distributed:
        from mlx_dspark.adapters.mlx.distributed import DistributedLoader

        return DistributedLoader(
            HfModelLoader(settings.model, lazy=True),  # each rank reads only its shard's weights
            settings.model.distributed,
            settings.model.model,
            rank_timeout=settings.model.rank_timeout,
        )
    return HfModelLoader(settings.model)


def _default_calibration(settings: Settings) -> CalibrationStore:
    from pathlib import Path

    from mlx_dspark.adapters.storage.calibration_store import JsonCalibrationStore

    root = settings.model.cache_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "mlx-dspark"
    )
    return JsonCalibrationStore(os.path.join(root, "calibration.json"), runtime().calibration_environment)


def runtime() -> Runtime:
    """The process runtime (`Runtime` port): entrypoints call `prepare()` before anything loads MLX."""
    from mlx_dspark.adapters.mlx.runtime import MlxRuntime

    return MlxRuntime()


def reference_decoder() -> ReferenceDecoder:
    """What `bench --against mlx-lm` measures ours against: mlx-lm's `generate_step` on the same model object."""
    from mlx_dspark.adapters.mlx.mlx_lm_reference import MlxLmReference

    return MlxLmReference()


def draft_reference_decoder(draft: LoadedModel, num_draft: int) -> ReferenceDecoder:
    """What `bench --against mlx-lm-draft` measures ours against: mlx-lm's `speculative_generate_step` with
    `draft` (checked by `references.load_draft_model`) proposing `num_draft` tokens a round."""
    from mlx_dspark.adapters.mlx.mlx_lm_reference import MlxLmDraftReference

    return MlxLmDraftReference(draft, num_draft)


def follow_rank_zero(services: Services, settings: Settings) -> bool:
    """On a rank other than 0 of `--distributed`: load the target's shard and follow rank 0's calls until it
    stops (the process then ends). False at once on rank 0 and without `--distributed`: run the command."""
    from mlx_dspark.adapters.mlx.distributed import DistributedLoader

    loader = services.loader
    if not isinstance(loader, DistributedLoader) or loader.group.rank() == 0:
        return False
    loader.load_target(settings.model.model)  # serves rank 0, then ends the process
    return True


def distributed_report(model: LoadedModel) -> dict[str, Any] | None:
    """The backend, ranks and measured call round trip of a target sharded with `--distributed`, else None."""
    from mlx_dspark.adapters.mlx.distributed import MirroredTarget

    return model.target.describe() if isinstance(model.target, MirroredTarget) else None


def embedded_models() -> EmbeddedModels:
    """The models shipped as pinned data-only wheels (`install-default`, `--model NAME`)."""
    from mlx_dspark.adapters.hf.default_models import EmbeddedModelWheels

    return EmbeddedModelWheels()


def build(settings: Settings, **overrides: Any) -> Services:
    """Wire the real adapters, replacing any named in `overrides` (clock, telemetry, loader, calibration, families).

    Adapters are imported lazily so that building services never imports MLX until a model is loaded.
    """
    unknown = set(overrides) - {f.name for f in attrs.fields(Services) if f.name != "settings"}
    if unknown:
        raise TypeError(f"unknown overrides: {sorted(unknown)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return Services(
        settings=settings,
        clock=given.get("clock") or MonotonicClock(),
        # Every sink is wrapped so the dashboard can watch decode events live (the wrapped sink still gets all).
        telemetry=_broadcasting(given.get("telemetry") or _default_telemetry()),
        loader=given.get("loader") or _default_loader(settings),
        calibration=given.get("calibration") or _default_calibration(settings),
        families=given.get("families") or _default_families(),
        prefix_caches=given.get("prefix_caches") or _default_prefix_caches(settings),
    )


def _broadcasting(inner: TelemetrySink) -> TelemetrySink:
    from mlx_dspark.adapters.telemetry.broadcast import BroadcastTelemetrySink

    return inner if isinstance(inner, BroadcastTelemetrySink) else BroadcastTelemetrySink(inner)


def build_server(services: Services, settings: Settings | None = None) -> Server:
    """The server face over `services`: one ChatService (the dialects' and the dashboard's chat), the engine
    thread that loads the configured model and mode, the dashboard's use cases and the Responses turn store.
    Nothing runs yet: the app's lifespan starts the engine."""
    from mlx_dspark.adapters.storage.responses import MemoryResponseStore
    from mlx_dspark.application.engine import EngineThread
    from mlx_dspark.application.modes import build_generator
    from mlx_dspark.application.warmup import WarmingServe, wanted

    settings = settings or services.settings
    chat = ChatService(services.families, settings.server)
    dashboard = build_dashboard(services, settings, chat=chat)
    engine = EngineThread(
        lambda: build_generator(services, settings),
        max_queue=settings.server.max_queue,
        max_batch=settings.server.max_batch,
        rows=rows_factory(),
        on_serve=WarmingServe(wanted(settings.server.warmup, runtime().compiles_kernels()), dashboard.served),
    )
    return Server(
        settings=settings,
        services=services,
        engine=engine,
        chat=chat,
        dashboard=dashboard,
        responses=MemoryResponseStore(),
    )


def server_registry(settings: Settings) -> Any:
    """The running servers' files in the cache folder (`serve` registers itself, `top` finds it)."""
    from mlx_dspark.adapters.hf.cache import cache_root
    from mlx_dspark.adapters.storage.server_registry import ServerRegistry

    return ServerRegistry(cache_root(settings.model.cache_dir))


def build_dashboard(
    services: Services, settings: Settings | None = None, *, chat: ChatService | None = None
) -> Dashboard:
    """The web dashboard's use cases over real adapters (SQLite sessions, HF hub and caches, MLX probe).

    `settings.dashboard` says where: the session database (unset: $MLX_DSPARK_SESSION_DB, else
    sessions.sqlite3 in the cache folder), the hub (unset: HF_ENDPOINT, else huggingface.co), the Hugging
    Face cache and LM Studio's folders. The live feed is the services' telemetry when it broadcasts.
    """
    from pathlib import Path

    from mlx_dspark.adapters.hf.cache import cache_root
    from mlx_dspark.adapters.hf.catalog import LocalModelCatalog
    from mlx_dspark.adapters.hf.hub import HfModelHub
    from mlx_dspark.adapters.mlx.memory import MlxMachineProbe
    from mlx_dspark.adapters.storage.sessions import SqliteSessionStore
    from mlx_dspark.adapters.telemetry.broadcast import BroadcastTelemetrySink
    from mlx_dspark.application.dashboard.models import ModelManager
    from mlx_dspark.application.dashboard.modes import ModeSet
    from mlx_dspark.application.dashboard.service import Dashboard
    from mlx_dspark.application.dashboard.sessions import SessionService

    settings = settings or services.settings
    where = settings.dashboard
    root = cache_root(settings.model.cache_dir)
    # The variable is read here too: settings loaded without the environment (tests) still honour it.
    db = where.session_db or os.environ.get("MLX_DSPARK_SESSION_DB") or os.path.join(root, "sessions.sqlite3")
    feed = services.telemetry if isinstance(services.telemetry, BroadcastTelemetrySink) else None
    modes = ModeSet(services, settings)
    machine = MlxMachineProbe()
    hub_cache = Path(where.hub_cache_dir) if where.hub_cache_dir else None
    lm_studio = [Path(d) for d in where.lm_studio_dirs] or None
    manager = ModelManager(
        LocalModelCatalog(project_cache=root, hub_cache=hub_cache, lm_studio=lm_studio),
        HfModelHub(where.hub_endpoint or os.environ.get("HF_ENDPOINT") or None, cache_dir=where.hub_cache_dir),
        machine,
    )
    return Dashboard(
        sessions=SessionService(
            SqliteSessionStore(db), chat or ChatService(services.families, settings.server), modes, feed
        ),
        modes=modes,
        models=manager,
        probe=machine,
        feed=feed,
    )


def rows_factory() -> RowsFactory:
    """The step engine's batched rows of a loaded target (None for targets that have none, or none that verify
    drafts when `speculative`): then requests run one at a time on the target."""

    def factory(target: TargetModel, speculative: bool) -> RowsBackend | None:
        from mlx_dspark.adapters.mlx.rows import mlx_rows

        return mlx_rows(target, speculative)

    return factory


def build_trainer(settings: Settings) -> DrafterTrainer:
    """The drafter-distillation adapter: MLX compute over targets opened by the HF loader (no decode wrapper)."""
    from mlx_dspark.adapters.hf.loader import HfModelLoader
    from mlx_dspark.adapters.mlx.training import MlxDrafterTrainer

    return MlxDrafterTrainer(HfModelLoader(settings.model).load_training_target)
