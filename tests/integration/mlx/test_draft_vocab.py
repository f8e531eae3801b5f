"""A draft model's draft vocabulary: the reduced head computes the full head's columns, drafts stay inside it,
greedy output equals plain decoding and sampled output keeps the target's law; the vocabulary is counted once and
cached; a model whose forward is more than decoder + head keeps its whole head."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlx_dspark.adapters.hf import draft_vocab
from mlx_dspark.adapters.hf.loader import HfModelLoader
from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.draft_model import DraftModelSource
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.settings import ModelSettings, load_settings
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.model import LoadedModel
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.fakes.tiny_models import tiny_model
from tests.integration.drafters import helpers
from tests.integration.drafters.test_decode import exact_joint, pooled_p_value, run
from tests.integration.mlx.test_draft_model_source import greedy_equals_plain


@pytest.fixture(scope="module")
def target() -> Any:
    return helpers.tiny_target("qwen3", seed=2)


def some_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    return sorted(random.Random(seed).sample(range(vocab), n))


@pytest.mark.parametrize("layout", ["tied", "untied", "quantized", "gemma4_text", "muse_glimmer"])
def test_the_reduced_head_computes_the_full_heads_columns(layout: str) -> None:
    if layout in ("gemma4_text", "muse_glimmer"):  # a final softcap; an output multiplier too
        model = tiny_model(layout, seed=1)
        assert model_parts.final_logit_softcap(model)
    else:
        model = tiny_model("llama" if layout == "untied" else "qwen3", seed=1)
        if layout == "quantized":
            nn.quantize(model, group_size=32, bits=4)
    vocab = model_parts.vocab_size(model)
    ids = mx.array(some_ids(vocab, vocab // 3))
    head = model_parts.head_subset(model, ids)
    assert head is not None
    h = mx.random.normal((3, model_parts.hidden_size(model)), key=mx.random.key(0))
    want = model_parts.lm_head(model, h)[:, ids]
    np.testing.assert_allclose(np.array(head(h)), np.array(want), rtol=1e-5, atol=1e-5)
    # The decoder + head path is the model's own forward.
    tokens = mx.array([[1, 5, 9, 2]])
    np.testing.assert_allclose(
        np.array(head(model_parts.final_hidden(model, tokens, None))[0]),
        np.array(model(tokens)[0][:, ids]),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize("kind", ["close", "recurrent"])
@pytest.mark.parametrize("cap", [1, 4])
def test_greedy_output_with_a_draft_vocabulary_equals_plain_decoding(target: Any, kind: str, cap: int) -> None:
    draft = (
        helpers.perturbed(target, 0.3, seed=4)
        if kind == "close"
        else tiny_model("qwen3_5", seed=3, vocab_size=helpers.VOCAB)
    )
    ids = some_ids(helpers.VOCAB, 80, seed=cap)
    source = DraftModelSource(draft, vocab_ids=ids)
    assert source.draft_vocab_size == 80 and ":vocab=80" in source.identity
    for text in greedy_equals_plain(target, source, kind, cap):
        ctx = DraftContext(anchor=text[-1], position=len(text) - 1, history=text)
        assert set(source.propose(ctx, cap, SamplingParams(), []).tokens) <= set(ids)


def test_greedy_drafts_are_the_argmax_over_the_draft_vocabulary(target: Any) -> None:
    draft = helpers.perturbed(target, 0.3, seed=4)
    ids = some_ids(helpers.VOCAB, 40, seed=7)
    history = [3, 9, 27, 81]
    block = DraftModelSource(draft, vocab_ids=ids).propose(
        DraftContext(anchor=81, position=3, history=history), 1, SamplingParams(), []
    )
    logits, _ = helpers.target_forward(draft, history)
    row = np.array(logits[-1])
    assert block.tokens == (ids[int(np.argmax(row[ids]))],)


def test_sampled_output_with_a_draft_vocabulary_is_distributed_as_the_target() -> None:
    """q is the draft model's law over the draft vocabulary, zero elsewhere: what the drafts are drawn from, so the
    first 3 tokens keep the target's exact joint law (drafts never propose the tokens outside)."""
    vocab = 16
    model = helpers.tiny_target("qwen3", seed=5, vocab=vocab)
    ids = [0, 2, 3, 5, 7, 8, 11, 12, 14, 15]
    source = DraftModelSource(helpers.perturbed(model, 0.5, seed=6), vocab_ids=ids)
    prompt = [3, 7]
    sampling = SamplingParams(temperature=2.0)
    block = source.propose(DraftContext(anchor=7, position=1, history=prompt), 2, sampling, [0.3, 0.6])
    q = np.array(block.q)
    outside = [t for t in range(vocab) if t not in ids]
    assert np.all(q[:, outside] == 0) and np.allclose(q.sum(axis=-1), 1.0, atol=1e-5)
    joint = exact_joint(model, prompt, sampling, 3)
    observed: Counter[tuple[int, ...]] = Counter()
    accepted = rejected = 0
    for i in range(400):
        s = SamplingParams(temperature=2.0, seed=i)
        got, rounds, _ = run(model, prompt, StopRule(max_tokens=3), source=source, sampling=s, cap_policy=FixedCap(2))
        observed[tuple(got)] += 1
        accepted += sum(r.accepted for r in rounds)
        rejected += sum(r.drafted - r.accepted for r in rounds)
    assert accepted > 0 and rejected > 0
    assert set(observed) <= set(joint)
    assert any(t in outside for seq in observed for t in seq[1:])  # the target still says what drafts cannot
    assert pooled_p_value(observed, joint) > 1e-3


