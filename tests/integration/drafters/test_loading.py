"""Loading drafters in every published format; strict tensor names; refusing drafters that do not fit the
target; model_parts over each target family; quantization on load (and a reported CPU microbenchmark).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.drafters import (
    DFlashDraftSource,
    DSparkDraftSource,
    default_bits,
    load_drafter,
    parse_dflash,
    parse_dspark,
)
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.errors import IncompatibleDrafter, ModelUnavailable
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes import tiny_models
from tests.integration.drafters import helpers


def edit(path: Path, change: Any) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def retensor(path: Path, change: Any) -> Path:
    tensors = dict(mx.load(str(path / "model.safetensors")))
    change(tensors)
    mx.save_safetensors(str(path / "model.safetensors"), tensors)
    return path


class RecordingTarget:
    def __init__(self) -> None:
        self.captured: list[int] | None = None

    def add_capture(self, layer_ids: list[int]) -> None:
        self.captured = layer_ids

    def feature_columns(self, layer_ids: list[int]) -> None:
        return None


def test_dflash_schema_revisions_parse_to_the_same_backbone(tmp_path: Path) -> None:
    v1 = json.loads((helpers.write_dflash(tmp_path / "a", variant="v1") / "config.json").read_text())
    v2 = json.loads((helpers.write_dflash(tmp_path / "b", variant="v2") / "config.json").read_text())
    assert "block_size" in v1 and "block_size" in v2["dflash_config"]
    assert parse_dflash(v1).backbone == parse_dflash(v2).backbone
    sliding_path = helpers.write_dflash(tmp_path / "c", variant="sliding")
    sliding = parse_dflash(json.loads((sliding_path / "config.json").read_text()))
    assert sliding.backbone.is_sliding(0) and not sliding.backbone.is_sliding(1)
    assert sliding.backbone.sliding_causal
    v2["dflash_config"].update(input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=30.0)
    v2["dflash_config"]["target_layer_ids"] = [0, 1, 2, 3, 4, 5, 5, 5]  # 8 target layers
    parsed = parse_dflash(v2)
    assert (parsed.input_embedding_scale, parsed.output_multiplier, parsed.final_logit_softcapping) == (2.0, 0.5, 30.0)
    assert len(parsed.backbone.target_layer_ids) == 8


def test_every_format_loads_and_configures_capture(tmp_path: Path, qwen3_target: Any) -> None:
    cases = [
        ("dflash", helpers.write_dflash(tmp_path / "v1", variant="v1"), DFlashDraftSource, 5),
        ("dflash", helpers.write_dflash(tmp_path / "v2", variant="v2", layer_ids=(0, 2, 4)), DFlashDraftSource, 5),
        ("dflash", helpers.write_dflash(tmp_path / "sl", variant="sliding"), DFlashDraftSource, 5),
        ("dspark", helpers.write_dspark(tmp_path / "ds", qwen3_target), DSparkDraftSource, 5),
        (
            "dspark",
            helpers.write_dspark(tmp_path / "sp", qwen3_target, packaging="speculators", draft_vocab=64),
            DSparkDraftSource,
            5,
        ),
        ("dspark", helpers.write_dspark(tmp_path / "sf", qwen3_target, packaging="specforge"), DSparkDraftSource, 5),
        (
            "dspark",
            helpers.write_dspark(tmp_path / "s1", qwen3_target, packaging="speculators", first_slot=1),
            DSparkDraftSource,
            4,
        ),
    ]
    for kind, path, cls, max_block in cases:
        recorder = RecordingTarget()
        source = load_drafter(kind, str(path), qwen3_target, target=recorder, bits=0)
        assert isinstance(source, cls)
        assert source.max_block == max_block
        assert source.uses_features
        assert recorder.captured == list(source.target_layer_ids)
    packagings = {
        p: parse_dspark(json.loads((tmp_path / d / "config.json").read_text())).packaging
        for p, d in (("deepspec", "ds"), ("speculators", "sp"), ("specforge", "sf"))
    }
    assert packagings == {"deepspec": "deepspec", "speculators": "speculators", "specforge": "specforge"}


def test_slot_convention_is_read_from_the_checkpoint(tmp_path: Path, qwen3_target: Any) -> None:
    """`logits_start=1` reserves slot 0: the drafts are slots 1.. (same backbone, shifted by one)."""
    a = helpers.write_dspark(tmp_path / "a", qwen3_target, seed=3, markov_strength=0.0)
    b = helpers.write_dspark(tmp_path / "b", qwen3_target, seed=3, markov_strength=0.0, first_slot=1)
    assert parse_dspark(json.loads((b / "config.json").read_text())).first_draft_slot == 1
    anchor_slot = load_drafter("dspark", str(a), qwen3_target, bits=0)
    reserved = load_drafter("dspark", str(b), qwen3_target, bits=0)
    prompt = [4, 5, 6]
    _, feats = helpers.target_forward(qwen3_target, prompt, anchor_slot.target_layer_ids)
    ctx = DraftContext(anchor=8, position=3, history=[*prompt, 8], features=feats)
    for s in (anchor_slot, reserved):
        s.begin(prompt)
    x = anchor_slot.propose(ctx, 1, SamplingParams(), [0.5])
    y = reserved.propose(ctx, 1, SamplingParams(), [0.5])
    d = anchor_slot.drafter
    h = anchor_slot.cache.forward(d.embed_block(anchor_slot.block_ids(8)), 3)[0]
    prev = d.prev_embedding(mx.array(8))
    slot = [int(mx.argmax(d.corrected(d.base_logits(h[k]), prev))) for k in (0, 1)]
    assert (x.tokens[0], y.tokens[0]) == (slot[0], slot[1])


def test_strict_names_report_missing_and_unexpected_tensors(tmp_path: Path, qwen3_target: Any) -> None:
    def drop_and_add(t: dict[str, mx.array]) -> None:
        del t["layers.1.mlp.up_proj.weight"]
        t["layers.1.mlp.extra.weight"] = mx.zeros((2, 2))

    path = retensor(helpers.write_dflash(tmp_path / "d"), drop_and_add)
    with pytest.raises(ModelUnavailable) as err:
        load_drafter("dflash", str(path), qwen3_target)
    assert "missing tensors: layers.1.mlp.up_proj.weight" in str(err.value)
    assert "unexpected tensors: layers.1.mlp.extra.weight" in str(err.value)

    def no_markov(t: dict[str, mx.array]) -> None:
        del t["markov_head.markov_w2.weight"]

    path = retensor(helpers.write_dspark(tmp_path / "s", qwen3_target), no_markov)
    with pytest.raises(ModelUnavailable, match=r"missing tensors: markov_head\.markov_w2\.weight"):
        load_drafter("dspark", str(path), qwen3_target)

    def wrong_shape(t: dict[str, mx.array]) -> None:
        t["norm.weight"] = mx.ones((32,))

    path = retensor(helpers.write_dflash(tmp_path / "w"), wrong_shape)
    with pytest.raises(ModelUnavailable, match=r"norm\.weight \(32,\) \(expected \(64,\)\)"):
        load_drafter("dflash", str(path), qwen3_target)


def test_optional_confidence_bias_and_ignored_training_tensors(tmp_path: Path, qwen3_target: Any) -> None:
    path = helpers.write_dspark(tmp_path / "s", qwen3_target, confidence_bias=False, packaging="speculators")
    source = load_drafter("dspark", str(path), qwen3_target, confidence_threshold=0.5)
    assert "bias" not in source.drafter.confidence_head.proj


def test_drafters_that_do_not_fit_the_target_are_refused(tmp_path: Path, qwen3_target: Any) -> None:
    too_deep = helpers.write_dflash(tmp_path / "deep", num_target_layers=36)
    with pytest.raises(IncompatibleDrafter, match="36-layer target, this one has 6"):
        load_drafter("dflash", str(too_deep), qwen3_target)
    bad_layer = helpers.write_dflash(tmp_path / "layer", layer_ids=(1, 9))
    with pytest.raises(IncompatibleDrafter, match=r"target layers \[9\] do not exist"):
        load_drafter("dflash", str(bad_layer), qwen3_target)
    other_vocab = helpers.write_dflash(tmp_path / "vocab", vocab=256)
    with pytest.raises(IncompatibleDrafter, match="256 tokens, the target's 128"):
        load_drafter("dflash", str(other_vocab), qwen3_target)
    wide = helpers.tiny_target("llama", seed=0)
    # A target of another width: rebuild it 32 wide by loading the 64-wide drafter against it.
    from mlx_lm.models import llama

    narrow = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=32,
            num_hidden_layers=6,
            intermediate_size=64,
            num_attention_heads=2,
            rms_norm_eps=1e-6,
            vocab_size=128,
            tie_word_embeddings=False,
        )
    )
    with pytest.raises(IncompatibleDrafter, match="width 64, the target's is 32"):
        load_drafter("dflash", str(helpers.write_dflash(tmp_path / "w")), narrow)
    ok = load_drafter("dflash", str(helpers.write_dflash(tmp_path / "ok")), wide)
    assert ok.max_block == 5


def test_unsupported_variants_are_refused_with_a_clear_message(tmp_path: Path, qwen3_target: Any) -> None:
    # Gemma-4 DSpark loads in DeepSpec's Gemma4DSparkModel layout (test_gemma4_dspark.py, with its own
    # refusals); a Qwen3-style checkpoint relabelled Gemma-4 lacks the Gemma-4 keys, and a speculators-packaged
    # Gemma-4 head has no published layout.
    gemma4 = edit(
        helpers.write_dspark(tmp_path / "g", qwen3_target), lambda c: c.update(architectures=["Gemma4DSparkModel"])
    )
    with pytest.raises(ModelUnavailable, match="no `global_head_dim`"):
        load_drafter("dspark", str(gemma4), qwen3_target)
    spec_gemma4 = edit(
        helpers.write_dspark(tmp_path / "sg", qwen3_target, packaging="speculators"),
        lambda c: c["transformer_layer_config"].update(model_type="gemma4_text"),
    )
    with pytest.raises(ModelUnavailable, match="speculators-packaged Gemma-4 DSpark drafters are not supported"):
        load_drafter("dspark", str(spec_gemma4), qwen3_target)
    eagle = edit(
        helpers.write_dspark(tmp_path / "e", qwen3_target, packaging="speculators"),
        lambda c: c["speculators_config"].update(algorithm="eagle3"),
    )
    with pytest.raises(ModelUnavailable, match="algorithm 'eagle3'"):
        load_drafter("dspark", str(eagle), qwen3_target)
    rnn = edit(helpers.write_dspark(tmp_path / "r", qwen3_target), lambda c: c.update(markov_head_type="rnn"))
    with pytest.raises(ModelUnavailable, match="'rnn' is not supported"):
        load_drafter("dspark", str(rnn), qwen3_target)
    with pytest.raises(ModelUnavailable, match="kind='dspark'"):
        load_drafter("dflash", str(helpers.write_dspark(tmp_path / "k", qwen3_target)), qwen3_target)
    with pytest.raises(ModelUnavailable, match="kind='dflash'"):
        load_drafter("dspark", str(helpers.write_dflash(tmp_path / "f")), qwen3_target)
    with pytest.raises(ModelUnavailable):
        load_drafter("dflash", str(tmp_path / "nowhere"), qwen3_target)


# Each family's factor on token embeddings: sqrt(64) for Gemma (3 rounds it through bf16), MiniCPM's scale_emb.
EMBED_SCALES = {"gemma3_text": 8.0, "gemma4_text": 8.0, "minicpm": 12.0}


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_model_parts_reproduce_the_target_logits(family: str) -> None:
    model = tiny_models.tiny_model(family, 0)
    ids = mx.array([[3, 1, 4, 1, 5]])
    decoder = model_parts._decoder(model)
    logits = model_parts.lm_head(model, decoder(ids))
    np.testing.assert_allclose(np.array(logits), np.array(model(ids)), rtol=1e-4, atol=1e-4)
    assert model_parts.hidden_size(model) == tiny_models.HIDDEN
    assert model_parts.vocab_size(model) == tiny_models.VOCAB
    assert model_parts.num_layers(model) == len(decoder.layers)
    raw = model_parts.embedding(model)(ids)
    expected_scale = EMBED_SCALES.get(family, 1.0)
    np.testing.assert_allclose(np.array(model_parts.embed(model, ids)), np.array(raw) * expected_scale, rtol=1e-6)


def test_quantized_drafters_load_and_the_cpu_default_is_measured(tmp_path: Path, qwen3_target: Any) -> None:
    """4/8-bit quantization only touches layers whose input width is a multiple of 64; the default is
    chosen by device capability. The microbenchmark below is reported, not asserted (no timed asserts)."""
    path = helpers.write_dspark(tmp_path / "s", qwen3_target)
    for bits in (4, 8):
        source = load_drafter("dspark", str(path), qwen3_target, bits=bits)
        assert isinstance(source.drafter.layers[0].self_attn.q_proj, nn.QuantizedLinear)
        assert isinstance(source.drafter.layers[0].mlp.down_proj, nn.QuantizedLinear)  # in = 128
        assert isinstance(source.drafter.confidence_head.proj, nn.Linear)
    expected = 4 if mx.default_device().type == mx.DeviceType.gpu else 0
    assert default_bits() == expected
    from mlx_dspark.adapters.mlx.blas import blas_status

    report = microbenchmark()
    status = blas_status()
    report["blas"] = status.name if status else "unknown"  # type: ignore[assignment]
    print("\ndrafter forward ms (hidden 1024, 2 layers, block 7, 64 context rows, best of 8):", report)


def microbenchmark() -> dict[str, float]:
    """Best-of-8 ms of one drafter layer stack at a realistic width, fp32 vs 8-bit vs 4-bit."""
    from mlx_dspark.adapters.mlx.drafters.backbone import ContextCache, DrafterBackbone
    from mlx_dspark.adapters.mlx.drafters.checkpoint import prepare
    from mlx_dspark.adapters.mlx.drafters.config import BackboneConfig

    cfg = BackboneConfig(
        hidden_size=1024,
        target_hidden_size=1024,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=3072,
        target_layer_ids=(1, 2, 3),
        block_size=7,
        mask_token_id=0,
        layer_types=("full_attention",) * 2,
    )
    out = {}
    for bits in (0, 8, 4):
        mx.random.seed(0)
        model = DrafterBackbone(cfg)
        prepare(model, bits=bits, dtype=mx.float32)
        cache = ContextCache(model)
        cache.append(mx.random.normal((64, 3 * 1024)), 0)
        block = mx.random.normal((1, 7, 1024))
        mx.eval(cache.state())
        times = []
        for _ in range(8):
            t = time.perf_counter()
            mx.eval(cache.forward(block, 64))
            times.append((time.perf_counter() - t) * 1e3)
        out[f"bits={bits}"] = round(min(times), 2)  # the least-disturbed run on a shared machine
    return out


def test_the_kind_of_a_drafter_is_read_from_its_config_not_its_name(tmp_path: Path, qwen3_target: Any) -> None:
    from mlx_dspark.adapters.hf.loader import HfModelLoader
    from mlx_dspark.adapters.mlx.drafters.config import drafter_kind
    from mlx_dspark.application.settings import ModelSettings

    # Names chosen to mislead a basename matcher.
    paths = {
        "dflash": helpers.write_dflash(tmp_path / "my-dspark-v1", variant="v1"),
        "dflash-v2": helpers.write_dflash(tmp_path / "x2", variant="v2", layer_ids=(0, 2, 4)),
        "dspark": helpers.write_dspark(tmp_path / "some-dflash", qwen3_target),
        "dspark-sp": helpers.write_dspark(tmp_path / "sp", qwen3_target, packaging="speculators", draft_vocab=64),
        "dspark-sf": helpers.write_dspark(tmp_path / "sf", qwen3_target, packaging="specforge"),
    }
    for name, path in paths.items():
        kind = drafter_kind(json.loads((path / "config.json").read_text()))
        assert kind == name.split("-")[0], (name, kind)
    assert drafter_kind({"model_type": "llama"}) is None

    class Model:
        name = "tiny"

    for expected, path in (("dspark", paths["dspark"]), ("dflash", paths["dflash"])):
        loader = HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "cache"), drafter=str(path)))
        assert expected in loader.available_drafters(Model())


def test_the_confidence_threshold_setting_reaches_dspark_and_spares_dflash(tmp_path: Path, qwen3_target: Any) -> None:
    from mlx_dspark.adapters.hf.loader import HfModelLoader
    from mlx_dspark.adapters.mlx.target import MlxTargetModel
    from mlx_dspark.application.settings import ModelSettings
    from mlx_dspark.domain.model import LoadedModel

    model = LoadedModel(
        name="tiny",
        identity="tiny@test",
        target=MlxTargetModel(qwen3_target),
        tokenizer=None,
        context_window=256,
        family="qwen3",
        handle=qwen3_target,
    )
    loader = HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "cache"), confidence_threshold=0.4))
    dspark = loader.load_drafter("dspark", str(helpers.write_dspark(tmp_path / "ds", qwen3_target)), model, bits=0)
    assert dspark.confidence_threshold == 0.4
    dflash = loader.load_drafter("dflash", str(helpers.write_dflash(tmp_path / "df")), model, bits=0)
    assert dflash.max_block >= 1
    assert loader.draft_model_source(model).confidence_threshold == 0.4  # the setting reaches a draft model too


def test_a_draft_model_stops_at_its_default_unless_told_and_bad_thresholds_are_refused(
    tmp_path: Path, qwen3_target: Any
) -> None:
    from mlx_dspark.adapters.hf.loader import HfModelLoader
    from mlx_dspark.adapters.mlx.draft_model import DEFAULT_STOP
    from mlx_dspark.adapters.mlx.target import MlxTargetModel
    from mlx_dspark.application.settings import ModelSettings, load_settings
    from mlx_dspark.domain.errors import InvalidRequest
    from mlx_dspark.domain.model import LoadedModel

    draft = LoadedModel(
        name="tiny", identity="tiny@test", target=MlxTargetModel(qwen3_target), tokenizer=None, context_window=256,
        family="qwen3", handle=qwen3_target,
    )  # fmt: skip

    def source(**given: Any) -> Any:
        return HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "cache"), **given)).draft_model_source(draft)

    assert 0 < DEFAULT_STOP < 1 and source().confidence_threshold == DEFAULT_STOP
    assert source(confidence_threshold=0.0).confidence_threshold == 0.0  # 0 turns the stop off
    assert source().identity != source(confidence_threshold=0.0).identity  # their costs are calibrated apart
    # DSpark keeps its own default: no early stop unless asked.
    dspark = HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "cache"))).load_drafter(
        "dspark", str(helpers.write_dspark(tmp_path / "ds", qwen3_target)), draft, bits=0
    )
    assert dspark.confidence_threshold == 0.0
    for bad in ("1", "-0.1", "2.5"):
        with pytest.raises(InvalidRequest, match=r"confidence_threshold must be in \[0, 1\)"):
            load_settings({"confidence_threshold": bad})


class _Proposals:
    """Delegates to a draft source and records every proposed block (what its features made it draft)."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.blocks: list[tuple[int, ...]] = []
        self.name, self.max_block, self.uses_features = source.name, source.max_block, source.uses_features

    def begin(self, prompt: Any) -> None:
        self.source.begin(prompt)

    def propose(self, ctx: Any, cap: int, sampling: Any, uniforms: Any) -> Any:
        block = self.source.propose(ctx, cap, sampling, uniforms)
        self.blocks.append(block.tokens)
        return block


