"""pytest-benchmark: the fast path against mlx-lm in the same process, same model object, same BLAS.

Each group pairs ours with mlx-lm's `generate_step`, so the table shows the ratio measured in one run:
plain decoding (the one decode loop with no draft source), one speculative round (DSpark draft + verify +
commit, the shipped drafter) next to one mlx-lm step, and prefill of a 1k-token prompt.

    .venv/bin/pytest tests/benchmarks/test_fast_path_vs_mlx_lm.py --benchmark-enable

Disabled (the default), every body runs once and still checks its output (ours equals mlx-lm's tokens).
"""

from __future__ import annotations

from typing import Any

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.engine import decode
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.events import TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.fakes.clock import FakeClock

pytestmark = [pytest.mark.benchmark_suite, pytest.mark.slow]

GREEDY = SamplingParams()
DECODE_TOKENS = 32
PREFILL_TOKENS = 1024


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Any:
    bootstrap.runtime().prepare()
    settings = load_settings({"cache_dir": str(tmp_path_factory.mktemp("cache"))}, {})
    services = bootstrap.build(settings)
    try:
        return services.loader.load_target("default"), services
    except Exception as exc:
        pytest.skip(f"default model not installed ({exc})")


def _prompt(model: Any, n: int) -> list[int]:
    from mlx_dspark.application.calibration import realistic_stream

    return realistic_stream(model.tokenizer, model.target.vocab_size, n)[:n]


def _mlx_lm_tokens(model: Any, prompt: list[int], n: int) -> list[int]:
    from mlx_dspark.adapters.mlx.mlx_lm_reference import reference_generate

    return list(reference_generate(model.handle, prompt, max_tokens=n).token_ids)


def _ours_tokens(model: Any, prompt: list[int], n: int) -> list[int]:
    model.target.reset(0)
    out: list[int] = []
    for ev in decode(model.target, prompt, GREEDY, StopRule(max_tokens=n, eos_ids=frozenset()), FakeClock()):
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
    return out


@pytest.mark.benchmark(group="plain-decode")
@pytest.mark.parametrize("impl", ["ours", "mlx-lm"])
def test_plain_decode(benchmark: Any, loaded: Any, impl: str) -> None:
    model, _ = loaded
    prompt = _prompt(model, 64)
    run = _ours_tokens if impl == "ours" else _mlx_lm_tokens
    out = benchmark.pedantic(run, args=(model, prompt, DECODE_TOKENS), rounds=3, warmup_rounds=1)
    assert out == _mlx_lm_tokens(model, prompt, DECODE_TOKENS)


@pytest.mark.benchmark(group="prefill-1k")
@pytest.mark.parametrize("impl", ["ours", "mlx-lm"])
def test_prefill(benchmark: Any, loaded: Any, impl: str) -> None:
    model, _ = loaded
    prompt = _prompt(model, PREFILL_TOKENS)
    run = _ours_tokens if impl == "ours" else _mlx_lm_tokens
    out = benchmark.pedantic(run, args=(model, prompt, 1), rounds=3, warmup_rounds=1)
    assert out == _mlx_lm_tokens(model, prompt, 1)


@pytest.mark.benchmark(group="round")
@pytest.mark.parametrize("impl", ["ours-dspark-round", "mlx-lm-step"])
def test_speculative_round(benchmark: Any, loaded: Any, impl: str) -> None:
    """One DSpark round (draft 7 + verify 8 + commit) next to one mlx-lm decode step at the same depth."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, services = loaded
    prompt = _prompt(model, 128)
    if impl == "mlx-lm-step":
        steps = generate_step(mx.array(prompt), model.handle, max_tokens=10_000)
        next(steps)
        token = benchmark.pedantic(lambda: next(steps)[0], rounds=8, warmup_rounds=2)
        assert 0 <= int(token) < model.target.vocab_size
        return
    source = services.loader.load_drafter("dspark", None, model, bits=None)
    target = model.target
    target.reset(0, capture=True)
    source.begin(prompt)
    first = target.prefill(prompt, GREEDY, 0.5)
    history = [*prompt, first]

    def one_round() -> int:
        ctx = DraftContext(
            anchor=history[-1], position=target.cached_tokens, history=history, features=target.take_features()
        )
        block = source.propose(ctx, source.max_block, GREEDY, [0.5] * source.max_block)
        verdict = target.verify(history[-1], block, GREEDY, [0.5] * (len(block) + 1))
        target.commit(verdict.accepted + 1)
        history.extend([*block.tokens[: verdict.accepted], verdict.next_token])
        return verdict.accepted

    accepted = benchmark.pedantic(one_round, rounds=8, warmup_rounds=2)
    assert 0 <= accepted <= source.max_block
    target.reset(0)
