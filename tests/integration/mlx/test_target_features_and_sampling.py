"""MlxTargetModel details: feature layout and content, per-instance taps, sampled decoding (chunked prefill:
test_chunked_prefill.py)."""

from __future__ import annotations

import functools
import random

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask

from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import decode
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.events import TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from mlx_dspark.domain.verification.distribution import distribution, sample_index
from tests.fakes.clock import FakeClock
from tests.fakes.drafts import RandomDraftSource
from tests.fakes.tiny_models import FAMILIES, HIDDEN, VOCAB, tiny_model
from tests.stats import chi_square_p_value

PROMPT = [5, 77, 13, 140, 2, 9, 31, 64, 100, 7, 18]


@functools.cache
def model(family: str):
    return tiny_model(family, seed=1)


def generate(target, prompt, sampling, max_tokens, source=None):
    out = []
    for ev in decode(target, prompt, sampling, StopRule(max_tokens=max_tokens), FakeClock(), source=source):
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
    return out


def test_features_concatenate_the_configured_layers_in_order():
    """llama by hand: embedding output (-1), then the outputs of layers 2 and 0, along features."""
    m = model("llama")
    target = MlxTargetModel(m, capture_layers=(-1, 2, 0))
    assert (target.hidden_size, target.num_layers, target.vocab_size) == (HIDDEN, 3, VOCAB)
    target.prefill(PROMPT, SamplingParams(), 0.5)
    got = target.take_features()
    assert got.shape == (len(PROMPT), 3 * HIDDEN) and got.dtype == mx.float32

    h = m.model.embed_tokens(mx.array(PROMPT)[None])
    mask = create_attention_mask(h, None)
    states = [h]
    for layer in m.model.layers:
        h = layer(h, mask, None)
        states.append(h)
    expected = mx.concatenate([states[0][0], states[3][0], states[1][0]], axis=-1)
    assert mx.allclose(got, expected, atol=1e-4).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_features_after_speculative_rounds_equal_a_fresh_prefill(family):
    """Rows handed out round by round (anchor + accepted) are the rows a single prefill computes."""
    target = MlxTargetModel(model(family), capture_layers=(0, 1))
    source = RandomDraftSource(VOCAB, block=3, seed=2)
    source.uses_features = True
    out = generate(target, PROMPT, SamplingParams(), 25, source=source)
    target.take_features()  # rows since the last round are not needed here
    history = [*PROMPT, *out][: target.cached_tokens]

    fresh = MlxTargetModel(model(family), capture_layers=(0, 1))
    fresh.prefill(history, SamplingParams(), 0.5)
    expected = fresh.take_features()

    target.reset(target.cached_tokens)  # reuse everything: the next call returns all rows
    got = target.take_features()
    assert got.shape == expected.shape == (len(history), 2 * HIDDEN)
    assert mx.allclose(got, expected, atol=1e-4).item()


def test_taps_are_per_instance_and_keep_parameter_names():
    m = tiny_model("qwen3", seed=4)
    other = tiny_model("qwen3", seed=4)
    names = [k for k, _ in tree_flatten(m.parameters())]
    original = type(other.layers[0])
    MlxTargetModel(m, capture_layers=(1,), fuse=False)  # fused projections rename theirs (test_fused_projections)
    assert [k for k, _ in tree_flatten(m.parameters())] == names
    assert type(other.layers[0]) is original  # the class itself is untouched
    assert isinstance(m.layers[0], original)
    # The untouched twin still computes exactly what the tapped model computes.
    x = mx.array([[1, 2, 3]])
    assert mx.array_equal(m(x), other(x)).item()


def test_configure_capture_validates_and_starts_fresh():
    target = MlxTargetModel(model("llama"))
    assert target.take_features() is None
    target.prefill(PROMPT, SamplingParams(), 0.5)
    with pytest.raises(ValueError):
        target.configure_capture((3,))
    with pytest.raises(ValueError):
        target.configure_capture((-2,))
    target.configure_capture((2, 0))
    assert target.capture_layers == (2, 0)
    assert target.cached_tokens == 0


class ProposalSource:
    """Samples drafts from a fixed q far from the target (on device rows, like a neural drafter)."""

    def __init__(self, block: int = 3) -> None:
        weights = [1.0 + (i * 37 % 11) for i in range(VOCAB)]
        total = sum(weights)
        self.q_row = [w / total for w in weights]
        self._block = block

    name = "proposal"
    uses_features = False

    @property
    def max_block(self) -> int:
        return self._block

    def begin(self, prompt) -> None:
        pass

    def propose(self, ctx, cap, sampling, uniforms):
        tokens = tuple(sample_index(self.q_row, u) for u in uniforms[:cap])
        return DraftBlock(tokens=tokens, q=mx.array([self.q_row] * cap), source=self.name)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_decoding_is_reproducible_with_a_seed(family):
    sampling = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    target = MlxTargetModel(model(family))
    for make_source in (lambda: None, ProposalSource, lambda: RandomDraftSource(VOCAB, block=4, seed=1)):
        first = generate(target, PROMPT, sampling, 30, source=make_source())
        second = generate(target, PROMPT, sampling, 30, source=make_source())
        assert first == second
        assert len(first) == 30


@pytest.mark.parametrize("with_q", [False, True])
def test_verify_emits_tokens_distributed_as_the_target(with_q):
    """The first token a sampled round emits follows the target's distribution after the anchor."""
    sampling = SamplingParams(temperature=1.0, top_k=6)
    m = model("llama")
    target = MlxTargetModel(m)
    anchor = target.prefill(PROMPT, sampling, 0.3)
    logits = m(mx.array([[*PROMPT, anchor]]))[0, -1].tolist()
    p = distribution(logits, sampling)
    source = ProposalSource()
    rng = random.Random(99)
    counts = [0] * VOCAB
    for _ in range(800):
        if with_q:
            drafts = tuple(sample_index(source.q_row, rng.random()) for _ in range(2))
            block = DraftBlock(tokens=drafts, q=mx.array([source.q_row] * 2))
        else:  # one-hot proposals, half of them the target's likely tokens
            likely = sorted(range(VOCAB), key=lambda i: -p[i])[:3]
            block = DraftBlock(tokens=(rng.choice(likely), rng.randrange(VOCAB)))
        verdict = target.verify(anchor, block, sampling, [rng.random() for _ in range(3)])
        target.commit(0)
        counts[(*block.tokens[: verdict.accepted], verdict.next_token)[0]] += 1
    assert target.cached_tokens == len(PROMPT)
    assert chi_square_p_value(counts, p) > 1e-3
