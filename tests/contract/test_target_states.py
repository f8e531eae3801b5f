"""Saved states behind the TargetModel port, on the fake oracle and on every MLX cache kind.

A state is exact: after the target has moved on (more rows, rollbacks, other prompts), loading the state
predicts exactly what a fresh prefill of its tokens predicts, features included; a state cut to a
shorter prefix loads only where that cut is exact (plain KV; a sliding window that never wrapped).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.domain.drafting.block import EMPTY_BLOCK, DraftBlock
from mlx_dspark.domain.tokens import SamplingParams
from tests.contract.targets import make_target, shared_model
from tests.fakes.tiny_models import FAMILIES, GEMMA_WINDOW, STATE

GREEDY = SamplingParams()
PROMPT = [3, 9, 4, 1, 12, 7, 2, 15, 6, 11, 5, 8, 14, 13, 10, 3, 9]
OTHER = [7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13]
KINDS = ("oracle", *(f"mlx-{f}" for f in FAMILIES), "mlx-llama-q8")


def state_kind(kind: str) -> str:
    """The cut rule of a target kind (tests/fakes/tiny_models.STATE); the oracle and q8 cut like plain KV."""
    return STATE.get(kind.removeprefix("mlx-"), "kv")


def make(kind: str):
    return make_target(kind, (0, 1))


def features(target) -> np.ndarray | list:
    f = target.take_features()
    return f if isinstance(f, list) else np.array(f)


def same_features(a, b) -> None:
    if isinstance(a, list):
        assert a == b
    else:
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


def test_extend_then_prefill_equals_one_prefill(kind):
    a, b = make(kind), make(kind)
    first = a.prefill(PROMPT, GREEDY, 0.5)
    b.extend(PROMPT[:5])
    b.extend(PROMPT[5:11])
    assert b.prefill(PROMPT[11:], GREEDY, 0.5) == first
    assert a.cached_ids == b.cached_ids == tuple(PROMPT)
    same_features(features(a), features(b))


def test_a_saved_state_survives_whatever_the_target_does_next(kind):
    target = make(kind)
    anchor = target.prefill(PROMPT, GREEDY, 0.5)
    state = target.save_state()
    assert state.length == len(PROMPT) and state.nbytes > 0
    # Move on: rounds that keep some rows and drop others, then a different prompt entirely.
    for keep, block in ((3, DraftBlock(tokens=(4, 4, 9, 1))), (1, DraftBlock(tokens=(1, 2))), (1, EMPTY_BLOCK)):
        target.verify(anchor, block, GREEDY, [0.5] * (len(block) + 1))
        target.commit(keep)
        anchor = 5
    target.reset(0)
    target.prefill(OTHER, GREEDY, 0.5)
    target.take_features()

    assert target.load_state(state, len(PROMPT)) == len(PROMPT)
    assert target.cached_ids == tuple(PROMPT)
    reference = make(kind)
    expected_next = reference.prefill([*PROMPT, 6], GREEDY, 0.5)
    same_features(features(target), features(reference)[: len(PROMPT)])
    assert target.prefill([6], GREEDY, 0.5) == expected_next
    # Loading twice works: the first load did not consume the state.
    assert target.load_state(state, len(PROMPT)) == len(PROMPT)
    assert target.prefill([6], GREEDY, 0.5) == expected_next


@pytest.mark.parametrize("keep", [1, 6, len(PROMPT) - 1])
def test_a_state_cut_shorter_loads_only_where_the_cut_is_exact(kind, keep):
    target = make(kind)
    target.prefill(PROMPT, GREEDY, 0.5)
    state = target.save_state()
    kept = target.load_state(state, keep)
    exact = state_kind(kind) == "kv" or (state_kind(kind) == "window" and len(PROMPT) <= GEMMA_WINDOW)
    assert kept == (keep if exact else 0)
    assert kept == keep or state.min_length > keep
    assert target.cached_tokens == kept
    if kept:
        assert target.prefill(PROMPT[kept:], GREEDY, 0.5) == make(kind).prefill(PROMPT, GREEDY, 0.5)


def test_min_length_says_where_a_state_can_be_cut(kind):
    target = make(kind)
    target.prefill(PROMPT[:6], GREEDY, 0.5)
    short = target.save_state()
    target.prefill(PROMPT[6:], GREEDY, 0.5)
    long = target.save_state()
    if state_kind(kind) == "recurrent":
        assert (short.min_length, long.min_length) == (6, len(PROMPT))
    elif state_kind(kind) == "window":  # within the window any cut is exact; past it, none
        assert short.min_length == 0 and long.min_length == len(PROMPT)
    else:
        assert short.min_length == long.min_length == 0


def test_a_state_of_other_capture_layers_is_refused():
    target = MlxTargetModel(shared_model("llama"), capture_layers=(0,))
    target.prefill(PROMPT, GREEDY, 0.5)
    state = target.save_state()
    other = MlxTargetModel(shared_model("llama"), capture_layers=(1,))
    assert other.load_state(state, len(PROMPT)) == 0
    assert other.cached_tokens == 0


def test_saving_copies_nothing():
    """A save shares buffers: memory grows only when the target writes to them later (copy on write)."""
    target = MlxTargetModel(shared_model("llama"))
    target.prefill(PROMPT, GREEDY, 0.5)
    mx.synchronize()
    before = mx.get_active_memory()
    state = target.save_state()
    assert mx.get_active_memory() - before < state.nbytes // 4
