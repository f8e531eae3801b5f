"""Will a model fit? Pure arithmetic over a model's shape, its weight bytes and the machine's usable memory.

Readers of configs and safetensors headers live in adapters/hf; this module only counts bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

GIB = 1 << 30
MIB = 1 << 20
CONTEXTS = (4096, 8192, 32768)
# Runtime overhead beyond weights and KV: the framework, the tokenizer, activations of one verify forward.
RUNTIME_BASE_BYTES = 512 * MIB
RUNTIME_WEIGHT_FRACTION = 0.05
GREEN_FRACTION = 0.8  # at most this share of usable memory is a comfortable fit

DTYPE_BYTES = {
    "F64": 8.0, "I64": 8.0, "U64": 8.0,
    "F32": 4.0, "I32": 4.0, "U32": 4.0,
    "F16": 2.0, "BF16": 2.0, "I16": 2.0, "U16": 2.0,
    "F8_E4M3": 1.0, "F8_E5M2": 1.0, "I8": 1.0, "U8": 1.0, "BOOL": 1.0,
}  # fmt: skip


class Verdict(enum.Enum):
    GREEN = "green"  # fits with room to spare
    YELLOW = "yellow"  # fits, but tightly
    RED = "red"  # does not fit


@attrs.frozen(kw_only=True)
class ModelShape:
    """What the KV cache size depends on.

    Attributes:
        layers: decoder layers.
        kv_heads: key/value heads per layer.
        head_dim: size of one head.
        max_context: the model's maximum context length.
        sliding_layers: layers whose cache is bounded by `sliding_window`.
        sliding_window: the window of those layers (tokens), or None.
        kv_bytes: bytes of one cached element (2 for fp16/bf16 caches).
        bits: the weights' quantization bits when quantized, else None.
        dtype: the weights' dominant dtype.
    """

    layers: int
    kv_heads: int
    head_dim: int
    max_context: int
    sliding_layers: int = 0
    sliding_window: int | None = None
    kv_bytes: float = 2.0
    bits: int | None = None
    dtype: str = ""


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """The shape of a Hugging Face `config.json` (text config of multimodal models included).

    Raises:
        ValueError: the config lacks the layer / head counts.
    """
    quant = config.get("quantization") or config.get("quantization_config") or {}
    cfg: Mapping[str, Any] = config.get("text_config") or config
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json lacks {exc} (num_hidden_layers, num_attention_heads)") from exc
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // heads)
    max_context = int(cfg.get("max_position_embeddings") or config.get("max_position_embeddings") or 4096)
    window = cfg.get("sliding_window")
    sliding = 0
    if window:
        layer_types = cfg.get("layer_types")
        pattern = cfg.get("sliding_window_pattern")
        if isinstance(layer_types, Sequence) and not isinstance(layer_types, str):
            sliding = sum(1 for t in layer_types if t == "sliding_attention")
        elif pattern:
            sliding = layers - layers // int(pattern)  # every `pattern`-th layer is global
        elif cfg.get("use_sliding_window", True):
            sliding = layers
    bits = quant.get("bits") if isinstance(quant, Mapping) else None
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "")
    return ModelShape(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=max_context,
        sliding_layers=sliding,
        sliding_window=int(window) if window and sliding else None,
        bits=int(bits) if bits else None,
        dtype=dtype,
    )


def weight_bytes(tensors: Mapping[str, tuple[str, Sequence[int]]]) -> int:
    """Bytes of the weights as stored: {name: (safetensors dtype, shape)} (packed quantized ints count as stored)."""
    total = 0.0
    for dtype, shape in tensors.values():
        n = 1
        for d in shape:
            n *= int(d)
        total += n * DTYPE_BYTES.get(dtype.upper(), 4.0)
    return int(total)


def kv_cache_bytes(shape: ModelShape, context: int) -> int:
    """K and V of every layer for `context` tokens (sliding layers hold at most their window)."""
    per_token_layer = 2 * shape.kv_heads * shape.head_dim * shape.kv_bytes
    full_layers = shape.layers - shape.sliding_layers
    sliding_tokens = min(context, shape.sliding_window) if shape.sliding_window else context
    return int(per_token_layer * (full_layers * context + shape.sliding_layers * sliding_tokens))


def runtime_overhead(weights: int) -> int:
    return int(RUNTIME_BASE_BYTES + RUNTIME_WEIGHT_FRACTION * weights)


def verdict(total: int, usable: int) -> Verdict:
    if total <= GREEN_FRACTION * usable:
        return Verdict.GREEN
    if total <= usable:
        return Verdict.YELLOW
    return Verdict.RED


@attrs.frozen(kw_only=True)
class FitRow:
    context: int
    weights: int
    kv_cache: int
    drafter: int
    overhead: int
    total: int
    verdict: Verdict


@attrs.frozen(kw_only=True)
class FitEstimate:
    shape: ModelShape
    usable: int
    rows: tuple[FitRow, ...]


def estimate(
    shape: ModelShape, weights: int, usable: int, *, drafter: int = 0, contexts: Sequence[int] = CONTEXTS
) -> FitEstimate:
    """One row per context length (4k, 8k, 32k up to the model's maximum, then the maximum itself)."""
    lengths = sorted({c for c in contexts if c < shape.max_context} | {shape.max_context})
    overhead = runtime_overhead(weights)
    rows = []
    for ctx in lengths:
        kv = kv_cache_bytes(shape, ctx)
        total = weights + kv + drafter + overhead
        rows.append(
            FitRow(
                context=ctx,
                weights=weights,
                kv_cache=kv,
                drafter=drafter,
                overhead=overhead,
                total=total,
                verdict=verdict(total, usable),
            )
        )
    return FitEstimate(shape=shape, usable=usable, rows=tuple(rows))
