"""The prefix cache on the embedded real models: snapshot points measured on the default model's own
template survive later turns; Gemma 3 270M (sliding-window layers) resumes a second turn from a snapshot
with output equal to a cold run; `generate --prefix-cache-dir` resumes across processes."""

from __future__ import annotations

import pytest

from mlx_dspark.adapters.hf import default_models
from mlx_dspark.application import bootstrap
from mlx_dspark.application.generation import GenerationRequest
from mlx_dspark.application.modes import build_generator
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.ports import RollbackKind
from tests.unit.test_chat_snapshot_points import check_points_survive

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> bootstrap.Services:
    settings = load_settings({"cache_dir": str(tmp_path_factory.mktemp("cache")), "mode": "baseline"}, {})
    return bootstrap.build(settings)


def load(services: bootstrap.Services, name: str):
    if default_models.missing_requirements([name]):
        pytest.skip(f"{name} is not installed (mlx-dspark install-default{' --gemma' if name != 'default' else ''})")
    return services.loader.load_target(name)


def test_points_measured_on_the_default_template_survive_later_turns(services):
    model = load(services, "default")
    check_points_survive(None, tokenizer=model.tokenizer, family=model.family)


def test_gemma3_resumes_a_second_turn_from_a_snapshot_past_its_window(services):
    """Gemma 3 270M (a base model: no chat template) with turn ends given as token positions."""
    model = load(services, "gemma3-270m")
    assert model.target.rollback_kind is RollbackKind.SNAPSHOT  # sliding-window layers
    settings = load_settings({"cache_dir": services.settings.model.cache_dir, "mode": "baseline"}, {})
    gen = build_generator(services, settings, model=model)
    tok = model.tokenizer
    system = tok.encode(" ".join(f"Rule {i}: keep every answer short and plain." for i in range(60)))
    user1 = tok.encode(" Question: name three primary colours.", add_special_tokens=False)
    marker = tok.encode(" Answer:", add_special_tokens=False)
    assert len(system) > 600  # past the 512-token window: the cache can no longer be cut back

    def run(prompt, boundaries=(), cache=True):
        if not cache:
            gen.model.target.reset(0)
        request = GenerationRequest(prompt=prompt, max_tokens=8, boundaries=tuple(boundaries), prefix_cache=cache)
        return gen.generate(request)

    turn1 = run([*system, *user1, *marker], boundaries=[len(system), len(system) + len(user1)])
    run(tok.encode("Title:"))  # a side request in between
    tail = tok.encode(" Red, blue. Question: and three more?", add_special_tokens=False)
    prompt2 = [*system, *user1, *tail, *marker]  # turn 1's answer re-rendered differently
    warm = run(prompt2)
    assert warm.cached_prompt_tokens == len(system) + len(user1)
    cold = run(prompt2, cache=False)
    assert cold.cached_prompt_tokens == 0
    assert warm.token_ids == cold.token_ids
    assert turn1.generated_tokens > 0


def test_generate_resumes_from_the_spill_directory_of_a_previous_run(tmp_path):
    """`generate --prefix-cache-dir` twice: the second process starts from the first one's prompt."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if default_models.missing_requirements(["default"]):
        pytest.skip("default model not installed")
    exe = Path(sys.executable).with_name("mlx-dspark")
    env = {**os.environ, "MLX_DSPARK_LOG_LEVEL": "warning"}
    prompt = "Name the planets of the solar system."
    args = [str(exe), "generate", "--prompt", prompt, "--mode", "baseline", "--max-tokens", "4", "--json",
            "--cache-dir", str(tmp_path / "c"), "--prefix-cache-dir", str(tmp_path / "p")]
    runs = []
    for _ in range(2):
        done = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, check=False)
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0]["cached_prompt_tokens"] == 0
    assert runs[1]["cached_prompt_tokens"] == runs[1]["prompt_tokens"] - 1
    assert runs[1]["token_ids"] == runs[0]["token_ids"]
