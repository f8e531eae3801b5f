"""Drafter checkpoint configs: the published DFlash and DSpark `config.json` schemas, parsed into frozen values.

Handles the schema drift of z-lab DFlash (`block_size` top-level or in `dflash_config`, `rope_theta` or
`rope_parameters`, sliding layers) and the three DSpark packagings (DeepSpec standalone, vLLM speculators,
SpecForge), with DeepSpec's two backbones: Qwen3-style (`Qwen3DSparkModel`) and Gemma-4-style
(`Gemma4DSparkModel`, a copy of the target's Gemma-4 text config). See ../shared/docs/drafters.md §2.2 and §3.2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mlx_dspark.domain.errors import ModelUnavailable

SLIDING = "sliding_attention"
QWEN3 = "qwen3"
GEMMA4 = "gemma4"
# Gemma-4's `hidden_activation` values → the activation the MLP applies to its gate.
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


@attrs.frozen(kw_only=True)
class BackboneConfig:
    """The shared KV-injection transformer (fc + hidden_norm + Qwen3-style layers + norm).

    Attributes:
        hidden_size: drafter width H.
        target_hidden_size: width of each captured target feature (fc reads m × this).
        num_layers: drafter decoder layers.
        num_heads / num_kv_heads / head_dim / intermediate_size / rms_norm_eps: layer shape.
        rope_theta / rope_scaling / max_position_embeddings: RoPE as in the checkpoint (partial rotary
            factors inherited from a target config are deliberately ignored, §3.6).
        target_layer_ids: target decoder layers whose outputs are concatenated, in order.
        num_target_layers: the target depth the drafter was trained for, when declared.
        block_size: block length (anchor + masks).
        mask_token_id: the mask token's id.
        layer_types: per layer "full_attention" or "sliding_attention".
        sliding_window: window of sliding layers (rows, including the query's own).
        sliding_causal: whether sliding layers are causal inside the block.
        attention_bias: q/k/v/o projections carry biases.
        vocab_size: the vocabulary the drafter declares (None when absent).
        layout: the decoder layer. "qwen3": pre-norm residuals, SwiGLU. "gemma4" (`Gemma4DSparkModel`):
            sandwich norms (input/post-attention, pre/post-feedforward) with a per-layer `layer_scalar`,
            an unscaled RMS norm on the values (`v_norm`), attention scale 1, every layer full attention.
        values_from_keys: values reuse the key projection (Gemma-4 `attention_k_eq_v`: no `v_proj`).
        hidden_activation: the MLP's gate activation, "silu" or "gelu_tanh".
        attention_scale: the softmax scale (None: head_dim ** −0.5).
        double_wide_layers: layers whose MLP is twice `intermediate_size` wide (Gemma-4 `use_double_wide_mlp`).
    """

    hidden_size: int
    target_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int | None = None
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    block_size: int
    mask_token_id: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    sliding_causal: bool = True
    attention_bias: bool = False
    vocab_size: int | None = None
    layout: str = QWEN3
    values_from_keys: bool = False
    hidden_activation: str = "silu"
    attention_scale: float | None = None
    double_wide_layers: tuple[int, ...] = ()

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING and self.sliding_window is not None


@attrs.frozen(kw_only=True)
class DFlashConfig:
    """A z-lab DFlash drafter: target embedding in, target LM head out, slots 1..bs−1 are drafts."""

    backbone: BackboneConfig
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    draft_vocab_size: int | None = None  # a reduced head of target rows with a d2t table (this project's)


@attrs.frozen(kw_only=True)
class DSparkConfig:
    """A DSpark drafter: backbone + Markov head + confidence head.

    Attributes:
        packaging: "deepspec" (either backbone layout), "speculators" or "specforge".
        first_draft_slot: 0 when slot k predicts anchor+k+1 (`sample_from_anchor`), 1 when slot 0 is
            reserved and slot k predicts anchor+k (`logits_start=1`).
        markov_rank: rank r of the Markov head (0 = none).
        markov_head_type: only "vanilla" is supported.
        confidence_head / confidence_with_markov: the confidence head and whether it reads w1[x_{k−1}].
        draft_vocab_size: the head's vocabulary (< target vocab with a d2t table).
    """

    backbone: BackboneConfig
    packaging: str
    first_draft_slot: int = 0
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = False
    draft_vocab_size: int | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None


def _first(*sources: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    for src in sources:
        if src and src.get(key) is not None:
            return src[key]
    return default


def _rope(layer: Mapping[str, Any]) -> tuple[float, Mapping[str, Any] | None]:
    params = layer.get("rope_parameters") or {}
    theta = layer.get("rope_theta", params.get("rope_theta"))
    scaling = layer.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling is not None and (scaling.get("rope_type") or scaling.get("type") or "default") == "default":
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def _require(value: Any, what: str, where: str) -> Any:
    if value is None:
        raise ModelUnavailable(message=f"{where}: config.json has no `{what}`")
    return value


def _backbone(
    layer: Mapping[str, Any],
    *,
    block_size: Any,
    mask_token_id: Any,
    target_layer_ids: Any,
    num_target_layers: Any,
    target_hidden_size: Any,
    non_causal: bool,
    where: str,
) -> BackboneConfig:
    hidden = int(_require(layer.get("hidden_size"), "hidden_size", where))
    heads = int(_require(layer.get("num_attention_heads"), "num_attention_heads", where))
    n_layers = int(_require(layer.get("num_hidden_layers"), "num_hidden_layers", where))
    theta, scaling = _rope(layer)
    layer_types = tuple(layer.get("layer_types") or ("full_attention",) * n_layers)
    if len(layer_types) != n_layers:
        raise ModelUnavailable(message=f"{where}: {len(layer_types)} layer_types for {n_layers} layers")
    window = layer.get("sliding_window")
    if any(t == SLIDING for t in layer_types) and not window:
        raise ModelUnavailable(message=f"{where}: sliding_attention layers but no sliding_window")
    return BackboneConfig(
        hidden_size=hidden,
        target_hidden_size=int(target_hidden_size or hidden),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(layer.get("intermediate_size"), "intermediate_size", where)),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=layer.get("max_position_embeddings"),
        target_layer_ids=tuple(int(i) for i in _require(target_layer_ids, "target_layer_ids", where)),
        num_target_layers=int(num_target_layers) if num_target_layers is not None else None,
        block_size=int(_require(block_size, "block_size", where)),
        mask_token_id=int(_require(mask_token_id, "mask_token_id", where)),
        layer_types=layer_types,
        sliding_window=int(window) if window else None,
        sliding_causal=not non_causal,
        attention_bias=bool(layer.get("attention_bias", False)),
        vocab_size=int(layer["vocab_size"]) if layer.get("vocab_size") else None,
    )


def _non_causal(*sources: Mapping[str, Any] | None) -> bool:
    if _first(*sources, key="sliding_window_non_causal", default=False):
        return True
    return _first(*sources, key="is_causal", default=True) is False


def _dflash_layout_backbone(
    raw: Mapping[str, Any], dcfg: Mapping[str, Any], where: str, *, block_size: Any = None
) -> BackboneConfig:
    """The backbone of a config laid out as z-lab's (a `dflash_config` beside the layer keys)."""
    return _backbone(
        raw,
        block_size=_first(raw, dcfg, key="block_size") if block_size is None else block_size,
        mask_token_id=_first(dcfg, raw, key="mask_token_id"),
        target_layer_ids=_first(dcfg, raw, key="target_layer_ids"),
        num_target_layers=_first(raw, dcfg, key="num_target_layers"),
        target_hidden_size=_first(dcfg, raw, key="target_hidden_size"),
        non_causal=_non_causal(dcfg, raw),
        where=where,
    )


def parse_dflash(raw: Mapping[str, Any], where: str = "drafter") -> DFlashConfig:
    """Parse a z-lab DFlash `config.json` (§2.2), any schema revision.

    Raises:
        ModelUnavailable: a required key is missing or the file is a DSpark checkpoint.
    """
    dcfg = raw.get("dflash_config") or {}
    if dcfg.get("projector_type") == "dspark" or "markov_rank" in raw or "speculators_config" in raw:
        raise ModelUnavailable(message=f"{where}: this is a DSpark checkpoint; load it with kind='dspark'")
    backbone = _dflash_layout_backbone(raw, dcfg, where)
    return DFlashConfig(
        backbone=backbone,
        input_embedding_scale=_first(dcfg, raw, key="input_embedding_scale"),
        output_multiplier=_first(dcfg, raw, key="output_multiplier"),
        final_logit_softcapping=_first(dcfg, raw, key="final_logit_softcapping"),
        draft_vocab_size=_first(dcfg, raw, key="draft_vocab_size"),
    )


def dspark_packaging(raw: Mapping[str, Any]) -> str:
    """Which DSpark packaging a `config.json` is: "deepspec", "speculators" or "specforge".

    Raises:
        ModelUnavailable: a speculators Gemma-4 head, a non-DSpark speculators algorithm, or no DSpark marker.
    """
    arch = " ".join(raw.get("architectures") or ())
    spec = raw.get("speculators_config")
    if spec is not None or raw.get("speculators_model_type"):
        algorithm = (spec or {}).get("algorithm") or raw.get("speculators_model_type")
        if algorithm != "dspark":
            raise ModelUnavailable(message=f"speculators checkpoint with algorithm {algorithm!r}, expected 'dspark'")
        layer = raw.get("transformer_layer_config") or {}
        if str(layer.get("model_type", "")).startswith("gemma4"):
            raise ModelUnavailable(
                message="speculators-packaged Gemma-4 DSpark drafters are not supported (no published layout); "
                "Gemma-4 DSpark loads in DeepSpec's Gemma4DSparkModel layout"
            )
        return "speculators"
    if (raw.get("dflash_config") or {}).get("projector_type") == "dspark":
        return "specforge"
    if "Qwen3DSparkModel" in arch or "Gemma4DSparkModel" in arch or "markov_rank" in raw:
        return "deepspec"
    raise ModelUnavailable(message="config.json is not a DSpark checkpoint (no DSpark marker); try kind='dflash'")


def is_gemma4(raw: Mapping[str, Any]) -> bool:
    """Whether a DeepSpec DSpark config is the Gemma-4 backbone (`Gemma4DSparkModel`, a copied Gemma-4 text
    config) rather than the Qwen3-style one."""
    arch = " ".join(raw.get("architectures") or ())
    return "Gemma4DSparkModel" in arch or str(raw.get("model_type", "")).startswith("gemma4")


def _activation(name: str, where: str) -> str:
    if name in GELU_TANH:
        return "gelu_tanh"
    if name in ("gelu", "silu"):
        return name
    raise ModelUnavailable(message=f"{where}: hidden_activation {name!r} is not supported")


def _gemma4_backbone(raw: Mapping[str, Any], where: str) -> BackboneConfig:
    """The backbone of DeepSpec's `Gemma4DSparkModel`, read from its copy of the target's Gemma-4 text config.

    Every drafter layer is the target's global ("full_attention") layer shape: `global_head_dim`-wide heads,
    `num_global_key_value_heads` KV heads when `attention_k_eq_v` (values then reuse the keys' projection),
    the full-attention RoPE of `rope_parameters` (proportional partial RoPE as published), no sliding window.

    Raises:
        ModelUnavailable: a required key is missing, or a part the reference drafter refuses too (MoE
            blocks, per-layer inputs) or that it could not run (a RoPE type other than default/proportional).
    """
    if raw.get("enable_moe_block"):
        raise ModelUnavailable(message=f"{where}: Gemma-4 DSpark drafters with MoE blocks are not supported")
    if int(raw.get("hidden_size_per_layer_input") or 0):
        raise ModelUnavailable(message=f"{where}: Gemma-4 DSpark drafters with per-layer inputs are not supported")
    n_layers = int(_require(raw.get("num_hidden_layers"), "num_hidden_layers", where))
    head_dim = int(_require(raw.get("global_head_dim"), "global_head_dim", where))
    k_eq_v = bool(raw.get("attention_k_eq_v", False))
    kv_key = "num_global_key_value_heads" if k_eq_v else "num_key_value_heads"
    kv_heads = int(_require(raw.get(kv_key), kv_key, where))
    params = _require(raw.get("rope_parameters"), "rope_parameters", where)
    rope = dict(params.get("full_attention") or params)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", "proportional"):
        raise ModelUnavailable(
            message=f"{where}: Gemma-4 DSpark RoPE type {rope_type!r} is not supported (default or proportional)"
        )
    layer = {
        **raw,
        "head_dim": head_dim,
        "num_key_value_heads": kv_heads,
        "layer_types": None,
        "sliding_window": None,
        "rope_parameters": None,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if rope_type != "default" else None,
    }
    backbone = _backbone(
        layer,
        block_size=raw.get("block_size"),
        mask_token_id=raw.get("mask_token_id"),
        target_layer_ids=raw.get("target_layer_ids"),
        num_target_layers=raw.get("num_target_layers"),
        target_hidden_size=raw.get("hidden_size"),
        non_causal=False,
        where=where,
    )
    first_shared = n_layers - int(raw.get("num_kv_shared_layers") or 0)
    double = bool(raw.get("use_double_wide_mlp")) and first_shared > 0
    return attrs.evolve(
        backbone,
        layout=GEMMA4,
        values_from_keys=k_eq_v,
        hidden_activation=_activation(str(raw.get("hidden_activation") or "gelu_pytorch_tanh"), where),
        attention_scale=1.0,
        double_wide_layers=tuple(range(first_shared, n_layers)) if double else (),
    )


def _first_slot(*sources: Mapping[str, Any] | None, default: int) -> int:
    start = _first(*sources, key="logits_start")
    if start is not None:
        return int(start)
    anchor = _first(*sources, key="sample_from_anchor")
    if anchor is not None:
        return 0 if anchor else 1
    return default


def parse_dspark(raw: Mapping[str, Any], where: str = "drafter") -> DSparkConfig:
    """Parse a DSpark `config.json` in any supported packaging (§3.2).

    The slot convention is read from `logits_start` / `sample_from_anchor` when present; otherwise the
    packaging's documented default applies (all three predict from the anchor slot). A Gemma-4 DeepSpec
    checkpoint embeds with the scale sqrt(hidden_size) and caps its logits with `final_logit_softcapping`.

    Raises:
        ModelUnavailable: unsupported variant or a required key is missing.
    """
    packaging = dspark_packaging(raw)
    if packaging == "speculators":
        layer = raw.get("transformer_layer_config") or {}
        extra: Mapping[str, Any] = raw
        backbone = _backbone(
            layer,
            block_size=raw.get("block_size"),
            mask_token_id=raw.get("mask_token_id"),
            target_layer_ids=_first(raw, key="aux_hidden_state_layer_ids") or _first(raw, key="target_layer_ids"),
            num_target_layers=raw.get("num_target_layers"),
            target_hidden_size=raw.get("target_hidden_size"),
            non_causal=_non_causal(raw, layer),
            where=where,
        )
        draft_vocab = raw.get("draft_vocab_size")
        first_slot = _first_slot(raw, default=0)
    elif packaging == "deepspec" and is_gemma4(raw):
        extra = raw
        backbone = _gemma4_backbone(raw, where)
        draft_vocab = raw.get("draft_vocab_size")
        first_slot = _first_slot(raw, default=0)
    else:
        dcfg = raw.get("dflash_config") or {}
        extra = {**raw, **dcfg}
        backbone = _dflash_layout_backbone(raw, dcfg, where, block_size=_first(dcfg, raw, key="block_size"))
        draft_vocab = _first(dcfg, raw, key="draft_vocab_size")
        first_slot = _first_slot(dcfg, raw, default=0)
    head_type = str(extra.get("markov_head_type") or "vanilla").lower()
    rank = int(extra.get("markov_rank") or 0)
    if rank > 0 and head_type != "vanilla":
        raise ModelUnavailable(message=f"{where}: Markov head type {head_type!r} is not supported (only 'vanilla')")
    if first_slot not in (0, 1):
        raise ModelUnavailable(message=f"{where}: logits_start must be 0 or 1, got {first_slot}")
    with_markov = bool(extra.get("confidence_head_with_markov", False))
    if with_markov and rank == 0:
        raise ModelUnavailable(message=f"{where}: confidence_head_with_markov needs markov_rank > 0")
    return DSparkConfig(
        backbone=backbone,
        packaging=packaging,
        first_draft_slot=first_slot,
        markov_rank=rank,
        markov_head_type=head_type,
        confidence_head=bool(extra.get("enable_confidence_head", False)),
        confidence_with_markov=with_markov,
        draft_vocab_size=int(draft_vocab) if draft_vocab else None,
        input_embedding_scale=extra.get("input_embedding_scale")
        if backbone.layout != GEMMA4
        else float(backbone.hidden_size) ** 0.5,
        output_multiplier=extra.get("output_multiplier"),
        final_logit_softcapping=extra.get("final_logit_softcapping"),
    )


def drafter_kind(raw: Mapping[str, Any]) -> str | None:
    """ "dspark" or "dflash" from a drafter's config.json (by its markers, never by its name), or None."""
    try:
        dspark_packaging(raw)
    except ModelUnavailable:
        pass
    else:
        return "dspark"
    arch = " ".join(raw.get("architectures") or ())
    if "DFlash" in arch or "dflash_config" in raw:
        return "dflash"
    return None
