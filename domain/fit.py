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
        kv_layers: layers that keep a KV cache (None: all). Recurrent layers (gated DeltaNet, short
            convolutions, Mamba), plain MLP / MoE blocks and layers reading another layer's KV keep none.
        global_kv_heads, global_head_dim: the full-attention layers' own head shape where it differs from
            the sliding layers' (Gemma-4).
        state_layers: layers with a fixed-size recurrent state instead of a KV cache.
        state_bytes: those layers' state for one sequence, whatever the context.
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
    kv_layers: int | None = None
    global_kv_heads: int | None = None
    global_head_dim: int | None = None
    state_layers: int = 0
    state_bytes: int = 0


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """The shape of a Hugging Face `config.json` (text config of multimodal models included).

    Raises:
        ValueError: the config lacks the layer / head counts.
    """
    quant = config.get("quantization") or config.get("quantization_config") or {}
    cfg: Mapping[str, Any] = config.get("text_config") or config
    try:
        pattern = cfg.get("hybrid_override_pattern")  # Nemotron-H may give only its block pattern
        layers = int(cfg.get("num_hidden_layers") or len(pattern or ()) or cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json lacks {exc} (num_hidden_layers, num_attention_heads)") from exc
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 0)) // heads)
    max_context = int(cfg.get("max_position_embeddings") or config.get("max_position_embeddings") or 4096)
    kinds = layer_kinds(cfg, layers)
    window = cfg.get("sliding_window")
    sliding = kinds.count("sliding") if window else 0
    bits = quant.get("bits") if isinstance(quant, Mapping) else None
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "")
    state_layers = kinds.count("recurrent")
    global_heads = cfg.get("num_global_key_value_heads")
    global_dim = cfg.get("global_head_dim")
    return ModelShape(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=max_context,
        sliding_layers=sliding,
        sliding_window=int(window) if window and sliding else None,
        bits=int(bits) if bits else None,
        dtype=dtype,
        kv_layers=kinds.count("full") + kinds.count("sliding"),
        global_kv_heads=int(global_heads) if global_heads else None,
        global_head_dim=int(global_dim) if global_dim else None,
        state_layers=state_layers,
        state_bytes=state_layers * recurrent_state_bytes(cfg),
    )


# Layer-type names of HF configs by what the layer caches.
_KIND_OF_TYPE = {
    "full_attention": "full",
    "attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "recurrent",
    "conv": "recurrent",
    "mamba": "recurrent",
    "moe": "none",
    "mlp": "none",
}
_KIND_OF_CHAR = {"*": "full", "M": "recurrent", "-": "none", "E": "none"}  # Nemotron-H hybrid_override_pattern


def layer_kinds(cfg: Mapping[str, Any], layers: int) -> list[str]:
    """What each layer caches: "full" or "sliding" KV, a "recurrent" state, "shared" (reads an earlier
    layer's KV, Gemma-4's num_kv_shared_layers) or "none" (an MLP or MoE block)."""
    layer_types = cfg.get("layer_types") or cfg.get("layers_block_type")
    pattern_chars = cfg.get("hybrid_override_pattern")
    if isinstance(pattern_chars, str | Sequence) and pattern_chars:
        kinds = [_KIND_OF_CHAR.get(str(c), "none") for c in pattern_chars]
    elif isinstance(layer_types, Sequence) and not isinstance(layer_types, str):
        kinds = [_KIND_OF_TYPE.get(str(t), "full") for t in layer_types]
    elif cfg.get("full_attention_interval") and cfg.get("linear_num_value_heads"):  # Qwen3-Next / Qwen3.5
        interval = int(cfg["full_attention_interval"])
        kinds = ["full" if (i + 1) % interval == 0 else "recurrent" for i in range(layers)]
    elif cfg.get("sliding_window") and cfg.get("sliding_window_pattern"):
        pattern = int(cfg["sliding_window_pattern"])  # every `pattern`-th layer is global
        kinds = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers)]
    elif cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        kinds = ["sliding"] * layers
    else:
        kinds = ["full"] * layers
    kinds = (kinds + ["full"] * layers)[:layers]
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if 0 < shared < layers:
        kinds[layers - shared :] = ["shared"] * shared
    return kinds


