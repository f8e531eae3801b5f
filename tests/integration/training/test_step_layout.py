"""The device-side training step against the host reference it replaced, on a tiny random target.

`anchor_batch` + `expand` must lay out exactly what `build_batch` lays out (same anchors from the same draws);
the blockwise attention must equal the dense block mask; the teacher computed once per response row must equal
the one computed per anchor slot. Then the options of the recipe: soft targets (KL), DSpark's Markov inputs
from its own drafts (the inference chain), growing a committed drafter (its function at step 0), length-grouped
batches, timed profile steps that change no training, and an invocation that stops and is resumed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.drafters.backbone import BlockwiseMask
from mlx_dspark.adapters.mlx.drafters.dspark import DSparkDraftSource
from mlx_dspark.adapters.mlx.training.features import capture
from mlx_dspark.adapters.mlx.training.recipe import (
    IGNORE,
    BlockLayout,
    TrainSequence,
    anchor_batch,
    build_batch,
    dense_mask,
    dflash_loss,
    expand,
    kl_to_teacher,
    response_window,
)
from mlx_dspark.adapters.mlx.training.trainer import _Run
from mlx_dspark.application.lab.training import TrainPlan
from tests.fakes.tiny_models import VOCAB, tiny_model

MASK = VOCAB - 1


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("qwen3", seed=3)


def _seqs(n: int, seed: int = 0) -> list[TrainSequence]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, r = int(rng.integers(2, 30)), int(rng.integers(1, 40))
        out.append(TrainSequence(tokens=tuple(int(t) for t in rng.integers(1, VOCAB - 2, size=p + r)), prompt_len=p))
    return out


def _plan(kind: str, **kw: Any) -> TrainPlan:
    base = TrainPlan(
        kind=kind,
        layers=1,
        block_size=6 if kind == "dflash" else 5,
        target_layers=(0, 1),
        mask_token_id=MASK,
        draft_vocab=96,
        markov_rank=8,
        lr=3e-3,
        epochs=100,
        batch=8,
        anchors=8,
        max_steps=24,
        seed=7,
        checkpoint_every=1000,
        log_every=1000,
        save_dtype="float32",
    )
    return attrs.evolve(base, **kw)


def _pairs(seqs: list[TrainSequence]) -> list[tuple[list[int], int]]:
    return [(list(s.tokens), s.prompt_len) for s in seqs]


def _run(model: Any, plan: TrainPlan, out: Path, data: list[TrainSequence], *, resume: bool = False) -> _Run:
    return _Run(model, plan, _pairs(data), _pairs(data[:6]), out, lambda f: "card\n", None, resume)


def _params(run: _Run) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(run.drafter.parameters())}


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("bucket", [False, True])
def test_expand_lays_out_what_build_batch_does(kind: str, bucket: bool) -> None:
    layout = BlockLayout.for_kind(kind, 6 if kind == "dflash" else 5)
    seqs = [*_seqs(9), TrainSequence(tokens=(5, 6, 7), prompt_len=2)]  # one without any anchor
    ref = build_batch(
        seqs, layout=layout, anchors=12, mask_token_id=MASK, rng=np.random.default_rng(3), bucket=128 if bucket else 0
    )
    rng = np.random.default_rng(3)
    window = response_window(seqs, layout)
    host = anchor_batch(seqs, layout=layout, anchors=12, rng=rng, window=window, bucket=bucket)
    assert rng.bit_generator.state == _advanced(3, seqs, layout, 12)  # the same draws, no more
    assert host.tokens == ref.tokens
    ex = expand(host.arrays(), layout, MASK)
    b, n = ref.labels.shape[:2]
    np.testing.assert_array_equal(host.ctx_ids[:, : ref.ctx_ids.shape[1]], ref.ctx_ids)
    for name in ("block_ids", "positions", "labels", "prev_ids", "target_rows"):
        got = np.array(ex[name])
        want = getattr(ref, name)
        assert got.shape[:2] == (b, n * layout.block_size) or got.shape[:2] == (b, n), name
        np.testing.assert_array_equal(got.reshape(want.shape), want, err_msg=name)
    np.testing.assert_array_equal(np.array(dense_mask(ex["visible"], layout.block_size)), ref.mask)
    # Every supervised slot's teacher row is in the window, at the index `expand` gives it.
    index = np.array(ex["window_index"]).reshape(b, -1)
    rows = np.take_along_axis(host.window, index, axis=1).reshape(ref.labels.shape)
    sup = ref.labels != IGNORE
    np.testing.assert_array_equal(rows[sup], ref.target_rows[sup])


def _advanced(seed: int, seqs: list[TrainSequence], layout: BlockLayout, anchors: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    build_batch(seqs, layout=layout, anchors=anchors, mask_token_id=MASK, rng=rng)
    return rng.bit_generator.state  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_blockwise_attention_equals_the_dense_mask(model: Any, kind: str, tmp_path: Path) -> None:
    run = _run(model, _plan(kind, layers=2), tmp_path, _seqs(16))
    host = anchor_batch(
        run.data[:6], layout=run.layout, anchors=8, rng=np.random.default_rng(0), window=run.window, bucket=True
    )
    extra = run.step_fn.inputs(host.arrays())
    d = run.drafter
    ctx = d.context_kv(d.fuse(extra["feats"]), 0)
    block = d.embed_block(extra["block_ids"])
    bs = run.layout.block_size
    dense = d.hidden(block, extra["positions"], context=ctx, masks=dense_mask(extra["visible"], bs))
    split = d.hidden(block, extra["positions"], context=ctx, masks=BlockwiseMask(extra["visible"], bs))
    np.testing.assert_allclose(np.array(split), np.array(dense), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("anchors", [4, 40])  # 4 × 5 slots: per slot; 40 × 5 > the window: once per row
def test_teacher_once_per_row_equals_the_teacher_per_slot(model: Any, anchors: int, tmp_path: Path) -> None:
    run = _run(model, _plan("dspark", anchors=anchors), tmp_path, _seqs(16))
    assert (anchors * run.layout.slots <= run.window) == (anchors == 4)
    host = anchor_batch(
        run.data[:8], layout=run.layout, anchors=anchors, rng=np.random.default_rng(1), window=run.window, bucket=True
    )
    extra = run.step_fn.inputs(host.arrays())
    # The per-slot way: the target's softmax at every slot's row, restricted to the draft vocabulary.
    _, final = capture(model, mx.array(host.ctx_ids), run.step_fn.layer_ids, final=True)
    rows = extra["target_rows"]
    b = rows.shape[0]
    hidden = mx.take_along_axis(final, rows.reshape(b, -1)[..., None], axis=1)
    probs = mx.softmax(model_parts.lm_head(model, hidden).astype(mx.float32), axis=-1).reshape(*rows.shape, -1)
    teacher = np.array(mx.take(probs, run.step_fn.draft_ids, axis=-1))
    sup = np.array(extra["labels"]) != IGNORE
    np.testing.assert_allclose(np.array(extra["teacher"])[sup], teacher[sup], rtol=1e-5, atol=1e-6)
    outside = np.maximum(1.0 - teacher.sum(-1), 0.0)
    np.testing.assert_allclose(np.array(extra["outside"])[sup], outside[sup], atol=1e-5)


def test_kl_is_zero_at_the_teacher_and_positive_elsewhere() -> None:
    logits = mx.random.normal((2, 3, 4, 10), key=mx.random.key(0))
    labels = mx.zeros((2, 3, 4), dtype=mx.int32)
    layout = BlockLayout.for_kind("dflash", 5)
    teacher = mx.softmax(logits, axis=-1)
    _, same = dflash_loss(logits, labels, layout, teacher=teacher, supervised=labels, kl_weight=0.5)
    assert float(same["kl"]) == pytest.approx(0.0, abs=1e-6)
    other = mx.softmax(mx.random.normal((2, 3, 4, 10), key=mx.random.key(1)), axis=-1)
    assert float(kl_to_teacher(mx.log(teacher), other).min()) > 0


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_soft_targets_train_and_reach_every_parameter(model: Any, kind: str, tmp_path: Path) -> None:
    plan = _plan(kind, kl_weight=0.5, max_steps=30)
    run = _run(model, plan, tmp_path, _seqs(32))
    host = anchor_batch(
        run.data[:8], layout=run.layout, anchors=8, rng=np.random.default_rng(2), window=run.window, bucket=True
    )
    extra = run.step_fn.inputs(host.arrays())
    (_, parts), grads = run.grad_fn(run.drafter, extra)
    assert "kl" in parts and float(parts["kl"]) > 0
    flat = dict(tree_flatten(grads))
    assert flat and all(float(mx.abs(g).sum()) > 0 for g in flat.values())
    run.run(resume=False)
    losses = [h["loss"] for h in run.history]
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5]), losses


def test_own_prev_markov_inputs_are_the_inference_chain(model: Any, tmp_path: Path) -> None:
    run = _run(model, _plan("dspark", own_prev=1.0), tmp_path, _seqs(16))
    host = anchor_batch(
        run.data[:4], layout=run.layout, anchors=4, rng=np.random.default_rng(0), window=run.window, bucket=True
    )
    extra = run.step_fn.inputs(host.arrays())
    d = run.drafter
    _, (h, _) = run.step_fn.slot_logits(d, extra)
    own = run.step_fn._own_drafts(d, d.base_logits(h), extra["prev_ids"])
    # The draft source's greedy chain from the same hidden rows and anchors drafts slot k; slot k + 1 reads it.
    tokens, _ = DSparkDraftSource(d).greedy_slots(h, extra["prev_ids"][..., 0])
    np.testing.assert_array_equal(np.array(own[..., 1:]), np.array(tokens[..., :-1]))
    np.testing.assert_array_equal(np.array(own[..., 0]), np.array(extra["prev_ids"][..., 0]))
    run.run(resume=False)
    losses = [x["loss"] for x in run.history]
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5]), losses


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_grown_drafter_starts_as_the_checkpoint(model: Any, kind: str, tmp_path: Path) -> None:
    data = _seqs(32)
    small = _run(model, _plan(kind, max_steps=8), tmp_path / "small", data)
    small.run(resume=False)
    grow = _plan(kind, layers=3, target_layers=(0, 1, 2), block_size=8, grow=True, init_from=str(tmp_path / "small"))
    big = _run(model, grow, tmp_path / "big", data)
    assert big.config["num_hidden_layers"] == 3 and big.config["block_size"] == 8
    seqs = data[:6]
    for run in (small, big):
        run.layout = BlockLayout.for_kind(kind, 8)  # both read the same blocks
        run.step_fn.layout = run.layout
    args = {"layout": big.layout, "anchors": 6, "window": big.window, "bucket": True}
    a = small.step_fn.inputs(anchor_batch(seqs, rng=np.random.default_rng(5), **args).arrays())
    b = big.step_fn.inputs(anchor_batch(seqs, rng=np.random.default_rng(5), **args).arrays())
    la, _ = small.step_fn.slot_logits(small.drafter, a)
    lb, _ = big.step_fn.slot_logits(big.drafter, b)
    np.testing.assert_allclose(np.array(lb), np.array(la), rtol=1e-4, atol=1e-4)
    facts = big.run(resume=False)
    assert facts["steps"] == 24 and facts["continued_from"] == str(tmp_path / "small")


def test_length_grouped_batches_pad_less_and_cover_each_sequence_once(model: Any, tmp_path: Path) -> None:
    data = _seqs(96, seed=4)

    def padding(group: int) -> tuple[float, list[int]]:
        run = _run(model, _plan("dflash", length_grouping=group), tmp_path / str(group), data)
        order = run._epoch_order(8)
        lengths = run.lengths[np.array(order)].reshape(-1, 8)
        return float((lengths.max(axis=1, keepdims=True) - lengths).mean()), order

    plain, _ = padding(0)
    grouped, order = padding(4)
    assert grouped < 0.5 * plain
    assert len(order) == len(set(order)) == 96  # whole batches: 96 = 12 × 8


def test_profiled_steps_change_no_training(model: Any, tmp_path: Path) -> None:
    data = _seqs(32)
    straight = _run(model, _plan("dspark", max_steps=16), tmp_path / "a", data)
    straight.run(resume=False)
    timed = _run(model, _plan("dspark", max_steps=16, profile_steps=3), tmp_path / "b", data)
    facts = timed.run(resume=False)
    prof = facts["profile"]
    assert prof["steps"] == 3 and prof["step_ms"] > 0 and prof["target_ms"] > 0 and prof["block_tokens_per_step"] > 0
    assert [h["loss"] for h in timed.history] == pytest.approx([h["loss"] for h in straight.history], abs=1e-6)
    for name, value in _params(straight).items():
        np.testing.assert_allclose(_params(timed)[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_an_invocation_that_stops_is_resumed_into_the_same_run(model: Any, tmp_path: Path) -> None:
    data = _seqs(32)
    straight = _run(model, _plan("dflash", max_steps=10), tmp_path / "a", data)
    straight.run(resume=False)
    stopped = _run(model, _plan("dflash", max_steps=10, stop_after_s=1e-9), tmp_path / "b", data)
    facts = stopped.run(resume=False)
    assert facts["interrupted"] and not facts["finished"] and (tmp_path / "b" / "training").is_dir()
    resumed = _run(model, _plan("dflash", max_steps=10), tmp_path / "b", data, resume=True)
    done = resumed.run(resume=True)
    assert done["finished"]
    # One learning curve over both invocations: τ after 0 and after 10 steps, seconds adding up.
    assert [p["step"] for p in done["curve"]] == [0, 10]
    assert done["curve"][1]["seconds"] > done["curve"][0]["seconds"] > 0
    assert done["curve"][1]["block_tokens"] == done["block_tokens"] == straight.tokens_seen
    for name, value in _params(straight).items():
        np.testing.assert_allclose(_params(resumed)[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_bfloat16_compute_keeps_float32_master_weights(model: Any, tmp_path: Path) -> None:
    run = _run(model, _plan("dspark", compute_dtype="bfloat16", max_steps=30), tmp_path, _seqs(32))
    host = anchor_batch(
        run.data[:8], layout=run.layout, anchors=8, rng=np.random.default_rng(2), window=run.window, bucket=True
    )
    _, grads = run._value_and_grad(run.step_fn.inputs(host.arrays()))
    assert all(g.dtype == mx.float32 for _, g in tree_flatten(grads))
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(run.drafter.trainable_parameters()))
    run.run(resume=False)
    losses = [h["loss"] for h in run.history]
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5]), losses
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(run.drafter.trainable_parameters()))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_the_compiled_step_trains_as_the_uncompiled_one(model: Any, kind: str, tmp_path: Path) -> None:
    data = _seqs(32)
    plain = _run(model, _plan(kind, max_steps=16), tmp_path / "plain", data)
    plain.run(resume=False)
    compiled = _run(model, _plan(kind, max_steps=16, compile=True, profile_steps=2), tmp_path / "compiled", data)
    facts = compiled.run(resume=False)
    assert facts["finished"] and facts["profile"]["steps"] == 2
    np.testing.assert_allclose(
        [h["loss"] for h in compiled.history], [h["loss"] for h in plain.history], rtol=1e-4, atol=1e-5
    )


def test_a_compiled_run_on_a_time_budget_settles_its_step_count_and_finishes(model: Any, tmp_path: Path) -> None:
    run = _run(model, _plan("dspark", max_steps=None, compile=True, time_budget_s=4.0), tmp_path, _seqs(32))
    facts = run.run(resume=False)
    assert facts["finished"] and facts["steps"] == facts["total_steps"] >= 1
    assert len(run.history) == facts["steps"] and facts["curve"][-1]["step"] == facts["steps"]


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_compiled_bfloat16_step_trains(model: Any, kind: str, tmp_path: Path) -> None:
    run = _run(model, _plan(kind, max_steps=30, compile=True, compute_dtype="bfloat16"), tmp_path, _seqs(32))
    run.run(resume=False)
    losses = [h["loss"] for h in run.history]
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5]), losses
