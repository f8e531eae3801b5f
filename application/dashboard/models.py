"""Use case: the model manager — local models, fit estimates before download, downloads with progress,
deletion, and switching the served model (through the engine thread).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from mlx_dspark.application.dashboard.ports import MachineProbe, ModelCatalog, ModelHub
from mlx_dspark.application.generation import GenerationService
from mlx_dspark.application.services import Services
from mlx_dspark.application.settings import Settings
from mlx_dspark.domain import fit
from mlx_dspark.domain.dashboard import RepoFacts
from mlx_dspark.domain.errors import InvalidRequest


@attrs.define
class Download:
    id: str
    repo_id: str
    status: str = "queued"  # queued | running | done | failed
    done: int = 0
    total: int = 0
    error: str = ""
    path: str = ""
    started: float = attrs.Factory(time.time)

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class ModelManager:
    """Local models, hub search, fit estimates and downloads.

    Args:
        catalog: local model folders.
        hub: the model hub (HF_ENDPOINT honoured by the adapter).
        probe: this machine's usable memory.
    """

    def __init__(self, catalog: ModelCatalog, hub: ModelHub, probe: MachineProbe) -> None:
        self.catalog = catalog
        self.hub = hub
        self.probe = probe
        self._downloads: dict[str, Download] = {}
        self._lock = threading.Lock()

    def local(self) -> list[dict[str, Any]]:
        return [attrs.asdict(m) for m in self.catalog.local_models()]

    def delete(self, path: str, *, served: str | None = None) -> None:
        """Delete a local model folder the catalog lists (nothing else), never the served model or its copy.

        Args:
            served: the name of the model the server runs (its files and converted copy are refused).

        Raises:
            InvalidRequest: `path` is not a listed local model, or it is the served model's.
        """
        listed = self.catalog.local_models()
        if path not in {m.path for m in listed} | {m.converted_path for m in listed if m.converted_path}:
            raise InvalidRequest(message="not a local model listed here", param="path")
        for m in listed:
            if m.name == served and path in (m.path, m.converted_path):
                raise InvalidRequest(
                    message=f"{m.name} is the model being served: load another model before deleting it", param="path"
                )
        self.catalog.delete(path)

    def fit(self, repo_id: str, drafter: str | None = None) -> dict[str, Any]:
        """The fit table of a model against this machine's usable memory: a local folder or .gguf file (read
        here, offline) or a hub repo (config + safetensors headers, nothing downloaded)."""
        facts = self._facts(repo_id)
        drafter_bytes = self._facts(drafter).weight_bytes if drafter else 0
        usable = self.probe.usable_memory()
        est = fit.estimate(facts.shape, facts.weight_bytes, int(usable["bytes"]), drafter=drafter_bytes)
        return {
            "repo_id": repo_id,
            "model_type": facts.model_type,
            "shape": attrs.asdict(facts.shape),
            "weights": facts.weight_bytes,
            "active_weights": facts.active_weight_bytes or facts.weight_bytes,
            "download_bytes": sum(facts.files.values()),
            "drafter": drafter or "",
            "usable": usable,
            "rows": [{**attrs.asdict(r), "verdict": r.verdict.value} for r in est.rows],
        }

    def _facts(self, spec: str) -> RepoFacts:
        local = self.catalog.facts(spec)
        return local if local is not None else self.hub.facts(spec)

    def start_download(self, repo_id: str) -> Download:
        """Start downloading a repo in a background thread; returns its state (polled for progress)."""
        if not repo_id or repo_id.count("/") != 1:
            raise InvalidRequest(message="a repo id looks like 'owner/name'", param="repo_id")
        job = Download(id=uuid.uuid4().hex[:12], repo_id=repo_id)
        with self._lock:
            self._downloads[job.id] = job

        def progress(done: int, total: int) -> None:
            job.done, job.total = done, total

        def run() -> None:
            job.status = "running"
            try:
                job.path = self.hub.download(repo_id, progress)
                job.status = "done"
                job.done = max(job.done, job.total)
            except Exception as exc:  # shown to the user, who may try again
                job.status, job.error = "failed", f"{type(exc).__name__}: {exc}"

        threading.Thread(target=run, name=f"download-{job.id}", daemon=True).start()
        return job

    def downloads(self) -> list[dict[str, Any]]:
        with self._lock:
            return [d.as_json() for d in self._downloads.values()]

    def download(self, job_id: str) -> Download | None:
        return self._downloads.get(job_id)


def switch_factory(
    services: Services, settings: Settings, *, model: str, mode: str | None, drafter: str | None
) -> Callable[[GenerationService], GenerationService]:
    """What the engine thread runs to serve another model / mode / drafter (mode None: the served mode)."""
    from mlx_dspark.application.modes import build_generator

    if not model:
        raise InvalidRequest(message="choose a model to load", param="model")

    def build(current: GenerationService) -> GenerationService:
        # No mode chosen: the served one stays (a model's Load button never changes how it is served).
        keep = attrs.evolve(settings.model, model=model, mode=mode or current.mode, drafter=drafter or None)
        same = current.model.name == model
        return build_generator(services, attrs.evolve(settings, model=keep), model=current.model if same else None)

    return build
