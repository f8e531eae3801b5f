"""DFlash and DSpark as DraftSources of the one decode loop: greedy output equals plain decoding token for
token, budgets and EOS hold, confidence truncation changes only the round count, sampling is exact.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import decode
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.events import Finished, RoundFinished
from mlx_dspark.domain.tokens import FinishReason, SamplingParams, StopRule
from mlx_dspark.domain.verification.distribution import distribution
from tests.decoding import collect
from tests.fakes.clock import FakeClock
from tests.integration.drafters import helpers
from tests.stats import chi_square_p_value

GREEDY = SamplingParams()


def run(
    model: Any, prompt: list[int], stop: StopRule, source: Any = None, sampling: SamplingParams = GREEDY, **kw: Any
) -> tuple[list[int], list[RoundFinished], Finished]:
    target = MlxTargetModel(model)
    if source is not None and source.uses_features:
        target.configure_capture(source.target_layer_ids)
    return collect(decode(target, prompt, sampling, stop, FakeClock(), source=source, **kw))


DRAFTERS = [
    ("dflash", {"variant": "v1"}),
    ("dflash", {"variant": "v2"}),
    ("dflash", {"variant": "sliding", "sliding_window": 6}),
    ("dspark", {"packaging": "deepspec"}),
    ("dspark", {"packaging": "speculators", "draft_vocab": 100}),
    ("dspark", {"packaging": "specforge"}),
    ("dspark", {"packaging": "deepspec", "first_slot": 1}),
]


def write(tmp: Path, target: Any, kind: str, opts: dict[str, Any]) -> Path:
    name = "-".join(f"{k}{v}" for k, v in opts.items())
    if kind == "dflash":
        return helpers.write_dflash(tmp / f"dflash-{name}", **opts)
    return helpers.write_dspark(tmp / f"dspark-{name}", target, **opts)


def _label(x: Any) -> str:
    return x if isinstance(x, str) else "-".join(map(str, x.values()))


@pytest.mark.parametrize(("kind", "opts"), DRAFTERS, ids=_label)
def test_greedy_output_equals_plain_decoding(
    tmp_path: Path, family_target: tuple[str, Any], kind: str, opts: dict[str, Any]
) -> None:
    _, model = family_target
    source = load_drafter(kind, str(write(tmp_path, model, kind, opts)), model, bits=0)
    rng = random.Random(7)
    accepted = 0
    for trial in range(6):
        prompt = [rng.randrange(120) for _ in range(rng.randint(1, 9))]
        cap = [1, 2, 3, source.max_block, 100][trial % 5]  # below, at and above the block
        stop = StopRule(max_tokens=rng.randint(5, 24))
        expected, _, _ = run(model, prompt, stop)
        got, rounds, fin = run(model, prompt, stop, source=source, cap_policy=_fixed(cap))
        assert got == expected, (prompt, cap)
        assert len(got) == stop.max_tokens
        assert fin.reason is FinishReason.LENGTH
        assert all(r.drafted <= min(cap, source.max_block) for r in rounds)
        accepted += sum(r.accepted for r in rounds)
    if kind == "dspark":
        # The bigram-table Markov head gets drafts right, so multi-token rounds are exercised.
        assert accepted > 0


def _fixed(cap: int) -> FixedCap:
    return FixedCap(cap)


def test_dflash_on_the_shared_tiny_models(tmp_path: Path) -> None:
    """The shared fakes' tiny models (tests/fakes/tiny_models.py), when present, also decode identically."""
    tiny_models = pytest.importorskip("tests.fakes.tiny_models")
    for family in ("llama", "qwen3"):
        model = tiny_models.tiny_model(family, 0)
        n = len(model.layers)
        path = helpers.write_dflash(
            tmp_path / family, layer_ids=(0, n - 1), num_target_layers=n, vocab=tiny_models.VOCAB
        )
        source = load_drafter("dflash", str(path), model, bits=0)
        stop = StopRule(max_tokens=12)
        assert run(model, [3, 1, 4], stop, source=source)[0] == run(model, [3, 1, 4], stop)[0]


def test_budget_and_eos_inside_an_accepted_block(tmp_path: Path, qwen3_target: Any) -> None:
    source = load_drafter("dspark", str(helpers.write_dspark(tmp_path / "d", qwen3_target)), qwen3_target, bits=0)
    prompt = [4, 8, 15]
    plain, _, _ = run(qwen3_target, prompt, StopRule(max_tokens=40))
    for asked in (1, 2, 5, 13, 21):
        got, _, fin = run(qwen3_target, prompt, StopRule(max_tokens=asked), source=source)
        assert got == plain[:asked]
        assert fin.usage.generated_tokens == asked
    # EOS at several positions: generation stops right before it, exactly like plain decoding.
    for cut in (0, 3, 7, 11):
        eos = plain[cut]
        first = plain.index(eos)
        got, _, fin = run(qwen3_target, prompt, StopRule(max_tokens=40, eos_ids=frozenset({eos})), source=source)
        assert got == plain[:first]
        assert fin.reason is FinishReason.STOP


def test_confidence_truncation_changes_rounds_not_output(tmp_path: Path, qwen3_target: Any) -> None:
    path = helpers.write_dspark(tmp_path / "d", qwen3_target, seed=11)
    prompt = [9, 2, 6, 5]
    stop = StopRule(max_tokens=30)
    expected, full_rounds, _ = run(qwen3_target, prompt, stop)
    counts = []
    for threshold in (0.0, 0.3, 0.7):
        source = load_drafter("dspark", str(path), qwen3_target, bits=0, confidence_threshold=threshold)
        got, rounds, _ = run(qwen3_target, prompt, stop, source=source)
        assert got == expected
        counts.append((len(rounds), sum(r.drafted for r in rounds)))
    drafted = [d for _, d in counts]
    assert drafted[0] > drafted[2], counts  # a high threshold verifies fewer drafts
    assert len(full_rounds) >= counts[0][0]


