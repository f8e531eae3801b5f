"""The drafters shipped for the default model (adapters/hf/drafters_data/default/) load through the
project's loader with no download, and greedy decoding with them equals plain decoding."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.generation import GenerationRequest, GenerationService
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.tokens import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ("Write a Python function that returns the sum of a list.",)


@pytest.fixture(scope="module")
def services_and_model() -> tuple[Any, Any]:
    bootstrap.prepare_runtime()
    services = bootstrap.build(load_settings({}))
    return services, services.loader.load_target("default")


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_shipped_drafter_is_lossless_on_the_default_model(services_and_model: tuple[Any, Any], kind: str) -> None:
    services, model = services_and_model
    assert kind in services.loader.available_drafters(model)
    source = services.loader.load_drafter(kind, None, model, bits=None)
    plain = GenerationService(model, source=None, mode="baseline", clock=services.clock, telemetry=services.telemetry)
    spec = GenerationService(
        model,
        source=source,
        mode=kind,
        clock=services.clock,
        telemetry=services.telemetry,
        cap_policy_factory=lambda: FixedCap(source.max_block),
    )
    accepted = 0
    for prompt in PROMPTS:
        request = GenerationRequest(prompt=prompt, max_tokens=40, sampling=SamplingParams(temperature=0.0))
        model.target.reset(0)
        a = plain.generate(request)
        model.target.reset(0)
        b = spec.generate(request)
        assert b.token_ids == a.token_ids
        accepted += b.accepted
    assert accepted > 0  # the drafter really drafts (and some drafts are accepted)
