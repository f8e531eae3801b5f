"""Greedy speculative decoding over MlxTargetModel equals plain decoding and mlx-lm's own generate_step.

Every family of tests/fakes/tiny_models.py, several prompts and caps, drafts that are right, partly wrong
or random; gemma3_text runs far past its 8-token sliding window, qwen3_5 rolls back gated DeltaNet state.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlx_dspark.adapters.mlx import caches as cache_ops
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import decode
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.events import Finished, TokensCommitted
from mlx_dspark.domain.tokens import FinishReason, SamplingParams, StopRule
from tests.fakes.clock import FakeClock
from tests.fakes.drafts import RandomDraftSource
from tests.fakes.tiny_models import FAMILIES, GEMMA_WINDOW, VOCAB, tiny_model

GREEDY = SamplingParams()
PROMPTS = ((3, 17, 99, 5, 42), (7, 1, 150, 33, 8, 64, 2, 90, 11, 5, 130, 77), tuple(range(40, 60)))
MAX_NEW = 40
MIN_MARGIN = 1e-4  # smallest top-1/top-2 logprob gap allowed on a reference path (float noise is ~1e-6)


@functools.cache
def model(family: str):
    return tiny_model(family, seed=0)


@functools.cache
def reference(family: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
    """mlx-lm's own greedy continuation; asserts it has no near-ties that float noise could flip."""
    out = []
    for token, logprobs in generate_step(
        mx.array(prompt), model(family), max_tokens=MAX_NEW, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        top2 = mx.sort(logprobs)[-2:].tolist()
        assert top2[1] - top2[0] > MIN_MARGIN, "a near-tie on the reference path: pick another seed"
        out.append(int(token))
    return tuple(out)


class ContinuationDraftSource:
    """Proposes the reference continuation after the history, corrupted where `right(round, slot)` is False.

    Every `skip`-th round proposes nothing, so one-token (plain) rounds follow rollbacks: the step where a
    rotating cache that kept rejected rows goes wrong (peer-lessons §2.3). Also checks the feature
    contract: the rows handed over so far always equal the cached positions.
    """

    def __init__(
        self,
        prompt: Sequence[int],
        continuation: Sequence[int],
        right: Callable[[int, int], bool],
        block: int,
        skip: int = 0,
    ):
        self._full = [*prompt, *continuation]
        self._right = right
        self._block = block
        self._skip = skip
        self.round = 0
        self.feature_rows = 0

    name = "continuation"
    uses_features = True

    @property
    def max_block(self) -> int:
        return self._block

    def begin(self, prompt: Sequence[int]) -> None:
        self.round = 0
        self.feature_rows = 0

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        if self.uses_features:
            assert ctx.features is not None and ctx.features.dtype == mx.float32
            self.feature_rows += ctx.features.shape[0]
            assert self.feature_rows == ctx.position
        assert list(ctx.history) == self._full[: len(ctx.history)]
        start = len(ctx.history)
        out = []
        self.round += 1
        if self._skip and self.round % self._skip == 0:
            return DraftBlock(source=self.name)
        for slot in range(cap):
            tok = self._full[start + slot] if start + slot < len(self._full) else 0
            if not self._right(self.round, slot):
                tok = (tok + 1 + slot) % VOCAB
            out.append(tok)
        return DraftBlock(tokens=tuple(out), source=self.name)


def pattern(kind: str, seed: int = 0) -> Callable[[int, int], bool]:
    rng = random.Random(seed)
    table: dict[tuple[int, int], bool] = {}
    rules: dict[str, Callable[[int, int], bool]] = {
        "all": lambda r, i: True,
        "none": lambda r, i: False,
        "alternate": lambda r, i: (r + i) % 2 == 0,
        "first-only": lambda r, i: i == 0,
        "random": lambda r, i: table.setdefault((r, i), rng.random() < 0.6),
    }
    return rules[kind]


def run(target, prompt, stop, source=None, sampling=GREEDY):
    tokens, finished = [], None
    for ev in decode(target, list(prompt), sampling, stop, FakeClock(), source=source):
        if isinstance(ev, TokensCommitted):
            tokens.extend(ev.tokens)
            # After every commit the cache holds exactly the committed rows (the last token is the anchor).
            assert target.cached_tokens == len(prompt) + len(tokens) - 1
        elif isinstance(ev, Finished):
            finished = ev
    assert finished is not None
    assert finished.usage.generated_tokens == len(tokens) <= stop.max_tokens
    return tokens, finished


CASES = [
    ("random", 1, 0),
    ("alternate", 3, 3),
    ("first-only", 6, 2),
    ("all", 4, 0),
    ("none", 2, 4),
    ("random", 5, 3),
    ("random-drafts", 5, 0),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_plain_and_mlx_lm(family):
    target = MlxTargetModel(model(family), capture_layers=(0, 1))
    for p_index, prompt in enumerate(PROMPTS):
        ref = list(reference(family, prompt))
        plain, fin = run(target, prompt, StopRule(max_tokens=MAX_NEW))
        assert plain == ref
        assert fin.reason is FinishReason.LENGTH
        for c_index, (kind, cap, skip) in enumerate(CASES):
            max_tokens = (MAX_NEW, 23, 7, 1)[(p_index + c_index) % 4]
            if kind == "random-drafts":
                source = RandomDraftSource(VOCAB, block=cap, seed=p_index)
            else:
                source = ContinuationDraftSource(prompt, ref, pattern(kind, seed=p_index), block=cap, skip=skip)
            got, fin = run(target, prompt, StopRule(max_tokens=max_tokens), source=source)
            assert got == ref[:max_tokens], (prompt, kind, cap)
            assert fin.reason is FinishReason.LENGTH


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_inside_an_accepted_block_ends_generation_there(family):
    prompt = PROMPTS[1]
    ref = list(reference(family, prompt))
    eos = ref[9]
    cut = ref.index(eos)
    target = MlxTargetModel(model(family))
    source = ContinuationDraftSource(prompt, ref, pattern("all"), block=8)
    source.uses_features = False  # exercises the path where the loop never asks for features
    got, fin = run(target, prompt, StopRule(max_tokens=MAX_NEW, eos_ids=frozenset({eos})), source=source)
    assert got == ref[:cut]
    assert fin.reason is FinishReason.STOP


def test_gemma_past_the_window_really_needs_the_exact_rollback(monkeypatch):
    """The same scenario with mlx-lm's bare RotatingKVCache.trim (the peer's rollback) goes wrong."""
    family = "gemma3_text"
    prompt = PROMPTS[2]
    assert len(prompt) + MAX_NEW > 3 * GEMMA_WINDOW
    ref = list(reference(family, prompt))
    source = ContinuationDraftSource(prompt, ref, pattern("first-only"), block=4, skip=2)
    got, _ = run(
        MlxTargetModel(model(family), capture_layers=(3,)), prompt, StopRule(max_tokens=MAX_NEW), source=source
    )
    assert got == ref

    def bare_trim(cache, n, apply):
        if apply:
            cache.trim(n)
        return True

    monkeypatch.setattr(cache_ops, "_rotating_cut", bare_trim)
    source = ContinuationDraftSource(prompt, ref, pattern("first-only"), block=4, skip=2)
    wrong = []
    for ev in decode(
        MlxTargetModel(model(family), capture_layers=(3,)),
        list(prompt),
        GREEDY,
        StopRule(max_tokens=MAX_NEW),
        FakeClock(),
        source=source,
    ):
        if isinstance(ev, TokensCommitted):
            wrong.extend(ev.tokens)
        if wrong != ref[: len(wrong)]:
            break
    assert wrong != ref[: len(wrong)]


def test_quantized_kv_cache_rolls_back_exactly():
    prompt = PROMPTS[1]
    target = MlxTargetModel(tiny_model("llama", seed=1, head_dim=32), kv_bits=8, kv_group_size=32)
    assert all(type(c).__name__ == "QuantizedKVCache" for c in target._caches)
    plain, _ = run(target, prompt, StopRule(max_tokens=30))
    for kind, cap in (("alternate", 3), ("random", 5)):
        source = ContinuationDraftSource(prompt, plain, pattern(kind, seed=4), block=cap)
        source.uses_features = False
        got, _ = run(target, prompt, StopRule(max_tokens=30), source=source)
        assert got == plain
