"""The GEMM-bound limit of a prefill: the FLOPs a dense causal forward must do, at a measured GEMM rate.

A prompt of n tokens multiplies every token by each decoder layer's weights (2 FLOPs per weight) and, per
attention layer, each query by the keys before it twice (QK^T and PV: 4 FLOPs per query head dimension
per key, n(n+1)/2 query-key pairs). Norms, RoPE, softmax and the LM head's one row are left out: the limit
is what the GEMMs alone would take at the rate the machine's BLAS measured.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class ForwardCost:
    """What a dense forward's FLOPs depend on.

    Attributes:
        weight_params: weights of the decoder layers' linear maps (multiply-adds per token; the embedding
            and LM head excluded).
        attention_width: query heads × head size, summed over the attention layers.
    """

    weight_params: int
    attention_width: int


def prefill_flops(tokens: int, cost: ForwardCost) -> float:
    """FLOPs of the GEMMs in a causal prefill of `tokens` tokens."""
    pairs = tokens * (tokens + 1) / 2
    return 2.0 * cost.weight_params * tokens + 4.0 * cost.attention_width * pairs


def prefill_bound_tok_s(tokens: int, cost: ForwardCost, gemm_flops_per_s: float) -> float:
    """Prompt tokens per second if the prefill ran only its GEMMs at `gemm_flops_per_s`."""
    flops = prefill_flops(tokens, cost)
    return tokens * gemm_flops_per_s / flops if flops > 0 else 0.0