def _proposals(target: Any, source: Any, prompt: list[int]) -> list[tuple[int, ...]]:
    from mlx_dspark.application.engine import decode
    from mlx_dspark.domain.tokens import SamplingParams, StopRule
    from tests.fakes.clock import FakeClock

    recorder = _Proposals(source)
    target.reset(0)
    for _ in decode(target, prompt, SamplingParams(), StopRule(max_tokens=24), FakeClock(), source=recorder):
        pass
    return recorder.blocks


def test_a_second_drafter_does_not_change_the_first_ones_taps(tmp_path: Path, qwen3_target: Any) -> None:
    """Two drafters on one target, tapping different layers: each drafts exactly what it drafts alone."""
    from mlx_dspark.adapters.mlx.target import MlxTargetModel

    dflash_dir = helpers.write_dflash(tmp_path / "df", variant="v2", layer_ids=(0, 2))
    dspark_dir = helpers.write_dspark(tmp_path / "ds", qwen3_target, layer_ids=(3, 1))
    prompt = [5, 9, 13, 2, 40, 41, 7]

    def alone(kind: str, path: Path) -> list[tuple[int, ...]]:
        model = helpers.tiny_target("qwen3", seed=2)
        target = MlxTargetModel(model)
        return _proposals(target, load_drafter(kind, str(path), model, target=target, bits=0), prompt)

    model = helpers.tiny_target("qwen3", seed=2)
    shared = MlxTargetModel(model)
    first = load_drafter("dflash", str(dflash_dir), model, target=shared, bits=0)
    second = load_drafter("dspark", str(dspark_dir), model, target=shared, bits=0)
    assert shared.capture_layers == (0, 2, 3, 1)
    dflash_blocks = _proposals(shared, first, prompt)
    assert dflash_blocks == alone("dflash", dflash_dir)
    assert _proposals(shared, second, prompt) == alone("dspark", dspark_dir)
    # The two drafters read different layers, so a mix-up would change what they draft.
    assert len(dflash_blocks) > 2 and len({b for b in dflash_blocks}) > 1


