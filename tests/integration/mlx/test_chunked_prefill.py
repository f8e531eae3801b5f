"""Chunked prefill against one chunk: exact in everything that carries state, rounding-close where BLAS reorders.

What carries state across chunks (KV caches, the gated-DeltaNet recurrence, its causal-conv window) is exact:
with a BLAS that sums every dot product in one order whatever a GEMM's row count (the mlx-cpu wheel's
reference BLAS), a chunked prefill gives the one-chunk features bit for bit, the hybrid included. The optimized
OpenBLAS that `blas.ensure_fast_blas` loads picks its GEMM kernel by the row count (a chunk of 4 rows is
summed in another order than 28), so there the two differ by rounding, which the bound below covers; so does
a sliding window's ring, which once wrapped sums its keys in ring order.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.gated_delta import compute_g, gated_delta_update

from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.tiny_models import CONFIGS, VOCAB, tiny_model

ROOT = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams()
PROMPT = [(7 * i + 3) % VOCAB for i in range(29)]
U = 2.0**-24  # float32 unit roundoff
LAYER = 1  # the captured layer: after qwen3_5's first gated-DeltaNet layer (0) and its first attention layer


@functools.cache
def model(family: str) -> Any:
    return tiny_model(family, seed=1)


def greedy(target: MlxTargetModel, prompt: list[int], n: int) -> list[int]:
    """Prefill, then plain steps through the port (an empty draft block)."""
    out = [target.prefill(prompt, GREEDY, 0.5)]
    while len(out) < n:
        out.append(target.verify(out[-1], DraftBlock(tokens=()), GREEDY, [0.5]).next_token)
        target.commit(1)
    return out


def gamma(n: int) -> float:
    """Higham's gamma_n: a sum of n products, in any order, is within gamma_n * sum(|terms|) of the exact one."""
    return n * U / (1 - n * U)


