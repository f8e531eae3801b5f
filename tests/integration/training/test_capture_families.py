"""The trainer's target features are the serving target's, in every family: `capture` runs the decoder's own
forward (masks, sliding windows, Gemma-4's per-layer inputs and shared KV, DeltaNet, Mamba-2 and conv scans) and
reads the same layer taps, so a drafter distilled for any target trains on what it will be given at inference.
Right padding never reaches a shorter row's features."""

from __future__ import annotations

from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.adapters.mlx.training import MlxDrafterTrainer
from mlx_dspark.adapters.mlx.training.features import capture
from mlx_dspark.application.engine import decode
from mlx_dspark.application.ports import TrainingTarget
from mlx_dspark.domain.events import TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.fakes.clock import FakeClock
from tests.fakes.tiny_models import FAMILIES, VOCAB, tiny_model
from tests.integration.training.test_train_drafter import _plan as train_plan

LONG = [5, 17, 3, 99, 42, 8, 11, 64, 23, 7, 150, 31, 2, 77]
SHORT = LONG[:9]


def _serving(model: object, ids: list[int], layers: tuple[int, ...]) -> np.ndarray:
    target = MlxTargetModel(model, capture_layers=layers)
    target.prefill(ids, SamplingParams(), 0.5)
    features = target.take_features()
    assert features is not None
    return np.array(features)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_features_equal_the_serving_targets_in_every_family(family: str) -> None:
    model = tiny_model(family, seed=2)
    n = len([layer for layer in model_parts._decoder(model).layers if layer is not None])
    layers = (-1, 0, n - 1) if n > 1 else (-1, 0)
    batch = mx.array([LONG, SHORT + [0] * (len(LONG) - len(SHORT))])  # right-padded
    feats, hidden = capture(model, batch, layers, final=True)
    assert feats.shape == (2, len(LONG), len(layers) * feats.shape[-1] // len(layers))
    assert hidden is not None and hidden.shape[:2] == (2, len(LONG))
    got = np.array(feats)
    # Float noise only: a [2, 14] batch and the serving prefill's chunks give the BLAS other GEMM shapes (Qwen3-Next's
    # gated delta rule amplifies that to ~5e-4); a padded token reaching a row would move it by whole units.
    np.testing.assert_allclose(got[0], _serving(model, LONG, layers), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(got[1, : len(SHORT)], _serving(model, SHORT, layers), rtol=1e-3, atol=1e-3)
    # Without the final state the forward ends after the deepest captured layer: the same features.
    early, none = capture(model, batch, layers[:2], final=False)
    assert none is None
    np.testing.assert_allclose(np.array(early), got[..., : early.shape[-1]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
@pytest.mark.parametrize("family", ["gemma4_text", "qwen3_next", "lfm2", "nemotron_h"])
def test_a_drafter_trains_on_a_hybrid_or_gemma4_target_and_decodes_losslessly(
    family: str, kind: str, tmp_path: Path
) -> None:
    # The trainer end to end: the data are the target's own greedy answers from the trainer's generator (these
    # caches do not fit its lock-step rows, so it answers one prompt at a time), then training, then decoding.
    model = tiny_model(family, seed=3)
    n = len([layer for layer in model_parts._decoder(model).layers if layer is not None])
    target = MlxTargetModel(model)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(1, VOCAB - 2, size=int(rng.integers(4, 8)))] for _ in range(18)]
    handle = TrainingTarget(name="tiny", identity="tiny", tokenizer=None, handle=model, tokenizer_size=VOCAB - 1)  # type: ignore[arg-type]
    trainer = MlxDrafterTrainer(lambda name: handle)
    answers = trainer.generate(
        handle, prompts, eos_ids=[], max_new_tokens=16, batch=8, temperatures=[0.0] * 18, top_p=1.0, seed=0,
        time_budget_s=None,
    )  # fmt: skip
    assert answers[0] == _greedy(target, prompts[0], None, 16)
    seqs = [(p + a, len(p)) for p, a in zip(prompts, answers, strict=True) if a is not None]
    plan = attrs.evolve(train_plan(kind), target_layers=(0, n - 1), batch=4, anchors=6, max_steps=8, checkpoint_every=8)
    facts = trainer.train(
        handle, plan, seqs[:14], seqs[14:], out_dir=str(tmp_path / kind), resume=False, card=lambda f: "card\n"
    )
    assert facts["finished"]
    source = load_drafter(kind, str(tmp_path / kind), model, target=target, bits=0)
    for prompt in prompts[14:16]:
        assert _greedy(target, prompt, source, 20) == _greedy(target, prompt, None, 20)


def _greedy(target: MlxTargetModel, prompt: list[int], source: object, tokens: int) -> list[int]:
    target.reset(0)
    if source is not None:
        source.begin(prompt)  # type: ignore[attr-defined]
    events = decode(target, prompt, SamplingParams(), StopRule(max_tokens=tokens), FakeClock(), source=source)  # type: ignore[arg-type]
    return [t for e in events if isinstance(e, TokensCommitted) for t in e.tokens]
