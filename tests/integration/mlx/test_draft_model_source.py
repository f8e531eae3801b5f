"""The draft-model source (`--mode draft`): a small model of the target's vocabulary drafting from its own KV
cache. Greedy output equals plain decoding whatever the draft model (perfect, close, random, recurrent,
convolutional), its cache rolls back exactly, sampled output is distributed as the target's, and its drafts follow
the q it reports.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.adapters.mlx.draft_model import MAX_BLOCK, DraftModelSource, shared_prefix
from mlx_dspark.application import bootstrap
from mlx_dspark.application.calibration import drafter_identity
from mlx_dspark.application.draft_models import check_shared_vocabulary
from mlx_dspark.application.generation import GenerationRequest
from mlx_dspark.application.modes import auto_candidates, build_generator
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.tokens import FinishReason, SamplingParams, StopRule
from mlx_dspark.entrypoints.cli import bench
from tests.fakes.clock import RecordingTelemetrySink
from tests.fakes.tiny_models import tiny_model
from tests.integration.calibration.timed_fakes import MemoryStore
from tests.integration.drafters import helpers
from tests.integration.drafters.test_decode import exact_joint, pooled_p_value, run
from tests.integration.mlx import test_mlx_lm_draft_reference as reference_suite
from tests.integration.mlx.test_mlx_lm_draft_reference import PairLoader


@pytest.fixture(scope="module")
def target() -> Any:
    return helpers.tiny_target("qwen3", seed=2)


def drafts_for(target: Any, kind: str) -> Any:
    if kind == "perfect":
        return target
    if kind == "close":
        return helpers.perturbed(target, 0.3, seed=4)
    if kind == "random":
        return helpers.tiny_target("qwen3", seed=11)
    # Recurrent (Gated DeltaNet) or short-convolution layers: the cache cannot trim, so every rejection rebuilds
    # it from the history.
    return tiny_model("qwen3_5" if kind == "recurrent" else "lfm2", seed=3, vocab_size=helpers.VOCAB)


KINDS = ["perfect", "close", "random", "recurrent", "conv"]


def test_the_shared_prefix() -> None:
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([], [1]) == 0
    assert shared_prefix([1, 2], [1, 2]) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_every_draft_model_scores_exactly_the_targets_ids(target: Any, kind: str) -> None:
    # A draft id past the target's vocabulary is read past its embedding table (MLX does not check bounds): a
    # qwen3_5 draft model of 192 logits against this 128-token target once left it decoding zeros, or not,
    # depending on what lay past the table (its vocab_size had gone to the top level of a nested config).
    logits = drafts_for(target, kind)(mx.array([[1, 2, 3]]))
    assert logits.shape[-1] == helpers.VOCAB


def test_the_shared_vocabulary_check_refuses_a_recurrent_draft_model_of_another_width() -> None:
    base = tiny_model("llama", seed=1, vocab_size=helpers.VOCAB)
    wide = tiny_model("qwen3_5", seed=3)  # its own 192 logits, read from its nested text config
    with pytest.raises(InvalidRequest, match="192 logits against 128"):
        check_shared_vocabulary(PairLoader._loaded("tiny", base), PairLoader._loaded("wide", wide))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cap", [1, 4, 9])
def test_greedy_output_equals_plain_decoding(target: Any, kind: str, cap: int) -> None:
    greedy_equals_plain(target, DraftModelSource(drafts_for(target, kind)), kind, cap)


def greedy_equals_plain(target: Any, source: DraftModelSource, kind: str, cap: int) -> list[list[int]]:
    """Three random prompts decoded with `source` at `cap` equal plain decoding; returns each prompt + output."""
    rng = random.Random(cap)
    texts: list[list[int]] = []
    drafted = accepted = 0
    for _ in range(3):
        prompt = [rng.randrange(helpers.VOCAB) for _ in range(rng.randint(1, 20))]
        stop = StopRule(max_tokens=rng.randint(10, 40))
        expected, _, _ = run(target, prompt, stop)
        got, rounds, fin = run(target, prompt, stop, source=source, cap_policy=FixedCap(cap))
        assert got == expected, (kind, prompt)
        assert fin.reason is FinishReason.LENGTH and fin.usage.generated_tokens == len(got) == stop.max_tokens
        assert all(r.drafted <= cap for r in rounds)
        drafted += sum(r.drafted for r in rounds)
        accepted += sum(r.accepted for r in rounds)
        # The draft model's cache holds exactly the committed tokens it has seen (its last drafts only where
        # they were accepted), so rollback left nothing stale behind.
        ids = source.cached_ids
        assert list(ids) == (prompt + got)[: len(ids)]
        texts.append(prompt + got)
    assert drafted > 0
    if kind == "perfect":
        assert accepted == drafted  # its own drafts: every one accepted
    if kind == "close":
        assert 0 < accepted < drafted  # a mix of accepted and rejected drafts: rollback exercised
    return texts


@pytest.mark.parametrize("kind", ["close", "recurrent", "conv"])
def test_the_rolled_back_cache_drafts_as_a_fresh_one(target: Any, kind: str) -> None:
    draft = drafts_for(target, kind)
    source = DraftModelSource(draft)
    prompt = [5, 9, 2, 7]
    got, rounds, _ = run(target, prompt, StopRule(max_tokens=30), source=source, cap_policy=FixedCap(5))
    assert any(r.drafted > r.accepted for r in rounds)
    history = [*prompt, *got]
    ctx = DraftContext(anchor=history[-1], position=len(history) - 1, history=history)
    block = source.propose(ctx, 5, SamplingParams(), [])
    fresh = DraftModelSource(draft)
    assert block.tokens == fresh.propose(ctx, 5, SamplingParams(), []).tokens


@pytest.mark.parametrize("vocab", [None, list(range(0, helpers.VOCAB, 2))])
def test_compiled_draft_steps_draft_what_eager_ones_do(
    target: Any, monkeypatch: pytest.MonkeyPatch, calls: list[int], vocab: list[int] | None
) -> None:
    # On the CPU its one-token steps run as a compiled graph (as the target's plain steps do): rounds of greedy
    # and sampled blocks, rolled back by a random amount, give the eager steps' drafts, and their q within float32
    # rounding (the compiled step attends over the padded buffer, masked).
    from mlx_dspark.adapters.mlx import compiled_forward

    draft = helpers.perturbed(target, 0.3, seed=4)
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(compiled_forward.STEPS_ENV, mode)
        source = DraftModelSource(draft, vocab_ids=vocab, confidence_threshold=0.1)
        rng = random.Random(5)
        history = [rng.randrange(helpers.VOCAB) for _ in range(300)]  # the cache crosses 256 rows below
        got = []
        for r in range(8):
            sampling = SamplingParams() if r % 2 else SamplingParams(temperature=0.9, top_p=0.9)
            ctx = DraftContext(anchor=history[-1], position=len(history) - 1, history=history)
            block = source.propose(ctx, 6, sampling, [rng.random() for _ in range(6)])
            got.append((block.tokens, None if block.q is None else np.array(block.q).tolist()))
            history = [*history, *block.tokens[: rng.randint(0, len(block))], rng.randrange(helpers.VOCAB)]
        out[mode] = got
        assert bool(calls) == (mode == "on") and set(calls) <= {1}
    for (tokens_on, q_on), (tokens_off, q_off) in zip(out["on"], out["off"], strict=True):
        assert tokens_on == tokens_off
        assert (q_on is None) == (q_off is None)
        if q_on is not None:
            assert np.allclose(q_on, q_off, atol=1e-5)


def test_a_fork_drafts_on_its_own_cache(target: Any) -> None:
    source = DraftModelSource(helpers.perturbed(target, 0.3, seed=4))
    twin = source.fork()
    assert twin.model is source.model
    a = [3, 1, 4, 1, 5]
    b = [9, 2, 6]
    ctx_a = DraftContext(anchor=a[-1], position=len(a) - 1, history=a)
    ctx_b = DraftContext(anchor=b[-1], position=len(b) - 1, history=b)
    alone = DraftModelSource(source.model).propose(ctx_a, 4, SamplingParams(), []).tokens
    assert len(twin.propose(ctx_b, 4, SamplingParams(), []).tokens) == 4
    assert source.propose(ctx_a, 4, SamplingParams(), []).tokens == alone
    assert twin.cached_ids[: len(b)] == tuple(b)


def test_a_block_never_exceeds_the_cap_or_the_source_limit(target: Any) -> None:
    source = DraftModelSource(target)
    history = [1, 2, 3]
    ctx = DraftContext(anchor=3, position=2, history=history)
    assert len(source.propose(ctx, 0, SamplingParams(), [])) == 0
    assert len(source.propose(ctx, 3, SamplingParams(), [])) == 3
    assert len(source.propose(ctx, 99, SamplingParams(), [])) == MAX_BLOCK


@pytest.mark.parametrize("threshold", [0.3, 0.6])
def test_an_unsure_draft_ends_the_block(target: Any, threshold: float) -> None:
    """With a confidence threshold the block ends at the first draft the draft model gave less than it: every
    draft before it scored at least the threshold under the draft model's own forward."""
    draft = helpers.perturbed(target, 0.3, seed=4)
    source = DraftModelSource(draft, confidence_threshold=threshold)
    assert source.identity.endswith(f":stop={threshold:g}")
    rng = random.Random(7)
    lengths = []
    for _ in range(12):
        history = [rng.randrange(helpers.VOCAB) for _ in range(rng.randint(1, 12))]
        ctx = DraftContext(anchor=history[-1], position=len(history) - 1, history=history)
        tokens = source.propose(ctx, 9, SamplingParams(), []).tokens
        logits, _ = helpers.target_forward(draft, [*history, *tokens])
        probs = np.array(mx.softmax(logits[len(history) - 1 :], axis=-1))
        p = [float(probs[i, t]) for i, t in enumerate(tokens)]
        assert all(x >= threshold - 1e-5 for x in p[:-1]), p
        assert len(tokens) == 9 or p[-1] < threshold + 1e-5, p
        lengths.append(len(tokens))
    assert min(lengths) < 9  # the threshold cut some blocks here