def test_drafter_flag_applies_only_to_its_own_kind(tmp_path: Path, qwen3_target: Any) -> None:
    """`--drafter` names one kind: the loader refuses it for another kind; auto mode loads the others' own."""
    from types import SimpleNamespace

    from mlx_dspark.adapters.hf.loader import HfModelLoader
    from mlx_dspark.application.modes import load_source
    from mlx_dspark.domain.errors import IncompatibleDrafter

    dspark_dir = str(helpers.write_dspark(tmp_path / "ds", qwen3_target))
    options = SimpleNamespace(
        trust_remote_code=False, cache_dir=str(tmp_path), drafter=dspark_dir, confidence_threshold=0, draft_vocab=None
    )
    loader = HfModelLoader(options)
    assert loader.drafter_kind(dspark_dir) == "dspark"
    with pytest.raises(IncompatibleDrafter, match="is a dspark drafter"):
        loader.load_drafter("dflash", dspark_dir, SimpleNamespace(name="x", handle=qwen3_target), bits=0)

    asked: list[tuple[str, str | None]] = []

    class Loader:
        def drafter_kind(self, spec: str) -> str | None:
            return loader.drafter_kind(spec)

        def load_drafter(self, kind: str, spec: str | None, model: Any, *, bits: int | None) -> str:
            asked.append((kind, spec))
            return kind

    services = SimpleNamespace(loader=Loader())
    settings = SimpleNamespace(model=SimpleNamespace(drafter=dspark_dir, drafter_bits=None))
    for kind in ("dflash", "dspark", "lookup"):
        load_source(services.loader, settings, None, kind, only_own_kind=True)  # type: ignore[arg-type]
    load_source(services.loader, settings, None, "dflash")  # type: ignore[arg-type]
    assert asked == [("dflash", None), ("dspark", dspark_dir), ("lookup", dspark_dir), ("dflash", dspark_dir)]