class _Shifted(nn.Module):
    """A model whose forward adds to its head's logits: decoder + head is not its forward."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.args = inner.args
        self.model = inner.model

    def __call__(self, tokens: mx.array, cache: Any = None) -> mx.array:
        return self.inner(tokens, cache=cache) + mx.arange(helpers.VOCAB, dtype=mx.float32)

    @property
    def layers(self) -> Any:
        return self.inner.layers

    def make_cache(self) -> Any:
        return self.inner.make_cache()


def test_a_forward_that_is_more_than_decoder_and_head_keeps_the_whole_head(target: Any) -> None:
    source = DraftModelSource(_Shifted(target), vocab_ids=some_ids(helpers.VOCAB, 60))
    assert source.draft_vocab_size == helpers.VOCAB and ":vocab" not in source.identity
    # All of the vocabulary, or nothing inside it, is no reduction either.
    assert DraftModelSource(target, vocab_ids=range(helpers.VOCAB)).draft_vocab_size == helpers.VOCAB
    assert DraftModelSource(target, vocab_ids=[helpers.VOCAB + 5]).draft_vocab_size == helpers.VOCAB


class _Tokenizer:
    """Characters as tokens (ord mod vocab), two added tokens; counts its encodes."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.calls = 0
        self.special_ids = (vocab - 1,)
        self.eos_ids = frozenset({vocab - 2})

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return [ord(c) % (self.vocab - 2) for c in text]


@pytest.fixture
def small_corpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(draft_vocab, "CORPUS_BYTES", 300_000)


@pytest.mark.usefixtures("small_corpus")
def test_the_vocabulary_is_the_most_used_tokens_counted_once_and_cached(tmp_path: Path) -> None:
    tok = _Tokenizer(128)
    ids = draft_vocab.draft_vocabulary(tok, "m@1", 128, 40, tmp_path)
    assert len(ids) == 40 and list(ids) == sorted(ids)
    assert {126, 127} <= set(ids)  # EOS and special tokens are always in
    counts = draft_vocab.count_tokens(lambda texts: [tok.encode(t) for t in texts], draft_vocab.corpus_texts())
    top = sorted(counts, key=lambda t: (-counts[t], t))[:38]
    assert set(top) <= set(ids)  # the rest are the corpus's most frequent
    assert ord(" ") % 126 in ids and ord("e") % 126 in ids
    calls = tok.calls
    assert draft_vocab.draft_vocabulary(tok, "m@1", 128, 40, tmp_path) == ids and tok.calls == calls  # cached
    [entry] = (tmp_path / "draft-vocab").glob("*.json")
    entry.write_text("{not json")
    assert draft_vocab.draft_vocabulary(tok, "m@1", 128, 40, tmp_path) == ids and tok.calls > calls  # recounted
    assert json.loads(entry.read_text())["ids"] == list(ids)
    assert draft_vocab.draft_vocabulary(tok, "m@1", 128, 20, tmp_path) != ids  # another size, another entry


