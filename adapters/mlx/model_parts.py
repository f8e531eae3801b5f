"""Accessors over an mlx-lm target model: token embedding (with the family's scale), LM head, sizes.

Drafters bind the target's embedding and head; every family difference (Gemma's sqrt(H) embedding scale,
tied heads, final-logit softcaps, output multipliers, multimodal wrappers) is resolved here, once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx import nn

# Families whose decoder multiplies token embeddings by sqrt(hidden_size) before the first layer.
_SQRT_H_FAMILIES = ("gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma4", "gemma4_text", "recurrent_gemma")
# gemma3_text rounds the scale through bfloat16 (so must we, to feed the drafter the same vector).
_BF16_ROUNDED_SCALE = ("gemma3", "gemma3_text")


def _owner(model: nn.Module) -> nn.Module:
    """The module holding `args`, the decoder and the head (unwraps multimodal `language_model`)."""
    inner = model
    while "language_model" in inner and isinstance(inner["language_model"], nn.Module):
        inner = inner["language_model"]
    return inner


def _decoder(model: nn.Module) -> nn.Module:
    """The decoder that owns the token embedding, `layers` and the final norm (`backbone` in Nemotron-H)."""
    owner = _owner(model)
    for name in ("model", "backbone"):
        if name in owner and isinstance(owner[name], nn.Module):
            return owner[name]
    return owner


def _child(module: nn.Module, names: tuple[str, ...], what: str) -> nn.Module:
    for name in names:
        if name in module and isinstance(module[name], nn.Module):
            return module[name]
    raise TypeError(f"{type(module).__name__} has no {what} (looked for {', '.join(names)})")


def embedding(model: nn.Module) -> nn.Module:
    """The token embedding table (`embed_tokens`; `embeddings` in Nemotron-H)."""
    return _child(_decoder(model), ("embed_tokens", "embeddings"), "token embedding")


def final_norm(model: nn.Module) -> nn.Module:
    """The norm after the last decoder layer (`norm`; `norm_f` in Nemotron-H; LFM2 applies its `embedding_norm`
    there, after the layers, despite the name)."""
    return _child(_decoder(model), ("norm", "norm_f", "embedding_norm"), "final norm")


def model_args(model: nn.Module) -> Any:
    """The text model's argument object (a dataclass in mlx-lm)."""
    owner = _owner(model)
    args = getattr(owner, "args", None)
    if args is None:
        args = getattr(_decoder(model), "args", None)
    if args is None:
        raise TypeError(f"{type(model).__name__} exposes no `args`; not an mlx-lm model")
    return args


def model_type(model: nn.Module) -> str:
    """The HF `model_type` of the text model (e.g. "qwen3", "gemma3_text")."""
    return str(getattr(model_args(model), "model_type", "") or getattr(_owner(model), "model_type", ""))


def hidden_size(model: nn.Module) -> int:
    """Width of the residual stream."""
    return int(model_args(model).hidden_size)


def num_layers(model: nn.Module) -> int:
    """Number of decoder layers (the range of valid target layer ids)."""
    return len(_decoder(model).layers)


def vocab_size(model: nn.Module) -> int:
    """Rows of the LM head output (= rows of the embedding table)."""
    args = model_args(model)
    v = getattr(args, "vocab_size", None)
    if v:
        return int(v)
    return int(embedding(model).weight.shape[0])


def embed_scale(model: nn.Module) -> float:
    """The factor the family applies to token embeddings before the first layer (1.0 for most)."""
    kind = model_type(model)
    args = model_args(model)
    if kind in _SQRT_H_FAMILIES:
        scale = math.sqrt(hidden_size(model))
        if kind in _BF16_ROUNDED_SCALE:
            scale = float(mx.array(scale, dtype=mx.bfloat16).astype(mx.float32).item())
        return scale
    multiplier = getattr(args, "embedding_multiplier", None) or getattr(args, "scale_emb", None)  # granite, minicpm
    return float(multiplier) if multiplier else 1.0


def embed(model: nn.Module, ids: mx.array) -> mx.array:
    """Token embeddings exactly as the target's first layer sees them.

    Args:
        model: the mlx-lm model.
        ids: integer token ids of any shape.

    Returns:
        `ids.shape + (hidden,)` embeddings, scaled as the family does.
    """
    h = embedding(model)(ids)
    scale = embed_scale(model)
    if scale != 1.0:
        h = h * mx.array(scale, dtype=h.dtype)
    return h


