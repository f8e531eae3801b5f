"""Drafting several requests in one batched drafter call (`propose_rows`): each row's drafts are the ones
its own fork proposes alone, its context cache ends where a solo ingest leaves it, and caps stay per row.

Tiny float32 checkpoints in the published formats; contexts of different lengths (so the per-row attention
and the batched context fusion are both exercised), a sliding-window DFlash layer, a reduced draft
vocabulary, and rows that only take their features in (cap 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.ports import RowsDraftSource
from mlx_dspark.domain.tokens import SamplingParams
from tests.integration.drafters import helpers

GREEDY = SamplingParams()


def _rows(kind: str, root: Path, **extra: Any) -> tuple[Any, MlxTargetModel]:
    model = helpers.tiny_target("qwen3", seed=4)
    target = MlxTargetModel(model, prefill_chunk=8)
    if kind == "dspark":
        path = helpers.write_dspark(root / "d", model, **extra)
    else:
        path = helpers.write_dflash(root / "d", variant=extra.pop("variant", "v2"), **extra)
    return load_drafter(kind, str(path), model, target=target, bits=0), target


def _context(target: MlxTargetModel, prompt: list[int]) -> DraftContext:
    target.reset(0, capture=True)
    first = target.prefill(prompt, GREEDY, 0.5)
    return DraftContext(anchor=first, position=len(prompt), history=(*prompt, first), features=target.take_features())


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("dspark", {}),
        ("dspark", {"packaging": "speculators", "draft_vocab": 64}),
        ("dflash", {}),
        ("dflash", {"variant": "sliding"}),
    ],
    ids=["dspark", "dspark-d2t", "dflash", "dflash-sliding"],
)
def test_rows_drafted_together_equal_each_forks_own_drafts(kind: str, extra: dict[str, Any], tmp_path: Path) -> None:
    source, target = _rows(kind, tmp_path, **extra)
    assert isinstance(source, RowsDraftSource)
    prompts = [[(7 * r + 3 * i) % 120 + 4 for i in range(9 + 6 * r)] for r in range(3)]  # 9, 15, 21 tokens
    contexts = [_context(target, p) for p in prompts]
    caps = [source.max_block, 2, 0]  # the last row only takes its features in
    alone, together = [source.fork() for _ in prompts], [source.fork() for _ in prompts]
    for fork, prompt in zip([*alone, *together], [*prompts, *prompts]):
        fork.begin(prompt)
    want = [fork.propose(ctx, cap, GREEDY, [0.5] * cap) for fork, ctx, cap in zip(alone, contexts, caps)]
    got = source.propose_rows(list(zip(together, contexts, caps)))
    assert [len(b) for b in got] == caps
    assert [b.tokens for b in got] == [b.tokens for b in want]
    assert all(b.q is None for b in got)  # argmax drafts: one-hot q
    # Every row's context cache holds its prompt now, cap 0 included: the next round drafts the same again.
    for solo_fork, fork in zip(alone, together):
        assert fork.cache.offset == solo_fork.cache.offset
    nxt = [DraftContext(anchor=c.anchor, position=c.position, history=c.history) for c in contexts]
    again = source.propose_rows([(f, c, source.max_block) for f, c in zip(together, nxt)])
    want_again = [f.propose(c, source.max_block, GREEDY, [0.5] * source.max_block) for f, c in zip(alone, nxt)]
    assert [b.tokens for b in again] == [b.tokens for b in want_again]


def test_rows_of_another_drafter_are_refused_and_an_all_ingest_call_drafts_nothing(tmp_path: Path) -> None:
    source, target = _rows("dspark", tmp_path)
    other, _ = _rows("dspark", tmp_path / "other")
    ctx = _context(target, list(range(4, 14)))
    with pytest.raises(ValueError, match="forks of this source"):
        source.propose_rows([(other.fork(), ctx, 2)])
    fork = source.fork()
    fork.begin(list(range(4, 14)))
    blocks = source.propose_rows([(fork, ctx, 0)])
    assert [len(b) for b in blocks] == [0] and fork.cache.offset == 10
    mx.eval(*fork.cache.state())