def recurrent_state_bytes(cfg: Mapping[str, Any], kv_bytes: float = 2.0) -> int:
    """One recurrent layer's state for one sequence: its convolution window (in the model's dtype) plus,
    for gated DeltaNet and Mamba, the float32 state matrix."""
    hidden = int(cfg.get("hidden_size") or 0)
    if cfg.get("linear_num_value_heads"):  # gated DeltaNet (Qwen3-Next, Qwen3.5)
        hv, hk = (
            int(cfg["linear_num_value_heads"]),
            int(cfg.get("linear_num_key_heads") or cfg["linear_num_value_heads"]),
        )
        dk, dv = int(cfg.get("linear_key_head_dim") or 128), int(cfg.get("linear_value_head_dim") or 128)
        conv = (int(cfg.get("linear_conv_kernel_dim") or 4) - 1) * (2 * hk * dk + hv * dv)
        return int(conv * kv_bytes + hv * dk * dv * 4)
    if cfg.get("mamba_num_heads"):  # Mamba-2 (Nemotron-H)
        heads, dim, n = (
            int(cfg["mamba_num_heads"]),
            int(cfg.get("mamba_head_dim") or 64),
            int(cfg.get("ssm_state_size") or 128),
        )
        conv_dim = heads * dim + 2 * int(cfg.get("n_groups") or 1) * n
        return int((int(cfg.get("conv_kernel") or 4) - 1) * conv_dim * kv_bytes + heads * dim * n * 4)
    if cfg.get("conv_L_cache"):  # LFM2 short convolutions
        return int((int(cfg["conv_L_cache"]) - 1) * hidden * kv_bytes)
    return 0


def weight_bytes(tensors: Mapping[str, tuple[str, Sequence[int]]]) -> int:
    """Bytes of the weights as stored: {name: (safetensors dtype, shape)} (packed quantized ints count as stored)."""
    total = 0.0
    for dtype, shape in tensors.values():
        n = 1
        for d in shape:
            n *= int(d)
        total += n * DTYPE_BYTES.get(dtype.upper(), 4.0)
    return int(total)


# Routed-expert tensors by name (mlx-lm's switch_mlp, HF's experts.N, GGUF's *_exps); shared experts always run.
_EXPERT_MARKERS = (".experts.", ".switch_mlp.", "_exps.")
_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_EXPERT_TOPK_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_top_k")


def active_weight_bytes(tensors: Mapping[str, tuple[str, Sequence[int]]], config: Mapping[str, Any]) -> int:
    """Bytes of weights one token reads: everything but the routed experts, of which top-k of n. 0 for a
    dense model (every weight is read)."""
    cfg: Mapping[str, Any] = config.get("text_config") or config
    n = next((int(cfg[k]) for k in _EXPERT_COUNT_KEYS if cfg.get(k)), 0)
    top_k = next((int(cfg[k]) for k in _EXPERT_TOPK_KEYS if cfg.get(k)), 0)
    if not n or not top_k:
        return 0
    experts = {name: t for name, t in tensors.items() if any(m in name for m in _EXPERT_MARKERS)}
    routed = weight_bytes(experts)
    if not routed:
        return 0
    return int(weight_bytes(tensors) - routed + routed * min(top_k, n) / n)


def kv_cache_bytes(shape: ModelShape, context: int) -> int:
    """K and V of every KV layer for `context` tokens (sliding layers hold at most their window; full
    layers may have their own head shape). Recurrent state is `shape.state_bytes`, apart."""
    per_token_layer = 2 * shape.kv_heads * shape.head_dim * shape.kv_bytes
    per_token_global = (
        2 * (shape.global_kv_heads or shape.kv_heads) * (shape.global_head_dim or shape.head_dim) * shape.kv_bytes
    )
    kv_layers = shape.layers if shape.kv_layers is None else shape.kv_layers
    full_layers = kv_layers - shape.sliding_layers
    sliding_tokens = min(context, shape.sliding_window) if shape.sliding_window else context
    return int(per_token_global * full_layers * context + per_token_layer * shape.sliding_layers * sliding_tokens)


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
    state: int = 0  # recurrent layers' state (constant in the context)


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
        total = weights + kv + shape.state_bytes + drafter + overhead
        rows.append(
            FitRow(
                context=ctx,
                weights=weights,
                kv_cache=kv,
                state=shape.state_bytes,
                drafter=drafter,
                overhead=overhead,
                total=total,
                verdict=verdict(total, usable),
            )
        )
    return FitEstimate(shape=shape, usable=usable, rows=tuple(rows))