@pytest.mark.parametrize("cap", [4, 9])
def test_greedy_output_with_a_confidence_threshold_equals_plain_decoding(target: Any, cap: int) -> None:
    source = DraftModelSource(helpers.perturbed(target, 0.3, seed=4), confidence_threshold=0.5)
    rng = random.Random(cap)
    short = False
    for _ in range(3):
        prompt = [rng.randrange(helpers.VOCAB) for _ in range(rng.randint(1, 20))]
        stop = StopRule(max_tokens=rng.randint(10, 40))
        expected, _, _ = run(target, prompt, stop)
        got, rounds, _ = run(target, prompt, stop, source=source, cap_policy=FixedCap(cap))
        assert got == expected, prompt
        short = short or any(0 < r.drafted < cap for r in rounds[:-1])
        ids = source.cached_ids  # a block cut short fed one draft fewer: the cache still follows the history
        assert list(ids) == (prompt + got)[: len(ids)]
    assert short


def test_a_threshold_out_of_range_is_refused(target: Any) -> None:
    with pytest.raises(ValueError, match="confidence_threshold"):
        DraftModelSource(target, confidence_threshold=1.0)


@pytest.mark.parametrize(
    ("sampling", "proposal", "draft"),
    [
        (SamplingParams(temperature=2.0), "sample", "close"),
        (SamplingParams(temperature=1.5, top_k=6, top_p=0.95), "sample", "close"),
        (SamplingParams(temperature=2.0), "argmax", "close"),
        (SamplingParams(temperature=2.0), "sample", "qwen3_5"),
        (SamplingParams(temperature=1.5, top_k=6, top_p=0.95), "sample", "lfm2"),
    ],
)
def test_sampled_output_is_distributed_as_the_target(sampling: SamplingParams, proposal: str, draft: str) -> None:
    """Joint law of the first 3 tokens (prefill + a round of two drafts) vs the exact one."""
    vocab = 16
    model = helpers.tiny_target("qwen3", seed=5, vocab=vocab)
    drafter = helpers.perturbed(model, 0.5, seed=6) if draft == "close" else tiny_model(draft, 3, vocab_size=vocab)
    source = DraftModelSource(drafter, proposal=proposal)
    prompt = [3, 7]
    joint = exact_joint(model, prompt, sampling, 3)
    observed: Counter[tuple[int, ...]] = Counter()
    accepted = rejected = 0
    for i in range(400):
        s = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=i)
        got, rounds, _ = run(model, prompt, StopRule(max_tokens=3), source=source, sampling=s, cap_policy=FixedCap(2))
        observed[tuple(got)] += 1
        accepted += sum(r.accepted for r in rounds)
        rejected += sum(r.drafted - r.accepted for r in rounds)
    assert accepted > 0 and rejected > 0
    assert set(observed) <= set(joint)
    assert pooled_p_value(observed, joint) > 1e-3


