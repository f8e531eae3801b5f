"""One TargetModel behaviour suite over the fake OracleTarget and MlxTargetModel on tiny mlx-lm models.

cached_tokens, verify/commit, commit(0) undo, reset(keep) prefix reuse, and which rows take_features hands
out; the MLX targets are every family of tests/fakes/tiny_models.py: plain KV, sliding windows, recurrent hybrids.
"""

from __future__ import annotations

import pytest

from mlx_dspark.domain.drafting.block import EMPTY_BLOCK, DraftBlock
from mlx_dspark.domain.ports import RollbackKind
from mlx_dspark.domain.tokens import SamplingParams
from tests.contract.targets import make_target
from tests.fakes.tiny_models import FAMILIES, STATE

GREEDY = SamplingParams()
PROMPT = [3, 9, 4, 1, 12, 7, 2, 15, 6, 11, 5, 8]
BLOCK = DraftBlock(tokens=(4, 4, 9, 1), source="test")

KINDS = {
    "oracle": RollbackKind.TRIM,
    **{f"mlx-{f}": RollbackKind.TRIM if STATE[f] == "kv" else RollbackKind.SNAPSHOT for f in FAMILIES},
}


def make(kind: str):
    return make_target(kind, (0,))


def rows(features) -> int:
    """Row count of either target's feature handle."""
    return len(features) if isinstance(features, list) else features.shape[0]


@pytest.fixture(params=sorted(KINDS))
def kind(request) -> str:
    return request.param


def test_rollback_kind(kind):
    assert make(kind).rollback_kind is KINDS[kind]


def test_prefill_caches_the_prompt_and_hands_out_its_features_once(kind):
    target = make(kind)
    assert target.reset(0) == 0
    first = target.prefill(PROMPT, GREEDY, 0.5)
    assert 0 <= first < target.vocab_size
    assert target.cached_tokens == len(PROMPT)
    assert rows(target.take_features()) == len(PROMPT)
    assert rows(target.take_features()) == 0


def _prefilled(kind):
    """A target that has prefilled PROMPT and handed out its features, with its first token."""
    target = make(kind)
    first = target.prefill(PROMPT, GREEDY, 0.5)
    target.take_features()
    return target, first


def test_verify_changes_nothing_until_commit(kind):
    target, first = _prefilled(kind)
    verdict = target.verify(first, BLOCK, GREEDY, [0.5] * 5)
    assert 0 <= verdict.accepted <= len(BLOCK)
    assert target.cached_tokens == len(PROMPT)
    target.commit(3)
    assert target.cached_tokens == len(PROMPT) + 3
    assert rows(target.take_features()) == 3


def test_commit_zero_undoes_a_verify_exactly(kind):
    target, first = _prefilled(kind)
    before = target.verify(first, BLOCK, GREEDY, [0.5] * 5)
    target.commit(0)
    assert target.cached_tokens == len(PROMPT)
    assert rows(target.take_features()) == 0
    again = target.verify(first, BLOCK, GREEDY, [0.5] * 5)
    assert again == before


def test_committed_rows_predict_like_a_fresh_prefill(kind):
    """After rounds that keep some rows and drop others, the next token is the fresh model's next token."""
    target = make(kind)
    history = list(PROMPT)
    anchor = target.prefill(history, GREEDY, 0.5)
    for keep, block in ((1, BLOCK), (3, BLOCK), (2, DraftBlock(tokens=(1, 2, 3))), (1, EMPTY_BLOCK)):
        target.verify(anchor, block, GREEDY, [0.5] * (len(block) + 1))
        target.commit(keep)
        kept = [anchor, *block.tokens][:keep]
        history.extend(kept)
        anchor = 5 if keep == len(block) + 1 else [anchor, *block.tokens][keep]
    assert target.cached_tokens == len(history)
    expected = make(kind).prefill([*history, anchor], GREEDY, 0.5)
    assert target.verify(anchor, EMPTY_BLOCK, GREEDY, [0.5]).next_token == expected


@pytest.mark.parametrize("keep", [0, 3, 7, len(PROMPT)])
def test_reset_keeps_an_exact_prefix_or_nothing(kind, keep):
    target = make(kind)
    expected_first = make(kind).prefill(PROMPT, GREEDY, 0.5)
    target.prefill(PROMPT, GREEDY, 0.5)
    target.take_features()
    kept = target.reset(keep)
    assert 0 <= kept <= keep
    assert target.cached_tokens == kept
    if keep == len(PROMPT):
        assert kept == keep  # keeping everything is always exact
    # A drafter starting over needs every kept row's features.
    assert rows(target.take_features()) == kept
    if kept < len(PROMPT):
        assert target.prefill(PROMPT[kept:], GREEDY, 0.5) == expected_first
        assert rows(target.take_features()) == len(PROMPT) - kept


def test_reset_discards_a_pending_verify(kind):
    target = make(kind)
    first = target.prefill(PROMPT, GREEDY, 0.5)
    target.verify(first, BLOCK, GREEDY, [0.5] * 5)
    assert target.reset(len(PROMPT)) == len(PROMPT)
    assert target.cached_tokens == len(PROMPT)


def test_short_prompts_cut_exactly_on_every_mlx_kind():
    """Within the sliding window and on plain KV, a cut is exact; recurrent state keeps nothing."""
    prompt = PROMPT[:6]
    for family in FAMILIES:
        exact = STATE[family] != "recurrent"
        target = make(f"mlx-{family}")
        target.prefill(prompt, GREEDY, 0.5)
        assert target.reset(3) == (3 if exact else 0)