def head_projection(model: nn.Module, h: mx.array) -> mx.array:
    """The bare vocabulary projection of final-normed hidden states (tied or untied), no post-processing."""
    owner = _owner(model)
    if "lm_head" in owner and isinstance(owner["lm_head"], nn.Module):
        return owner["lm_head"](h)
    return embedding(model).as_linear(h)


def final_logit_softcap(model: nn.Module) -> float | None:
    """The family's tanh cap on final logits (Gemma 2/4), or None."""
    cap = getattr(model_args(model), "final_logit_softcapping", None)
    return float(cap) if cap else None


def output_scale(model: nn.Module) -> float:
    """The family's multiplier on final logits (Cohere `logit_scale`, Granite `1/logits_scaling`)."""
    args = model_args(model)
    kind = model_type(model)
    if kind.startswith("cohere"):
        return float(getattr(args, "logit_scale", 1.0) or 1.0)
    if kind == "minicpm" and not args.tie_word_embeddings:  # muP: an untied head sees h / (H / base)
        return float(args.dim_model_base) / float(args.hidden_size)
    multiplier = getattr(args, "output_multiplier", None)  # muse_glimmer
    if multiplier:
        return float(multiplier)
    div = getattr(args, "logits_scaling", None)
    return 1.0 / float(div) if div else 1.0


def softcap(logits: mx.array, cap: float | None) -> mx.array:
    """tanh(l / cap) · cap, or the logits unchanged when cap is None."""
    if not cap:
        return logits
    return mx.tanh(logits / cap) * cap


def lm_head(model: nn.Module, h: mx.array) -> mx.array:
    """Logits exactly as the target computes them from final-normed hidden states.

    Args:
        model: the mlx-lm model.
        h: final-normed hidden states `[..., hidden]`.

    Returns:
        `[..., vocab]` logits, with the family's output multiplier and softcap applied.
    """
    out = head_projection(model, h)
    scale = output_scale(model)
    if scale != 1.0:
        out = out * scale
    return softcap(out, final_logit_softcap(model))


def head_rows(model: nn.Module, token_ids: mx.array) -> mx.array:
    """The target head's weight rows [len(token_ids), H] (float32) for `token_ids`, whatever the head's
    layout (tied, untied, quantized): read as head_projection(I), so every layout is read the same way."""
    h = hidden_size(model)
    eye = mx.eye(h, dtype=final_norm(model).weight.dtype)
    full = head_projection(model, eye).astype(mx.float32).T
    return full[token_ids.astype(mx.int32)]


def final_hidden(model: nn.Module, tokens: mx.array, cache: Any) -> mx.array:
    """The decoder's final-normed hidden states `[batch, n, hidden]` for `tokens` (the model's forward without
    its head). `lm_head(model, final_hidden(...))` is the model's own output in every family whose outer
    forward only applies the head; a caller checks that once (`head_subset`'s users do)."""
    return _decoder(model)(tokens, cache=cache)


def head_subset(model: nn.Module, token_ids: mx.array) -> Callable[[mx.array], mx.array] | None:
    """The target's LM head restricted to `token_ids`: logits `[..., len(token_ids)]`, each column the same dot
    product as the full head's column for that id (output multiplier and softcap applied), in the head's own
    storage (a quantized head stays quantized). None for a head layout it does not know.

    A draft model's head over the tokens text actually uses reads a fifth of a 152k-vocabulary head's bytes."""
    owner = _owner(model)
    module = owner["lm_head"] if "lm_head" in owner and isinstance(owner["lm_head"], nn.Module) else embedding(model)
    ids = token_ids.astype(mx.int32)
    project: Callable[[mx.array], mx.array]
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        full_biases = module.get("biases")
        w, s = module.weight[ids], module.scales[ids]
        b = None if full_biases is None else full_biases[ids]
        mx.eval(w, s, *([] if b is None else [b]))  # copies of the rows: the gathers run once, here
        group_size, bits, mode = module.group_size, module.bits, getattr(module, "mode", "affine")

        def project(h: mx.array) -> mx.array:
            return mx.quantized_matmul(h, w, s, b, transpose=True, group_size=group_size, bits=bits, mode=mode)

    elif isinstance(module, (nn.Linear, nn.Embedding)):
        w = module.weight[ids]
        mx.eval(w)

        def project(h: mx.array) -> mx.array:
            return h @ w.T

    else:
        return None
    full_bias = module.get("bias") if isinstance(module, nn.Linear) else None
    bias = None if full_bias is None else full_bias[ids]
    scale, cap = output_scale(model), final_logit_softcap(model)

    def head(h: mx.array) -> mx.array:
        out = project(h)
        if bias is not None:
            out = out + bias
        if scale != 1.0:
            out = out * scale
        return softcap(out, cap)

    return head
