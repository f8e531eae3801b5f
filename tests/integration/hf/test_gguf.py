"""GGUF → mlx-lm conversion: tiny llama/qwen2/gemma3 files (F32 and Q8_0/Q4_0) load to the reference logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlx_dspark.adapters.hf import gguf as gguf_conv
from mlx_dspark.adapters.hf.loader import HfModelLoader
from mlx_dspark.adapters.hf.tokenizer import HfTokenizer, collect_eos_ids
from mlx_dspark.application.settings import ModelSettings
from mlx_dspark.domain.errors import ModelUnavailable
from tests.integration.hf import tiny_models as tm

IDS = [5, 200, 17, 42, 99, 256, 7, 263, 120, 3]


def _loader(tmp_path: Path, **kw: object) -> HfModelLoader:
    return HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "cache")), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "q8_q4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_gguf_loads_to_reference_logits(tmp_path: Path, arch: str, quantize: bool) -> None:
    model, weights = tm.build_reference(arch)
    held = tm.write_gguf(arch, weights, tmp_path / f"{arch}.gguf", quantize=quantize)
    expected = tm.logits(tm.load_reference(model, held), IDS)

    ckpt = _loader(tmp_path).load_checkpoint(str(tmp_path / f"{arch}.gguf"))

    assert ckpt.config["model_type"] == tm.model_args(arch)["model_type"]
    np.testing.assert_allclose(tm.logits(ckpt.model, IDS), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kept_quantization_is_exact(tmp_path: Path, arch: str) -> None:
    model, weights = tm.build_reference(arch)
    held = tm.write_gguf(arch, weights, tmp_path / "m.gguf", quantize=True)
    expected = tm.logits(tm.load_reference(model, held), IDS)

    ckpt = _loader(tmp_path, keep_quantized=True).load_checkpoint(str(tmp_path / "m.gguf"))

    assert ckpt.config["quantization"]["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 4}
    assert ckpt.config["quantization"]["model.layers.0.mlp.up_proj"] == {"group_size": 32, "bits": 8}
    np.testing.assert_allclose(tm.logits(ckpt.model, IDS), expected, atol=2e-4, rtol=1e-4)


def test_gguf_tokenizer_round_trips_and_renders_chat(tmp_path: Path) -> None:
    _, weights = tm.build_reference("llama")
    tm.write_gguf("llama", weights, tmp_path / "m.gguf", quantize=False)
    ckpt = _loader(tmp_path).load_checkpoint(str(tmp_path / "m.gguf"))
    tok = HfTokenizer(ckpt.tokenizer, collect_eos_ids(ckpt.tokenizer, ckpt.path))
    vocab = tm.vocabulary()

    for text in ["hello world", "  spaces\tand\nlines ", "naïve 日本 🙂", "x<|im_end|>y"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hello", add_special_tokens=False) == [vocab.index("hello")]
    assert tok.encode("<|im_end|>") == [vocab.index("<|im_end|>")]
    assert vocab.index("<|im_end|>") in tok.eos_ids
    assert tok.vocab_size == len(vocab)
    rendered = tok.render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unknown_gguf_architecture_is_refused(tmp_path: Path) -> None:
    _, weights = tm.build_reference("llama")
    tm.write_gguf("llama", weights, tmp_path / "m.gguf", quantize=False)
    data = (tmp_path / "m.gguf").read_bytes()
    # same length, so every offset stays valid
    (tmp_path / "x.gguf").write_bytes(data.replace(b"llama", b"bamba"))

    with pytest.raises(ModelUnavailable, match="architecture 'bamba' is not supported"):
        _loader(tmp_path).load_checkpoint(str(tmp_path / "x.gguf"))


def test_truncated_gguf_is_reported(tmp_path: Path) -> None:
    _, weights = tm.build_reference("qwen2")
    tm.write_gguf("qwen2", weights, tmp_path / "m.gguf", quantize=True)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])

    with pytest.raises(ModelUnavailable, match="truncated"):
        _loader(tmp_path).load_checkpoint(str(tmp_path / "cut.gguf"))
    (tmp_path / "tiny.gguf").write_bytes(data[:100])
    with pytest.raises(ModelUnavailable, match="truncated"):
        _loader(tmp_path).load_checkpoint(str(tmp_path / "tiny.gguf"))


def test_interrupted_conversion_leaves_no_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, weights = tm.build_reference("llama")
    tm.write_gguf("llama", weights, tmp_path / "m.gguf", quantize=True)
    real_build = gguf_conv.build_tokenizer

    class Crash(RuntimeError):
        pass

    def crashing_build(*args: object, **kwargs: object) -> object:
        tok = real_build(*args, **kwargs)  # type: ignore[arg-type]

        def save_pretrained(_: str) -> None:  # the weights are already on disk when this runs
            raise Crash

        tok.save_pretrained = save_pretrained
        return tok

    monkeypatch.setattr(gguf_conv, "build_tokenizer", crashing_build)
    loader = _loader(tmp_path)
    with pytest.raises(Crash):
        loader.load_checkpoint(str(tmp_path / "m.gguf"))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []

    monkeypatch.undo()
    ckpt = loader.load_checkpoint(str(tmp_path / "m.gguf"))
    assert ckpt.path.parent == tmp_path / "cache" / "gguf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in ckpt.path.iterdir()}
    assert ckpt.identity.startswith(f"{(tmp_path / 'm.gguf').resolve()}@sha256:")