def test_sampled_output_with_a_confidence_stop_is_distributed_as_the_target() -> None:
    """The stop ends a block on what was already drawn (a stopping time), so the law stays exact: the first 4
    tokens (prefill, then a round of up to three drafts that the stop cuts short) against the exact joint."""
    vocab = 8
    model = helpers.tiny_target("qwen3", seed=5, vocab=vocab)
    source = DraftModelSource(helpers.perturbed(model, 0.5, seed=6), confidence_threshold=0.3)
    prompt = [3, 7]
    sampling = SamplingParams(temperature=2.0)
    joint = exact_joint(model, prompt, sampling, 4)
    observed: Counter[tuple[int, ...]] = Counter()
    lengths: Counter[int] = Counter()
    for i in range(500):
        s = SamplingParams(temperature=2.0, seed=i)
        got, rounds, _ = run(model, prompt, StopRule(max_tokens=4), source=source, sampling=s, cap_policy=FixedCap(3))
        observed[tuple(got)] += 1
        lengths[rounds[0].drafted] += 1
    assert lengths[1] > 0 and lengths[2] > 0  # blocks of the budget's two drafts, and blocks the stop cut to one
    assert set(observed) <= set(joint)
    assert pooled_p_value(observed, joint) > 1e-3


def test_sampled_drafts_follow_the_reported_q() -> None:
    """Slot 0 is drawn from q_0; slot 1, given slot 0's token, from q_1 (the draft model's next distribution)."""
    vocab = 16
    model = helpers.tiny_target("qwen3", seed=5, vocab=vocab)
    source = DraftModelSource(model)
    history = [3, 7, 1]
    ctx = DraftContext(anchor=1, position=2, history=history)
    sampling = SamplingParams(temperature=1.5)
    rng = random.Random(0)
    first: Counter[int] = Counter()
    second: dict[int, Counter[int]] = {}
    q0: Any = None
    q1: dict[int, Any] = {}
    for _ in range(1000):
        block = source.propose(ctx, 2, sampling, [rng.random(), rng.random()])
        q = np.array(block.q)
        q0 = q[0] if q0 is None else q0
        np.testing.assert_allclose(q[0], q0, atol=1e-6)  # the same context each time: rollback is exact
        x0, x1 = block.tokens
        first[x0] += 1
        second.setdefault(x0, Counter())[x1] += 1
        q1.setdefault(x0, q[1])
    # q_0 is the draft model's own tempered distribution after the history.
    logits, _ = helpers.target_forward(model, history)
    want = mx.softmax(logits[-1] / 1.5, axis=-1)
    np.testing.assert_allclose(q0, np.array(want), atol=1e-5)
    assert pooled_p_value(first, {t: float(q0[t]) for t in range(vocab) if q0[t] > 0}) > 1e-3
    x0, counts = max(second.items(), key=lambda kv: sum(kv[1].values()))
    row = q1[x0]
    assert pooled_p_value(counts, {t: float(row[t]) for t in range(vocab) if row[t] > 0}) > 1e-3


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> PairLoader:
    """The tiny target and its drafts by name; bench's settings from its own flags (--draft-model among them)."""
    loader = PairLoader()

    def start(args: Any, *_a: Any) -> tuple[Any, Any, Any]:
        settings = load_settings({"model": "tiny", "max_draft": "4", "draft_model": args.draft_model}, {})
        telemetry = RecordingTelemetrySink()
        services = bootstrap.build(settings, loader=loader, telemetry=telemetry, calibration=MemoryStore())
        return settings, services, loader.models["tiny"]

    monkeypatch.setattr(bench, "start_with_model", start)
    return loader


