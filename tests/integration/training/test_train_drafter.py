"""Drafter distillation end to end on a tiny random target: the target writes the data, a few dozen steps
train a DFlash or DSpark drafter, the project's own loader loads the checkpoint, and greedy speculative
decoding with it equals plain decoding. Also: the loss falls, and an interrupted run resumed from its
checkpoint ends in the same state as an uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.adapters.mlx.training import MlxDrafterTrainer
from mlx_dspark.application.engine import decode
from mlx_dspark.application.lab.training import TrainPlan
from mlx_dspark.application.ports import TrainingTarget
from mlx_dspark.domain.events import TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.fakes.clock import FakeClock
from tests.fakes.tiny_models import VOCAB, tiny_model

MASK = VOCAB - 1


def _target(model: Any) -> TrainingTarget:
    return TrainingTarget(name="tiny", identity="tiny", tokenizer=None, handle=model, tokenizer_size=VOCAB - 1)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def data() -> dict[str, Any]:
    """Prompts answered by the tiny target itself (greedy and sampled), as the recipe asks."""
    model = tiny_model("qwen3", seed=3)
    trainer = MlxDrafterTrainer(lambda name: _target(model))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, VOCAB - 2, size=int(rng.integers(4, 9)))] for _ in range(40)]
    responses = trainer.generate(
        _target(model),
        prompts,
        eos_ids=[],
        max_new_tokens=24,
        batch=16,
        temperatures=[0.0 if i % 4 else 0.8 for i in range(len(prompts))],
        top_p=1.0,
        seed=0,
        time_budget_s=None,
    )
    assert all(r is not None and len(r) == 24 for r in responses)
    seqs = [(p + r, len(p)) for p, r in zip(prompts, responses, strict=True) if r]
    return {"model": model, "trainer": trainer, "train": seqs[:32], "held": seqs[32:], "prompts": prompts[32:]}


def _plan(kind: str, **kw: Any) -> TrainPlan:
    base = TrainPlan(
        kind=kind,
        layers=1,
        block_size=6 if kind == "dflash" else 5,
        target_layers=(0, 1),
        mask_token_id=MASK,
        draft_vocab=96 if kind == "dspark" else 0,
        markov_rank=8,
        lr=3e-3,
        epochs=100,
        batch=8,
        anchors=8,
        max_steps=36,
        seed=7,
        checkpoint_every=12,
        log_every=1,
        save_dtype="float32",
    )
    return attrs.evolve(base, **kw)


def _train(data: dict[str, Any], plan: TrainPlan, out: Path, *, resume: bool = False, **kw: Any) -> dict[str, Any]:
    return dict(
        data["trainer"].train(
            _target(data["model"]),
            plan,
            data["train"],
            data["held"],
            out_dir=str(out),
            resume=resume,
            card=lambda f: "card\n",
            **kw,
        )
    )


def _greedy(target: MlxTargetModel, prompt: list[int], source: Any) -> list[int]:
    target.reset(0)
    if source is not None:
        source.begin(prompt)
    out: list[int] = []
    events = decode(
        target,
        prompt,
        SamplingParams(temperature=0.0),
        StopRule(max_tokens=20, eos_ids=frozenset()),
        FakeClock(),
        source=source,
    )
    for event in events:
        if isinstance(event, TokensCommitted):
            out.extend(event.tokens)
    return out


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_trained_drafter_loads_and_decodes_losslessly(data: dict[str, Any], kind: str, tmp_path: Path) -> None:
    facts = _train(data, _plan(kind), tmp_path / kind)
    history = json.loads((tmp_path / kind / "training" / "state.json").read_text())["history"]
    losses = [h["loss"] for h in history]
    assert len(losses) == 36
    assert np.mean(losses[-6:]) < 0.9 * np.mean(losses[:6]), losses
    assert facts["finished"] and not facts["interrupted"]
    assert (tmp_path / kind / "README.md").read_text() == "card\n"

    model = data["model"]
    target = MlxTargetModel(model)
    source = load_drafter(kind, str(tmp_path / kind), model, target=target, bits=0)
    assert source.max_block == 5  # DFlash: bs 6 → 5 drafts; DSpark: bs 5, all 5 slots draft
    for prompt in data["prompts"][:4]:
        plain = _greedy(target, prompt, None)
        spec = _greedy(target, prompt, source)
        assert spec == plain


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_drafter_with_a_narrower_mlp_than_the_target_trains_and_decodes_losslessly(
    data: dict[str, Any], kind: str, tmp_path: Path
) -> None:
    _train(data, _plan(kind, mlp_width=48, max_steps=12), tmp_path / kind)
    config = json.loads((tmp_path / kind / "config.json").read_text())
    assert config["intermediate_size"] == 48 != data["model"].args.intermediate_size
    model = data["model"]
    target = MlxTargetModel(model)
    source = load_drafter(kind, str(tmp_path / kind), model, target=target, bits=0)
    assert source.drafter.layers[0].mlp.gate_proj.weight.shape[0] == 48
    for prompt in data["prompts"][:2]:
        assert _greedy(target, prompt, source) == _greedy(target, prompt, None)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_resume_reproduces_an_uninterrupted_run(data: dict[str, Any], kind: str, tmp_path: Path) -> None:
    plan = _plan(kind, max_steps=10, checkpoint_every=100)
    _train(data, plan, tmp_path / "straight")

    def stop_at_four(p: Any) -> None:
        if p["step"] == 4:
            raise KeyboardInterrupt  # what Ctrl-C does mid-run

    first = _train(data, plan, tmp_path / "resumed", progress=stop_at_four)
    assert first["interrupted"] and first["steps"] == 4
    assert (tmp_path / "resumed" / "model.safetensors").is_file()  # usable checkpoint right away
    second = _train(data, plan, tmp_path / "resumed", resume=True)
    assert second["steps"] == 10 and second["finished"]

    a = mx.load(str(tmp_path / "straight" / "training" / "params.safetensors"))
    b = mx.load(str(tmp_path / "resumed" / "training" / "params.safetensors"))
    assert isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(np.array(a[name]), np.array(b[name]), rtol=0, atol=1e-6, err_msg=name)
    ha = json.loads((tmp_path / "straight" / "training" / "state.json").read_text())["history"]
    hb = json.loads((tmp_path / "resumed" / "training" / "state.json").read_text())["history"]
    assert [h["loss"] for h in ha] == pytest.approx([h["loss"] for h in hb], abs=1e-6)


def _published(where: Path) -> dict[str, Any]:
    loaded = mx.load(str(where / "model.safetensors"))
    assert isinstance(loaded, dict)
    return loaded


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_resume_continues_a_committed_drafter_with_new_data(data: dict[str, Any], kind: str, tmp_path: Path) -> None:
    """A later slot: `--resume` on a directory holding only a published drafter (no training state, as
    shipped) continues that drafter on new data, keeping its shape and draft vocabulary."""
    import shutil

    old, new = data["train"][:16], data["train"][16:]
    committed = tmp_path / "committed"
    plan = _plan(kind, max_steps=12, draft_vocab=96)
    data["trainer"].train(
        _target(data["model"]), plan, old, data["held"], out_dir=str(committed), resume=False, card=lambda f: "card\n"
    )
    shutil.rmtree(committed / "training")  # what a committed drafter directory holds
    before = _published(committed)
    assert "d2t" in before and "lm_head.weight" not in before  # reduced head: rows come from the target

    # With a zero learning rate nothing may move: the run starts from the committed weights exactly.
    frozen = tmp_path / "frozen"
    shutil.copytree(committed, frozen)
    still = data["trainer"].train(
        _target(data["model"]),
        _plan(kind, max_steps=3, lr=0.0, layers=2, block_size=9),
        new,
        data["held"],
        out_dir=str(frozen),
        resume=True,
        card=lambda f: "card\n",
    )
    assert still["continued_from"] == str(frozen)
    after = _published(frozen)
    assert after.keys() == before.keys()
    for name in before:
        np.testing.assert_array_equal(np.array(before[name]), np.array(after[name]), err_msg=name)

    # A real continuation: its own optimizer, same shape and vocabulary, lower loss than a fresh start.
    cont = data["trainer"].train(
        _target(data["model"]),
        _plan(kind, max_steps=6),
        new,
        data["held"],
        out_dir=str(committed),
        resume=True,
        card=lambda f: "card\n",
    )
    fresh = _train({**data, "train": new}, _plan(kind, max_steps=6, draft_vocab=96), tmp_path / "fresh")
    assert cont["first_loss"] < fresh["first_loss"]
    np.testing.assert_array_equal(np.array(_published(committed)["d2t"]), np.array(before["d2t"]))
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "frozen", again)  # the same committed weights, continued once more
    twice = data["trainer"].train(
        _target(data["model"]),
        _plan(kind, max_steps=6, init_from=str(frozen)),
        new,
        data["held"],
        out_dir=str(again),
        resume=False,
        card=lambda f: "card\n",
    )
    assert twice["first_loss"] == pytest.approx(cont["first_loss"], abs=1e-6)  # continues exactly, repeatably

    model = data["model"]
    target = MlxTargetModel(model)
    source = load_drafter(kind, str(committed), model, target=target, bits=0)
    for prompt in data["prompts"][:3]:
        assert _greedy(target, prompt, source) == _greedy(target, prompt, None)