def recurrence_gain(calls: list[tuple[Any, ...]], eps: float) -> float:
    """max over steps, heads and rows of sum_j |S_t[i, j] q_t[j]| / sqrt(mean_i y_t[i]^2 + eps), y_t = S_t q_t.

    The gated RMSNorm after the recurrence divides each head's output y_t by its rms; where y_t is small by
    cancellation this scales a difference in the state S_t or in q_t up by this much, relative to the norm's
    output. Replayed in float32 from the recorded inputs of `gated_delta_update` (mlx-lm's step rule).
    """
    gain = 0.0
    for q, k, v, a, b, a_log, dt_bias, state in calls:
        g, beta = compute_g(a_log, a, dt_bias), mx.sigmoid(b)
        rep = v.shape[-2] // k.shape[-2]
        q, k = mx.repeat(q, rep, -2), mx.repeat(k, rep, -2)
        s = state if state is not None else mx.zeros((q.shape[0], v.shape[-2], v.shape[-1], k.shape[-1]))
        for t in range(q.shape[1]):
            s = s * g[:, t, :, None, None]
            kt = k[:, t, :, None, :]
            s = s + kt * ((v[:, t] - (s * kt).sum(-1)) * beta[:, t, :, None])[..., None]
            terms = s * q[:, t, :, None, :]
            y = terms.sum(-1)
            ratio = mx.abs(terms).sum(-1) / mx.sqrt(mx.mean(y * y, axis=-1, keepdims=True) + eps)
            gain = max(gain, ratio.max().item())
    return gain


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5"])
def test_chunked_prefill_equals_one_chunk(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Features of a 4-token-chunk prefill are within a first-order rounding bound of one chunk's.

    Only GEMM sums depend on the chunk (the recurrence and the conv window carry exactly: see the tests
    below). Each is a sum of at most K products (K = the widest of hidden size, intermediate size and the
    keys attended), so two summation orders differ by at most 2 gamma_K sum|terms|: a relative 2 gamma_K
    of its outputs' scale. Norms, activations and residual adds pass a relative difference on at gain ~1,
    so N sums in sequence give at most 2 gamma_K N; up to layer 1 there are N = 6 per decoder layer
    (projections in, the two attention sums, the out projection, the MLP's two). A recurrence adds
    2 gamma_K * 2 kappa: its inputs' difference perturbs both factors of each term of y_t = S_t q_t, and the
    gated norm divides y_t by its rms, kappa = `recurrence_gain` (0 without a recurrent layer). So

        max |h_chunked - h_whole| <= 2 gamma_K (N + 2 kappa) max |h|.

    Measured here (OpenBLAS, 2-core x86-64): qwen3_5 differs by 1.3e-4 at max|h| 11.8, kappa 214, against a
    bound of 7.9e-2; llama by 1.2e-5 (bound 2.4e-3); a chunked prefill that dropped the recurrent state or
    the conv window between chunks differs by 9 and 16. With the reference BLAS the difference is 0.
    """
    calls: list[tuple[Any, ...]] = []
    original = qwen3_5.gated_delta_update

    def recording(*args: Any, **kwargs: Any) -> Any:
        q, k, v, a, b, a_log, dt_bias, state = (*args, None)[:8]
        calls.append((q, k, v, a, b, a_log, dt_bias, state))
        return original(*args, **kwargs)

    whole = MlxTargetModel(model(family), capture_layers=(LAYER,), prefill_chunk=512)
    chunked = MlxTargetModel(model(family), capture_layers=(LAYER,), prefill_chunk=4)
    with monkeypatch.context() as patch:
        patch.setattr(qwen3_5, "gated_delta_update", recording)
        first = whole.prefill(PROMPT, GREEDY, 0.5)
    assert first == chunked.prefill(PROMPT, GREEDY, 0.5)
    got, want = chunked.take_features(), whole.take_features()
    assert got is not None and want is not None and got.shape == want.shape == (len(PROMPT), 64)

    config = CONFIGS[family].get("text_config", CONFIGS[family])
    k_max = max(config["hidden_size"], config["intermediate_size"], len(PROMPT))
    kappa = recurrence_gain(calls, config["rms_norm_eps"])
    assert (kappa > 0) == (family == "qwen3_5")
    bound = 2 * gamma(k_max) * (6 * (LAYER + 1) + 2 * kappa) * mx.abs(want).max().item()
    assert mx.abs(got - want).max().item() <= bound
    assert greedy(whole, PROMPT, 20) == greedy(chunked, PROMPT, 20)


EXACT = """
import json, sys
from mlx_dspark.adapters.mlx.blas import ensure_fast_blas
status = ensure_fast_blas()
import mlx.core as mx
if status.name != "reference" or mx.default_device() != mx.cpu:
    print(json.dumps({"skip": f"BLAS {status.name} on {mx.default_device()}"}))
    sys.exit()
from tests.integration.mlx.test_chunked_prefill import LAYER, PROMPT, greedy, model
from mlx_dspark.adapters.mlx.target import MlxTargetModel
out = {}
for family in ("llama", "qwen3", "qwen3_5", "qwen3_moe"):
    whole = MlxTargetModel(model(family), capture_layers=(0, LAYER), prefill_chunk=512)
    tokens = greedy(whole, PROMPT, 12)
    features = whole.take_features()
    for chunk in (1, 3, 4, 7):
        chunked = MlxTargetModel(model(family), capture_layers=(0, LAYER), prefill_chunk=chunk)
        same = greedy(chunked, PROMPT, 12) == tokens
        out[f"{family}/{chunk}"] = same and mx.array_equal(chunked.take_features(), features).item()
print(json.dumps(out))
"""


def test_chunked_prefill_is_bit_exact_where_sums_keep_their_order() -> None:
    """With the reference BLAS chunked prefill (1, 3, 4, 7 tokens a chunk) is bit-identical, tokens and features.

    Not gemma3_text: its sliding-window layers keep keys in a ring, and once the ring wraps attention sums the
    window in ring order, another order than one chunk's (3e-6 apart from row 8 on, with chunks of 1).
    """
    env = {**os.environ, "MLX_DSPARK_BLAS": "none"}
    run = subprocess.run(
        [sys.executable, "-c", EXACT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"no reference BLAS here: {result['skip']}")
    assert result and all(result.values()), result


def test_the_recurrence_and_its_conv_window_carry_exactly_across_chunks() -> None:
    """mlx-lm's gated-delta rule and a depthwise causal conv, run chunk by chunk with their state carried,
    equal one call bit for bit (on the optimized BLAS too: neither sums across rows)."""
    mx.random.seed(3)
    t, hk, hv, d = 29, 2, 4, 16
    q, k = mx.random.normal((1, t, hk, d)), mx.random.normal((1, t, hk, d))
    v, a, b = mx.random.normal((1, t, hv, d)), mx.random.normal((1, t, hv)), mx.random.normal((1, t, hv))
    a_log, dt_bias = mx.random.normal((hv,)), mx.random.normal((hv,))
    y_whole, state_whole = gated_delta_update(q, k, v, a, b, a_log, dt_bias, None)
    channels, width = 96, 4
    conv = nn.Conv1d(channels, channels, kernel_size=width, groups=channels, bias=False)
    x = mx.random.normal((1, t, channels))
    conv_whole = conv(mx.concatenate([mx.zeros((1, width - 1, channels)), x], axis=1))
    for chunk in (1, 3, 4, 7):
        ys, convs, state, window = [], [], None, mx.zeros((1, width - 1, channels))
        for s in range(0, t, chunk):
            part = slice(s, s + chunk)
            y, state = gated_delta_update(
                q[:, part], k[:, part], v[:, part], a[:, part], b[:, part], a_log, dt_bias, state
            )
            ys.append(y)
            padded = mx.concatenate([window, x[:, part]], axis=1)
            window = padded[:, -(width - 1) :]
            convs.append(conv(padded))
        assert mx.array_equal(mx.concatenate(ys, axis=1), y_whole).item(), chunk
        assert mx.array_equal(state, state_whole).item(), chunk
        assert mx.array_equal(mx.concatenate(convs, axis=1), conv_whole).item(), chunk


def test_the_hybrids_greedy_tokens_do_not_depend_on_the_chunk() -> None:
    """Prefix reuse prefills a hybrid's turn in pieces (a saved state, then the rest): over random prompts
    and chunk sizes its greedy tokens equal one chunk's, and the first token's top-two logit gap is far above
    the logits' rounding difference, so the two can part only at a near-tie."""
    m = model("qwen3_5")
    rng = random.Random(5)
    for _ in range(6):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(5, 48))]
        want = greedy(MlxTargetModel(m, prefill_chunk=512), prompt, 16)
        logits = _last_logits(m, prompt, len(prompt))
        top2 = mx.topk(logits, 2)
        gap = abs(top2[1] - top2[0]).item()
        for chunk in (1, 2, 3, 5, 8, 13):
            assert greedy(MlxTargetModel(m, prefill_chunk=chunk), prompt, 16) == want, (prompt, chunk)
            assert mx.abs(_last_logits(m, prompt, chunk) - logits).max().item() < gap / 10, (prompt, chunk)


def _last_logits(m: Any, prompt: list[int], chunk: int) -> mx.array:
    cache = make_prompt_cache(m)
    for s in range(0, len(prompt), chunk):
        out = m(mx.array(prompt[s : s + chunk])[None], cache=cache)
    return out[0, -1]