def test_bench_runs_draft_mode_beside_mlx_lm_draft_speculation_with_the_same_draft_model(
    pair: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--against", "mlx-lm-draft", "--draft-model", "tiny-draft", "--num-draft", "3",
            "--modes", "baseline,draft", "--prompts", reference_suite._prompts(tmp_path), "--trials", "1",
            "--max-tokens", "12", "--quiet", "--json"]  # fmt: skip
    assert bench.main(argv) == 0
    assert pair.loaded == ["tiny-draft", "tiny-draft"]  # the reference's and our mode's
    doc = json.loads(capsys.readouterr().out)
    by = {m["mode"]: m for m in doc["modes"]}
    assert list(by) == ["baseline", "mlx-lm-draft@3", "draft"]
    mine = [r for r in doc["runs"] if r["mode"] == "draft"]
    assert mine and all(r["generated_tokens"] == 12 for r in mine)
    assert by["draft"]["lossless"] is True  # greedy: the same tokens as plain decoding
    assert by["draft"]["mean_accepted"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({}, "--mode draft needs --draft-model NAME|DIR"),
        ({"draft_model": "other-tokenizer"}, "does not share the vocabulary"),
        ({"draft_model": "narrow-draft"}, "does not share the vocabulary"),
    ],
)
def test_draft_mode_refuses_a_missing_or_mismatched_draft_model(pair: Any, flags: dict[str, str], message: str) -> None:
    settings = load_settings({"model": "tiny", "mode": "draft", **flags}, {})
    services = bootstrap.build(settings, loader=pair, telemetry=RecordingTelemetrySink(), calibration=MemoryStore())
    with pytest.raises(InvalidRequest, match=message):
        build_generator(services, settings, model=pair.models["tiny"])


