"""End to end on the real default model: every mode equals mlx-lm's own greedy decoding, token for token.

Also the CLI (`generate --json`, `doctor --json`) and the Python API (`mlx_dspark.load`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.generation import GenerationRequest
from mlx_dspark.application.modes import build_generator
from mlx_dspark.application.settings import load_settings

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer briefly.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List the days of the week, then list them again.",
    "Explain in two sentences what a hash map is.",
    "What is 17 times 23? Show your work.",
    "Translate 'good morning' into Spanish, French and German.",
    "Write a haiku about autumn leaves.",
    "Give three tips for writing clean code.",
    "Repeat after me: red, green, blue, red, green, blue.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Write a SQL query that counts rows in a table named users.",
    "If a train travels 60 km in 45 minutes, what is its speed in km/h?",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> bootstrap.Services:
    settings = load_settings({"cache_dir": str(tmp_path_factory.mktemp("cache"))}, {})
    try:
        return bootstrap.build(settings)
    except Exception as exc:  # pragma: no cover - only without the embedded model
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="module")
def model(services: bootstrap.Services):
    try:
        return services.loader.load_target("default")
    except Exception as exc:
        pytest.skip(f"default model not installed ({exc}); run `mlx-dspark install-default`")


def mlx_lm_greedy(model, prompt_ids: list[int]) -> list[int]:
    """mlx-lm's own greedy loop on the same weights, cut at the first EOS our tokenizer knows."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt_ids), model.handle, max_tokens=MAX_TOKENS, sampler=make_sampler(0.0)):
        tok = int(token)
        if tok in model.tokenizer.eos_ids:
            break
        out.append(tok)
    return out


@pytest.mark.parametrize("mode", ["baseline", "lookup"])
def test_every_mode_equals_mlx_lm_greedy_on_a_dozen_prompts(services, model, mode: str) -> None:
    settings = load_settings({"mode": mode, "max_draft": "4", "cache_dir": str(services.settings.model.cache_dir)}, {})
    gen = build_generator(services, settings, model=model)
    drafted = 0
    for prompt in PROMPTS:
        request = GenerationRequest(prompt=prompt, max_tokens=MAX_TOKENS)
        ids = gen.encode_prompt(request)
        result = gen.generate(request)
        assert list(result.token_ids) == mlx_lm_greedy(model, ids), prompt
        assert result.generated_tokens <= MAX_TOKENS
        drafted += result.drafted
    if mode == "lookup":
        assert drafted > 0, "lookup never proposed anything on a dozen prompts"


def _cli(*args: str) -> dict:
    exe = Path(sys.executable).with_name("mlx-dspark")
    env = {**os.environ, "MLX_DSPARK_LOG_LEVEL": "warning"}
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stderr
    text = done.stdout.strip()
    return json.loads(text if text.startswith("{\n") else text.splitlines()[-1])


def test_cli_generate_json_reports_every_field(tmp_path: Path) -> None:
    out = _cli("generate", "--prompt", PROMPTS[2], "--mode", "lookup", "--max-tokens", "12", "--max-draft", "4",
               "--json", "--cache-dir", str(tmp_path))
    for key in ("text", "token_ids", "finish_reason", "prompt_tokens", "generated_tokens", "rounds",
                "mean_accepted", "tokens_per_second", "mode", "cap"):
        assert key in out, key
    assert out["mode"] == "lookup"
    assert 0 < out["generated_tokens"] <= 12 == len(out["token_ids"]) or out["finish_reason"] == "stop"


def test_cli_doctor_reports_device_blas_and_a_verify_curve(tmp_path: Path) -> None:
    out = _cli("doctor", "--json", "--cache-dir", str(tmp_path))
    assert out["runtime"]["mlx_version"]
    assert out["runtime"]["blas"] in {"native", "openblas-shim", "system-openblas", "reference"}
    assert set(out["verify_relative"]) == {"1", "2", "4", "8", "16"}
    assert out["verify_relative"]["1"] == 1.0


def test_python_api_generates_and_streams(tmp_path: Path) -> None:
    import mlx_dspark

    engine = mlx_dspark.load("default", mode="lookup", max_draft=4, cache_dir=str(tmp_path))
    result = engine.generate(PROMPTS[0], max_tokens=16)
    assert "Paris" in result.text
    streamed = "".join(e.text for e in engine.stream(PROMPTS[0], max_tokens=16) if hasattr(e, "text"))
    assert streamed == result.text
    stopped = engine.generate(PROMPTS[0], max_tokens=16, stop="Paris")
    assert stopped.finish_reason == "stop_sequence" and "Paris" not in stopped.text
