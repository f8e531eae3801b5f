"""The family suite (issue 30): every family of tests/fakes/tiny_models.FAMILIES through the same lossless checks,
in every draft mode, on tiny checkpoints in each family's published layout.

Modes: n-gram lookup, DSpark (DeepSpec packaging with its own embedding and head; SpecForge packaging on the
target's), DFlash (the target's embedding and head), a draft model. Checks: greedy output equals plain decoding
(itself mlx-lm's own, margins asserted), budgets exact, sampled rounds distributed as the target, a speculative
second turn resumed from the prefix cache equal to a cold one. Batching and its refusal for speculation over
windows and recurrent state are in tests/integration/mlx/test_batching.py, over the same list.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.adapters.mlx.draft_model import DraftModelSource
from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.generation import GenerationService
from mlx_dspark.application.prefix_cache import PrefixCache
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.model import LoadedModel
from mlx_dspark.domain.tokens import FinishReason, SamplingParams, StopRule
from mlx_dspark.domain.verification.distribution import distribution, sample_index
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.tiny_models import FAMILIES, QUANTIZED, STATE, VOCAB, tiny_model
from tests.integration.drafters import helpers
from tests.integration.drafters.test_decode import run
from tests.integration.mlx import test_batching as batching
from tests.integration.mlx.test_prefix_cache_mlx import cold, generator
from tests.integration.mlx.test_prefix_cache_mlx import run as turn
from tests.integration.mlx.test_target_greedy import PROMPTS, model, reference
from tests.stats import chi_square_p_value

MODES = ("lookup", "dspark", "dspark-specforge", "dflash", "draft")


@functools.cache
def echo_prompt(family: str) -> tuple[int, ...]:
    """A prompt that quotes the model's own continuation, so lookup has n-grams to propose and some are right."""
    head = PROMPTS[0]
    return (*head, *reference(family, head)[:10], *head)


def make_source(mode: str, family: str, m: Any, tmp: Path) -> Any:
    n = len(m.layers)
    layers = (0, n - 1)
    if mode == "lookup":  # one-token matches too: a random model repeats few longer n-grams of its history
        return LookupDraftSource(block=6, min_n=1)
    if mode == "draft":
        if family in QUANTIZED:
            return DraftModelSource(tiny_model("llama", seed=5))  # a dense draft model of the same vocabulary
        # A close twin of the target: recurrent and convolutional twins rebuild their caches after a rejection.
        return DraftModelSource(helpers.perturbed(m, 0.3, seed=4))
    if mode == "dflash":
        path = helpers.write_dflash(tmp / mode, variant="v2", layer_ids=layers, num_target_layers=n, vocab=VOCAB)
        return load_drafter("dflash", str(path), m, bits=0)
    packaging = "specforge" if mode == "dspark-specforge" else "deepspec"
    path = helpers.write_dspark(
        tmp / mode, m, packaging=packaging, layer_ids=layers, num_target_layers=n, bigrams=transitions(family)
    )
    return load_drafter("dspark", str(path), m, bits=0)


@functools.cache
def transitions(family: str) -> np.ndarray:
    """[prev, next] scores from the model's own greedy continuations: the Markov head of a drafter that has
    learned this target a little (a random target's one-token logits say little about its next token)."""
    table = np.zeros((VOCAB, VOCAB), np.float32)
    for prompt in PROMPTS:
        seq = (*prompt, *reference(family, prompt))
        for a, b in zip(seq[len(prompt) - 1 :], seq[len(prompt) :]):
            table[a, b] += 8.0
    return table


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_draft_mode_decodes_exactly_as_plain(tmp_path: Path, family: str, mode: str) -> None:
    m = model(family)
    drafted, accepted = assert_decodes_as_plain(family, m, make_source(mode, family, m, tmp_path))
    assert drafted > 0
    if mode.startswith("dspark"):  # drafts from the model's own transitions: some are right, rows get kept
        assert accepted > 0