def test_draft_mode_decodes_as_plain_and_auto_races_it(pair: Any) -> None:
    settings = load_settings({"model": "tiny", "mode": "draft", "draft_model": "tiny-draft", "max_draft": "3"}, {})
    services = bootstrap.build(settings, loader=pair, telemetry=RecordingTelemetrySink(), calibration=MemoryStore())
    tiny = pair.models["tiny"]
    plain = build_generator(services, settings, model=tiny, mode="baseline")
    draft = build_generator(services, settings, model=tiny)
    request = GenerationRequest(prompt=[5, 6, 7, 8], max_tokens=16, prefix_cache=False)
    got = draft.generate(request)
    assert got.token_ids == plain.generate(request).token_ids and got.drafted > 0
    candidates = auto_candidates(pair, settings, tiny, lambda _m: None)
    assert set(candidates) == {"baseline", "lookup", "draft"}
    assert isinstance(candidates["draft"], DraftModelSource)
    # Its measured curves are stored under the draft model's identity: another draft model measures its own.
    assert drafter_identity("draft", candidates["draft"]) == "draft:tiny/tiny-draft:block=16"
    narrow = DraftModelSource(pair.models["narrow-draft"].handle, identity=pair.models["narrow-draft"].identity)
    assert drafter_identity("draft", narrow) == "draft:tiny/narrow-draft:block=16"
