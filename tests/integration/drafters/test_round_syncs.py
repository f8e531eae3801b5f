"""A speculative round waits on the device once, and closing a speculative decode leaves the cache exact.

Every host readback of an MLX array (`item`, `tolist`, `int()`/`float()`/`bool()` of an array, `mx.eval`)
is counted while the real decode loop runs; `mx.async_eval` queues work without waiting and is not
counted. The drafters queue their tokens, the target's verify reads them back with its verdict. The tiny
models stay below the CPU kernels' sizes (adapters/mlx/cpu_kernels.py), whose NumPy attention reads its
inputs mid-forward at long contexts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import decode
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.events import DecodeEvent, RoundFinished, TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.decoding import collect
from tests.fakes import tiny_models
from tests.fakes.clock import FakeClock
from tests.integration.drafters import helpers

SAMPLINGS = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, top_p=0.95, seed=3)}
READBACKS = ("item", "tolist", "__int__", "__float__", "__bool__")


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    count = [0]

    def counted(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in READBACKS:
        monkeypatch.setattr(mx.array, name, counted(getattr(mx.array, name)))
    monkeypatch.setattr(mx, "eval", counted(mx.eval))
    return count


def per_round(events: Iterator[DecodeEvent], count: list[int]) -> list[tuple[int, int]]:
    """(drafted, readbacks) of each round, counted from the prefill's token on."""
    out: list[tuple[int, int]] = []
    mark: int | None = None
    for ev in events:
        if mark is None and isinstance(ev, TokensCommitted):
            mark = count[0]
        elif isinstance(ev, RoundFinished):
            assert mark is not None
            out.append((ev.drafted, count[0] - mark))
            mark = count[0]
    return out


@functools.cache
def _dspark(tmp: Path, confidence: float = 0.0) -> tuple[Any, Any]:
    target = helpers.tiny_target("qwen3", seed=2)
    path = helpers.write_dspark(tmp / f"dspark-{confidence}", target, seed=11)
    return target, load_drafter("dspark", str(path), target, bits=0, confidence_threshold=confidence)


def _source(kind: str, tmp: Path) -> tuple[Any, Any]:
    if kind == "dspark":
        return _dspark(tmp)
    if kind == "dspark-confidence":
        return _dspark(tmp, 0.3)
    target = helpers.tiny_target("qwen3", seed=2)
    if kind == "dflash":
        return target, load_drafter("dflash", str(helpers.write_dflash(tmp / "dflash")), target, bits=0)
    return target, LookupDraftSource(block=6, min_n=1)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("drafters")


# A prompt that repeats itself, so lookup finds continuations too.
PROMPT = [5, 9, 14, 3, 7, 5, 9, 14, 3, 7, 5, 9]


@pytest.mark.parametrize("mode", list(SAMPLINGS))
@pytest.mark.parametrize("kind", ["dspark", "dflash", "lookup"])
def test_a_speculative_round_reads_back_once(kind: str, mode: str, tmp: Path, syncs: list[int]) -> None:
    model, source = _source(kind, tmp)
    target = MlxTargetModel(model)
    if source.uses_features:
        target.configure_capture(source.target_layer_ids)
    events = decode(target, PROMPT, SAMPLINGS[mode], StopRule(max_tokens=40), FakeClock(), source=source)
    rounds = per_round(events, syncs)
    assert any(drafted for drafted, _ in rounds), "no round drafted: the test would prove nothing"
    # Every round reads its tokens back exactly once, speculative or plain.
    assert [n for _, n in rounds] == [1] * len(rounds), rounds


def test_a_confidence_threshold_adds_its_one_read(tmp: Path, syncs: list[int]) -> None:
    """The block's width depends on the confidences, so they are read before the verify: two waits."""
    model, source = _source("dspark-confidence", tmp)
    target = MlxTargetModel(model)
    target.configure_capture(source.target_layer_ids)
    rounds = per_round(
        decode(target, PROMPT, SamplingParams(), StopRule(max_tokens=30), FakeClock(), source=source), syncs
    )
    assert any(drafted for drafted, _ in rounds)
    # A round that drafts reads twice; the last one, left no room to draft by the budget, reads once.
    assert all(n == 2 for drafted, n in rounds if drafted) and all(n <= 2 for _, n in rounds), rounds


def _snapshot_case(tmp: Path) -> tuple[Any, Any]:
    """Gated DeltaNet layers: rejected rows are undone by restoring a checkpoint and replaying."""
    model = tiny_models.tiny_model("qwen3_5", 0)
    n = len(model.layers)
    path = helpers.write_dflash(tmp / "dflash-q35", layer_ids=(0, n - 1), num_target_layers=n, vocab=tiny_models.VOCAB)
    return model, load_drafter("dflash", str(path), model, bits=0)


@pytest.mark.parametrize("mode", list(SAMPLINGS))
@pytest.mark.parametrize("kind", ["dspark", "snapshot"])
def test_closing_a_speculative_decode_leaves_the_cache_exact(kind: str, mode: str, tmp: Path) -> None:
    model, source = _snapshot_case(tmp) if kind == "snapshot" else _source(kind, tmp)
    params = SAMPLINGS[mode]
    target = MlxTargetModel(model)
    target.configure_capture(source.target_layer_ids)
    prompt = PROMPT[:7]
    events = decode(target, prompt, params, StopRule(max_tokens=60), FakeClock(), source=source, cap_policy=FixedCap(4))
    got: list[int] = []
    speculative = rejected = 0
    for ev in events:
        if isinstance(ev, RoundFinished):
            speculative += ev.drafted > 0
            rejected += ev.accepted < ev.drafted
        if isinstance(ev, TokensCommitted):
            got.extend(ev.tokens)
            # Closed inside a round: after its commit, before its RoundFinished.
            if speculative >= 3 and rejected >= 1:
                break
    assert speculative >= 3 and rejected >= 1, "the rounds must draft and roll back before the close"
    events.close()
    assert target.cached_tokens == len(prompt) + len(got) - 1  # the newest token has no row yet
    assert list(target.cached_ids) == [*prompt, *got[:-1]]

    # The next request reuses those rows and decodes what a fresh target decodes.
    follow = [*prompt, *got, 11, 12]
    stop = StopRule(max_tokens=12)
    reuse = len(prompt) + len(got)
    if params.greedy:  # greedy with the drafter equals plain decoding token for token
        reused, rounds, fin = collect(
            decode(target, follow, params, stop, FakeClock(), source=source, reuse_prefix=reuse)
        )
        assert fin.usage.cached_prompt_tokens == reuse - 1
        assert any(r.drafted for r in rounds)
    else:  # sampled: the same uniforms on an exact cache give the same tokens as a fresh target's
        reused, _, fin = collect(decode(target, follow, params, stop, FakeClock(), reuse_prefix=reuse))
        assert fin.usage.cached_prompt_tokens == reuse - 1
    fresh, _, _ = collect(decode(MlxTargetModel(model), follow, params, stop, FakeClock()))
    assert reused == fresh