def assert_decodes_as_plain(family: str, m: Any, source: Any) -> tuple[int, int]:
    """Greedy decoding with `source` equals mlx-lm's own over 3 prompts x caps 1, 3 and the block, budgets
    exact; returns (drafted, accepted) over all of it."""
    accepted = drafted = 0
    for p_index, prompt in enumerate((PROMPTS[0], PROMPTS[1], echo_prompt(family))):
        want = reference(family, prompt)  # mlx-lm's own greedy continuation, no near-ties on it
        for c_index, cap in enumerate((1, 3, source.max_block)):
            budget = (40, 23, 7, 1)[(p_index + c_index) % 4]
            stop = StopRule(max_tokens=budget)
            got, rounds, fin = run(m, list(prompt), stop, source=source, cap_policy=FixedCap(cap))
            assert got == list(want[:budget]), (prompt, cap)
            assert fin.reason is FinishReason.LENGTH and fin.usage.generated_tokens == budget
            assert all(r.drafted <= cap for r in rounds)
            accepted += sum(r.accepted for r in rounds)
            drafted += sum(r.drafted for r in rounds)
    return drafted, accepted


class FixedProposal:
    """Samples drafts from a fixed q far from the target (device rows, as a neural drafter hands them over)."""

    def __init__(self) -> None:
        weights = [1.0 + (i * 37 % 11) for i in range(VOCAB)]
        total = sum(weights)
        self.q_row = [w / total for w in weights]

    def block(self, rng: random.Random, n: int) -> DraftBlock:
        drafts = tuple(sample_index(self.q_row, rng.random()) for _ in range(n))
        return DraftBlock(tokens=drafts, q=mx.array([self.q_row] * n))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sampled_round_emits_tokens_distributed_as_the_target(family: str) -> None:
    """Rejection sampling over each family's verify: the round's first token follows the target's p."""
    sampling = SamplingParams(temperature=1.0, top_k=6)
    m = model(family)
    target = MlxTargetModel(m)
    prompt = list(PROMPTS[1])
    anchor = target.prefill(prompt, sampling, 0.3)
    p = distribution(m(mx.array([[*prompt, anchor]]))[0, -1].tolist(), sampling)
    proposal, rng = FixedProposal(), random.Random(99)
    counts = [0] * VOCAB
    for _ in range(500):
        block = proposal.block(rng, 2)
        verdict = target.verify(anchor, block, sampling, [rng.random() for _ in range(3)])
        target.commit(0)
        counts[(*block.tokens[: verdict.accepted], verdict.next_token)[0]] += 1
    assert target.cached_tokens == len(prompt)
    assert chi_square_p_value(counts, p) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_a_speculative_second_turn_resumes_from_the_prefix_cache(tmp_path: Path, family: str) -> None:
    m = model(family)
    source = make_source("dspark-specforge", family, m, tmp_path)
    gen = generator(family, PrefixCache(10**9), source=source, model=m)
    system = list(PROMPTS[2])  # 20 tokens: past the 8-token sliding windows
    first = turn(gen, [*system, 5, 6], 6, boundaries=[len(system)])
    prompt2 = [*system, 5, 6, *first.token_ids, 7, 8]
    second = turn(gen, prompt2, 8)
    assert second.cached_prompt_tokens >= len(system), family
    fresh = generator(family, None, source=make_source("dspark-specforge", family, m, tmp_path / "cold"), model=m)
    assert list(second.token_ids) == list(cold(fresh, prompt2, 8).token_ids), family


@pytest.mark.parametrize("family", [f for f in FAMILIES if STATE[f] == "kv"])
def test_speculative_rows_of_a_kv_family_batch_and_each_equals_its_solo_run(tmp_path: Path, family: str) -> None:
    """Families whose cache can cut one row back batch speculative rows (the others are refused, in
    tests/integration/mlx/test_batching.py, and serve speculation one request at a time)."""
    m = model(family)

    def service() -> GenerationService:
        target = MlxTargetModel(m, prefill_chunk=4)
        loaded = LoadedModel(
            name="tiny", identity=f"tiny-{family}", target=target, tokenizer=batching.IdTokenizer(),
            context_window=4096, family=family,
        )  # fmt: skip
        source = make_source("dspark-specforge", family, m, tmp_path)
        target.configure_capture(tuple(source.target_layer_ids))
        return GenerationService(
            loaded, source=source, mode="dspark", clock=FakeClock(), telemetry=RecordingTelemetrySink(),
            cap_policy_factory=lambda: FixedCap(4),
        )  # fmt: skip

    reqs = batching.requests(4, sampled=False, seed=3)
    jobs = [batching.Job(r) for r in reqs]
    engine = batching.run_batched(service(), jobs, max_batch=8, join_every=2)
    alone = service()
    for job, req in zip(jobs, reqs):
        assert job.ended == "end", job.error
        want = alone.generate(req)
        assert (job.tokens(), job.result().finish_reason) == (want.token_ids, want.finish_reason)
    assert engine.widest > 1 and engine.drafting_steps > 0