def test_who_gets_a_draft_vocabulary() -> None:
    assert draft_vocab.wanted_size(151936, None) == 0  # not asked for: the whole head (it measured even)
    assert draft_vocab.wanted_size(151936, 0) == 0  # asked for none
    assert draft_vocab.wanted_size(151936, 32768) == 32768
    assert draft_vocab.wanted_size(49152, 8192) == 8192  # asked for one
    assert draft_vocab.wanted_size(100, 500) == 0  # as large as the vocabulary: none
    assert draft_vocab.ranked(Counter({5: 3, 6: 3, 7: 9, 200: 50}), 3, {1}, 100) == (1, 5, 7)  # ties by id
    with pytest.raises(InvalidRequest, match="draft_vocab must be >= 0"):
        load_settings({"draft_vocab": "-1"})


@pytest.mark.usefixtures("small_corpus")
def test_the_loader_gives_a_draft_model_the_configured_vocabulary(tmp_path: Path, target: Any) -> None:
    draft = LoadedModel(
        name="tiny", identity="tiny@test", target=MlxTargetModel(helpers.perturbed(target, 0.3, seed=4)),
        tokenizer=_Tokenizer(helpers.VOCAB), context_window=256, family="qwen3",
    )  # fmt: skip

    def source(**given: Any) -> Any:
        return HfModelLoader(ModelSettings(cache_dir=str(tmp_path), **given)).draft_model_source(draft)

    assert source().draft_vocab_size == helpers.VOCAB  # not asked for: the whole head
    reduced = source(draft_vocab=50)
    assert reduced.draft_vocab_size == 50 and reduced.identity != source().identity  # calibrated apart
    assert source(draft_vocab=0).draft_vocab_size == helpers.VOCAB


class _StepClock:
    """Time that moves one second per draft-model forward: a propose then costs the forwards it ran."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


def test_calibration_times_full_blocks_of_a_draft_model_with_a_stop(
    target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random context leaves a draft model unsure, so its stop ends every block after one draft; calibration
    must time `cap` drafts at each cap (it timed one draft at every cap before, and the cap policy then drafted
    long blocks that cost several times what it expected)."""
    from mlx_dspark.application.calibration import CalibrationPlan, measure_drafter

    clock = _StepClock()
    inner = DraftModelSource._step

    def counted(self: DraftModelSource, tokens: mx.array) -> mx.array:
        clock.t += 1.0
        return inner(self, tokens)

    monkeypatch.setattr(DraftModelSource, "_step", counted)
    unsure = helpers.tiny_target("qwen3", seed=11, bigram=False)  # flat distributions: every draft below 0.9
    source = DraftModelSource(unsure, confidence_threshold=0.9)
    history = list(range(1, 13))
    block = source.propose(DraftContext(anchor=12, position=11, history=history), 4, SamplingParams(), [])
    assert len(block.tokens) == 1  # unsure: its stop ends the block at once
    twin = source.without_stop()
    assert twin.confidence_threshold == 0 and source.confidence_threshold == 0.9
    stream = [random.Random(0).randrange(helpers.VOCAB) for _ in range(40)]
    draft_s = measure_drafter(
        MlxTargetModel(target), source, stream, clock, max_cap=4, depth=8, plan=CalibrationPlan(warmup=0, repeats=1)
    )
    assert draft_s == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}  # one forward per draft (the first feeds the anchor)
    assert source.confidence_threshold == 0.9  # the measured source keeps its stop