def exact_joint(model: Any, prompt: list[int], sampling: SamplingParams, n: int) -> dict[tuple[int, ...], float]:
    """The target's exact distribution of its first `n` sampled tokens (enumerated)."""
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        nxt: dict[tuple[int, ...], float] = {}
        for seq, mass in out.items():
            logits, _ = helpers.target_forward(model, [*prompt, *seq])
            for tok, p in enumerate(distribution(logits[-1].tolist(), sampling)):
                if p > 0:
                    nxt[(*seq, tok)] = mass * p
        out = nxt
    return out


@pytest.mark.parametrize(
    ("kind", "sampling", "proposal"),
    [
        ("dspark", SamplingParams(temperature=2.0), "sample"),
        ("dspark", SamplingParams(temperature=1.5, top_k=6, top_p=0.95), "sample"),
        ("dflash", SamplingParams(temperature=2.0), "sample"),
        ("dspark", SamplingParams(temperature=2.0), "argmax"),
    ],
)
def test_sampled_output_is_distributed_as_the_target(
    tmp_path: Path, kind: str, sampling: SamplingParams, proposal: str
) -> None:
    """Joint law of the first 3 tokens (prefill + one speculative round with one draft) vs the exact one."""
    vocab = 16
    model = helpers.tiny_target("qwen3", seed=5, vocab=vocab)
    path = (
        helpers.write_dspark(tmp_path / "d", model, block_size=3)
        if kind == "dspark"
        else helpers.write_dflash(tmp_path / "d", block_size=4, vocab=vocab)
    )
    source = load_drafter(kind, str(path), model, bits=0, proposal=proposal)
    prompt = [3, 7]
    joint = exact_joint(model, prompt, sampling, 3)
    runs = 400
    observed: Counter[tuple[int, ...]] = Counter()
    accepted = 0
    for i in range(runs):
        s = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=i)
        got, rounds, _ = run(model, prompt, StopRule(max_tokens=3), source=source, sampling=s)
        observed[tuple(got)] += 1
        accepted += sum(r.accepted for r in rounds)
    assert accepted > 0
    assert set(observed) <= set(joint)
    assert pooled_p_value(observed, joint) > 1e-3


def pooled_p_value(observed: Counter[Any], probs: dict[Any, float]) -> float:
    """Chi-square p-value with bins of expected count < 5 pooled (so the approximation holds)."""
    n = sum(observed.values())
    big = [k for k in probs if probs[k] * n >= 5]
    small = [k for k in probs if probs[k] * n < 5]
    obs = [observed[k] for k in big] + [sum(observed[k] for k in small)]
    exp = [probs[k] for k in big] + [sum(probs[k] for k in small)]
    return chi_square_p_value(obs, exp)


def test_drafted_tokens_follow_the_reported_q(tmp_path: Path, qwen3_target: Any) -> None:
    """Given the anchor, slot 0 is drawn from q_0; given slot 0's token, slot 1 is drawn from q_1."""
    path = helpers.write_dspark(tmp_path / "d", qwen3_target, markov_strength=0.0, seed=8)
    source = load_drafter("dspark", str(path), qwen3_target, bits=0)
    prompt = [5, 6, 7]
    _, feats = helpers.target_forward(qwen3_target, prompt, source.target_layer_ids)
    ctx = DraftContext(anchor=9, position=3, history=[*prompt, 9], features=feats)
    rng = random.Random(0)
    first: Counter[int] = Counter()
    q0 = None
    second: dict[int, Counter[int]] = {}
    q1: dict[int, Any] = {}
    sampling = SamplingParams(temperature=1.5)
    for _ in range(1200):
        source.begin(prompt)
        block = source.propose(ctx, 2, sampling, [rng.random(), rng.random()])
        q = np.array(block.q)
        q0 = q[0] if q0 is None else q0
        np.testing.assert_allclose(q[0], q0, atol=1e-6)
        x0, x1 = block.tokens
        first[x0] += 1
        second.setdefault(x0, Counter())[x1] += 1
        q1.setdefault(x0, q[1])
    assert all(q0[t] > 0 for t in first)
    assert pooled_p_value(first, {t: float(q0[t]) for t in range(len(q0)) if q0[t] > 0}) > 1e-3
    x0, counts = max(second.items(), key=lambda kv: sum(kv[1].values()))
    row = q1[x0]
    # q_1 depends on the token drafted at slot 0 (the Markov bias), not on the slot alone.
    assert len(q1) == 1 or any(not np.allclose(row, other) for other in q1.values())
    assert pooled_p_value(counts, {t: float(row[t]) for t in range(len(row)) if row[t] > 0}) > 1e-3


def test_many_prompts_and_caps_with_quantized_drafters(tmp_path: Path, qwen3_target: Any) -> None:
    """4- and 8-bit drafters change only acceptance, never the greedy output."""
    path = helpers.write_dspark(tmp_path / "d", qwen3_target)
    for bits, (prompt, cap) in zip((4, 8), itertools.product([[1, 2, 3], [77, 5]], [2, 5]), strict=False):
        source = load_drafter("dspark", str(path), qwen3_target, bits=bits)
        stop = StopRule(max_tokens=15)
        assert (
            run(qwen3_target, prompt, stop, source=source, cap_policy=_fixed(cap))[0]
            == run(qwen3_target, prompt, stop)[0]
        )
