"""The GEMM-bound prefill limit: 2 FLOPs per weight per token, 4 per query width per causal query-key pair."""

from __future__ import annotations

import pytest

from mlx_dspark.domain.costmodel.prefill import ForwardCost, prefill_bound_tok_s, prefill_flops

# The default model's shape: 106M weights in its 30 decoder layers, 9 query heads of 64 in each.
SMOLLM2 = ForwardCost(weight_params=106_168_320, attention_width=30 * 9 * 64)


def test_flops_count_every_weight_per_token_and_every_causal_pair_twice() -> None:
    assert prefill_flops(1, ForwardCost(weight_params=10, attention_width=3)) == 2 * 10 + 4 * 3 * 1
    assert prefill_flops(4, ForwardCost(weight_params=10, attention_width=3)) == 2 * 10 * 4 + 4 * 3 * (4 + 3 + 2 + 1)
    assert prefill_flops(0, SMOLLM2) == 0.0


def test_the_limit_falls_with_length_as_attention_grows() -> None:
    rates = [prefill_bound_tok_s(n, SMOLLM2, 124e9) for n in (1024, 4096, 8192)]
    assert rates == sorted(rates, reverse=True)
    # 212 MFLOP of weights per token plus ~141 MFLOP of attention at a mean 2k context.
    assert rates[1] == pytest.approx(124e9 / (2 * 106_168_320 + 4 * 17_280 * 4097 / 2))
    assert prefill_bound_tok_s(4096, SMOLLM2, 248e9) == pytest.approx(2 * rates[1])
    assert prefill_bound_tok_s(0, SMOLLM2, 124e9) == 0.0
