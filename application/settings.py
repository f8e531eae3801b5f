"""The one frozen settings tree, built from CLI flags and MLX_DSPARK_* environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import cattrs

from mlx_dspark.domain.errors import InvalidRequest

MODES = ("auto", "baseline", "lookup", "dflash", "dspark", "draft")
ENV_PREFIX = "MLX_DSPARK_"


def _check_threshold(_: object, __: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None and not 0.0 <= value < 1.0:
        raise InvalidRequest(
            message=f"confidence_threshold must be in [0, 1); got {value}", param="confidence_threshold"
        )


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise InvalidRequest(message=f"{attribute.name} must be >= 0, got {value}", param=attribute.name)


def _check_mode(_: object, __: attrs.Attribute[str], value: str) -> None:
    if value not in MODES:
        raise InvalidRequest(message=f"mode must be one of {', '.join(MODES)}; got {value!r}", param="mode")


@attrs.frozen(kw_only=True)
class ModelSettings:
    model: str = "default"
    mode: str = attrs.field(default="auto", validator=_check_mode)
    drafter: str | None = None
    draft_model: str | None = None  # --mode draft (and bench --against mlx-lm-draft): NAME|DIR
    drafter_bits: int | None = None  # None = whichever is measured faster on this device
    max_draft: str = "auto"  # an integer or "auto"
    # Where a block stops early: DSpark's survival product, a draft model's probability of its draft. None: each
    # source's default (DSpark never stops early; a draft model stops below DEFAULT_STOP, measured to pay).
    confidence_threshold: float | None = attrs.field(default=None, validator=_check_threshold)
    # A draft model drafts from this many of its most used tokens only (its head reads those rows); None or 0: all.
    draft_vocab: int | None = attrs.field(default=None, validator=attrs.validators.optional(_non_negative))
    trust_remote_code: bool = False
    cache_dir: str | None = None  # where converted models and calibration live
    # Shard the target over the ranks `mlx.launch` started, with this mx.distributed backend (ring, jaccl, mpi,
    # nccl, any); rank 0 serves, the others follow its calls. None: one process.
    distributed: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(("ring", "jaccl", "mpi", "nccl", "any")))
    )
    # With `distributed`: the most rank 0 waits for the other ranks in one call before it gives the group up as
    # lost (a hung rank); <= 0 waits forever.
    rank_timeout: float = 60.0


@attrs.frozen(kw_only=True)
class DecodeSettings:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise InvalidRequest(message=f"{attribute.name} must be > 0, got {value}", param=attribute.name)


# The largest body an agent honestly sends: a full 128k-token conversation is ~0.5 MB of text, ~1-2 MB as JSON with
# escaped tool results (Claude Code's first request is 50-85 KB). Four times that; larger bodies are refused (413)
# before they are read, so no request can hold the event loop or the engine with parsing.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


WARMUP_MODES = ("auto", "on", "off")


def _warmup_mode(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in WARMUP_MODES:
        raise InvalidRequest(
            message=f"{attribute.name} must be one of {', '.join(WARMUP_MODES)}, got {value!r}", param=attribute.name
        )


@attrs.frozen(kw_only=True)
class ServerSettings:
    """The server's address, auth and limits.

    Attributes:
        api_key: required on every route but /health and a bare HEAD / when set; never shown in a repr or a log.
        cors_origins: browser origins allowed to call the API (besides the server's own pages).
        allowed_hosts: extra `Host` names to accept (e.g. behind a proxy); IP literals and localhost always pass.
        keepalive_s: seconds of engine silence before a stream sends a keep-alive event.
        max_body_bytes: the largest request body accepted (413 above it).
        max_queue: requests waiting for the engine beyond the running one (429/529 above it).
        warmup: run the mode's rounds once at every cap before the first request: "auto" where the device
            compiles kernels on first use (a GPU), "on", or "off".
    """

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = attrs.field(default=None, repr=False)
    context_window: int | None = None
    max_tokens_cap: int | None = None
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    keepalive_s: float = attrs.field(default=5.0, validator=_positive)
    max_body_bytes: int = attrs.field(default=DEFAULT_MAX_BODY_BYTES, validator=_positive)
    max_queue: int = attrs.field(default=16, validator=_positive)
    max_batch: int = attrs.field(default=8, validator=_positive)  # 1 = one request at a time
    warmup: str = attrs.field(default="auto", validator=_warmup_mode)


def parse_bytes(value: str | int | None) -> int | None:
    """A size: bytes, 512M / 2G / 1.5GiB, or auto / None (the caller's default).

    Raises:
        ValueError: not a size, or negative.
    """
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    text = value.strip().lower().removesuffix("ib").removesuffix("b")
    if text in ("", "auto"):
        return None
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        n = float(number)
    except ValueError as exc:
        raise ValueError(f"not a size: {value!r} (use bytes, 512M, 2G or auto)") from exc
    if n < 0:
        raise ValueError(f"a size cannot be negative: {value!r}")
    return int(n * scale)


def _check_size(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    try:
        parse_bytes(value)
    except ValueError as exc:
        raise InvalidRequest(message=f"{attribute.name}: {exc}", param=attribute.name) from exc


@attrs.frozen(kw_only=True)
class CacheSettings:
    """The prefix cache: on in every mode; `0` bytes keeps only the target's live cache."""

    prefix_cache_bytes: str = attrs.field(default="auto", validator=_check_size)  # auto = 1/4 of free memory
    prefix_cache_dir: str | None = None  # spill cold entries here and reload them after a restart


@attrs.frozen(kw_only=True)
class TelemetrySettings:
    log_level: str = "info"
    json_logs: bool | None = None  # None = JSON unless stderr is a terminal


@attrs.frozen(kw_only=True)
class DashboardSettings:
    """Where the web dashboard keeps and finds things (each unset one has a default that follows the tools).

    Attributes:
        session_db: the chat sessions' SQLite file (default: sessions.sqlite3 in the cache folder).
        hub_endpoint: the model hub's base URL (default: HF_ENDPOINT, else huggingface.co).
        hub_cache_dir: the Hugging Face cache to list and download into (default: huggingface-hub's own).
        lm_studio_dirs: LM Studio models folders (default: LMSTUDIO_MODELS_DIR and LM Studio's own places).
    """

    session_db: str | None = None
    hub_endpoint: str | None = None
    hub_cache_dir: str | None = None
    lm_studio_dirs: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class Settings:
    model: ModelSettings = ModelSettings()
    decode: DecodeSettings = DecodeSettings()
    server: ServerSettings = ServerSettings()
    cache: CacheSettings = CacheSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    dashboard: DashboardSettings = DashboardSettings()


_converter = cattrs.Converter()
_converter.register_structure_hook(
    bool, lambda v, _: v if isinstance(v, bool) else str(v).strip().lower() in {"1", "true", "yes", "on"}
)
_converter.register_structure_hook_func(
    lambda t: t == tuple[str, ...],
    lambda v, _: tuple(x for x in v.split(",") if x) if isinstance(v, str) else tuple(str(x) for x in v),
)

_SECTIONS = {
    "model": ModelSettings,
    "decode": DecodeSettings,
    "server": ServerSettings,
    "cache": CacheSettings,
    "telemetry": TelemetrySettings,
    "dashboard": DashboardSettings,
}


def field_sections() -> dict[str, str]:
    """Every settings field name mapped to its section (field names are unique across sections)."""
    out: dict[str, str] = {}
    for section, cls in _SECTIONS.items():
        for f in attrs.fields(cls):
            out[f.name] = section
    return out


def load_settings(flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Build settings: defaults, then MLX_DSPARK_<FIELD> variables, then explicit flags (None = unset).

    Raises:
        InvalidRequest: a value has the wrong type or is out of range.
    """
    env = os.environ if environ is None else environ
    sections = field_sections()
    raw: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for name, section in sections.items():
        value = env.get(ENV_PREFIX + name.upper())
        if value not in (None, ""):
            raw[section][name] = value
    for name, value in (flags or {}).items():
        if value is None or name not in sections:
            continue
        raw[sections[name]][name] = value
    try:
        return _converter.structure(raw, Settings)
    except InvalidRequest:
        raise
    except cattrs.BaseValidationError as exc:
        details = "; ".join(cattrs.transform_error(exc))
        raise InvalidRequest(message=f"invalid settings: {details}") from exc
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(message=f"invalid settings: {exc}") from exc
