"""pytest-benchmark: plain vs lookup decoding on the real default model, in one group so the table shows
each mode's time relative to the other (the ratio measured in the same run).

    .venv/bin/pytest tests/benchmarks/test_default_model_decode.py --benchmark-enable

With benchmarks disabled (the default) each mode runs once and its losslessness is still asserted.
"""

from __future__ import annotations

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.generation import GenerationRequest, GenerationResult
from mlx_dspark.application.modes import build_generator
from mlx_dspark.application.settings import load_settings

pytestmark = [pytest.mark.benchmark_suite, pytest.mark.slow]

# Code, where output repeats identifiers (the case lookup drafts exist for), and a fixed budget.
REQUEST = GenerationRequest(prompt="Write a Python class for a stack with push, pop and peek methods.", max_tokens=96)


@pytest.fixture(scope="module")
def generators(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cache = str(tmp_path_factory.mktemp("cache"))
    settings = load_settings({"cache_dir": cache, "max_draft": "auto"}, {})
    services = bootstrap.build(settings)
    try:
        model = services.loader.load_target("default")
    except Exception as exc:
        pytest.skip(f"default model not installed ({exc})")
    return {mode: build_generator(services, settings, model=model, mode=mode) for mode in ("baseline", "lookup")}


@pytest.fixture(scope="module")
def reference(generators: dict) -> GenerationResult:
    generators["baseline"].model.target.reset(0)
    return generators["baseline"].generate(REQUEST)


@pytest.mark.benchmark(group="default-model-decode", warmup=True)
@pytest.mark.parametrize("mode", ["baseline", "lookup"])
def test_decode(benchmark, generators: dict, reference: GenerationResult, mode: str) -> None:  # type: ignore[no-untyped-def]
    gen = generators[mode]

    def run() -> GenerationResult:
        gen.model.target.reset(0)  # no prefix reuse: every round times a full request
        return gen.generate(REQUEST)

    # Disabled benchmarks (the default) call `run` once.
    result = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    assert result.token_ids == reference.token_ids
    benchmark.extra_info.update(
        mode=result.mode, mean_accepted=result.mean_accepted, decode_tok_s=round(result.tokens_per_second, 2)
    )
