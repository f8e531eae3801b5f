"""The lock-step batched generator is exact: every row's greedy output equals single-sequence greedy decoding
of the same target (mixed prompt lengths, EOS in the middle, rows refilled many times), no row ever attends
to a padding or stale key (the cache is poisoned with huge values), and the vectorised sampler draws each
row from that row's own temperature / top-p distribution (chi-square against the domain's reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_dspark.adapters.mlx.training.generate import RowCache, generate_responses, lock_step_fits, sample_rows
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.distribution import distribution
from tests.fakes.tiny_models import VOCAB, tiny_model
from tests.stats import chi_square_p_value


def _single_greedy(model: Any, prompt: Sequence[int], n: int, eos: set[int]) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([list(prompt)]), cache=cache)[:, -1]
    out: list[int] = []
    for _ in range(n):
        t = int(mx.argmax(logits, axis=-1).item())
        out.append(t)
        if t in eos:
            break
        logits = model(mx.array([[t]]), cache=cache)[:, -1]
    return out


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, VOCAB - 2, size=int(rng.integers(2, 100)))] for _ in range(n)]


@pytest.fixture(scope="module")
def case() -> dict[str, Any]:
    model = tiny_model("qwen3", seed=3)
    prompts = _prompts(21, 0)
    # EOS ids the tiny model actually emits, so that some rows stop mid-way and are refilled.
    eos = {5, 17, 40}
    ref = [_single_greedy(model, p, 28, eos) for p in prompts]
    return {"model": model, "prompts": prompts, "eos": eos, "ref": ref}


def test_rows_stop_mid_way_and_rows_are_refilled(case: dict[str, Any]) -> None:
    lengths = [len(r) for r in case["ref"]]
    assert min(lengths) < 28 and max(lengths) == 28  # the fixture really exercises EOS and the cap
    assert len({len(p) for p in case["prompts"]}) > 10  # mixed prompt lengths


def _greedy_batch(case: dict[str, Any], batch: int = 5, **kw: Any) -> list[list[int] | None]:
    """The case's prompts, greedy, `batch` rows at a time."""
    return generate_responses(
        case["model"],
        case["prompts"],
        eos_ids=sorted(case["eos"]),
        max_new_tokens=28,
        batch=batch,
        temperatures=[0.0] * len(case["prompts"]),
        seed=0,
        **kw,
    )


@pytest.mark.parametrize("batch", [1, 4, 7, 32])
def test_every_row_equals_single_sequence_greedy(case: dict[str, Any], batch: int) -> None:
    got = _greedy_batch(case, batch, refill_min=1 if batch < 8 else 3)
    assert got == case["ref"]


def _poisoned_alloc(self: RowCache, like_k: mx.array, like_v: mx.array, batch: int) -> None:
    h, dk, dv = like_k.shape[1], like_k.shape[3], like_v.shape[3]
    self.keys = (mx.random.normal((batch, h, self.capacity, dk)) * 1e4).astype(like_k.dtype)
    self.values = (mx.random.normal((batch, h, self.capacity, dv)) * 1e4).astype(like_v.dtype)


def test_no_row_attends_to_padding_or_stale_keys(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Unwritten cache slots hold huge values: any attention weight on them changes the output."""
    monkeypatch.setattr(RowCache, "_alloc", _poisoned_alloc)
    got = _greedy_batch(case, refill_min=2)
    assert got == case["ref"]


def test_the_poison_catches_a_mask_that_lets_padding_in(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with a mask that admits every slot of the span, outputs change."""
    monkeypatch.setattr(RowCache, "_alloc", _poisoned_alloc)

    def leaky(self: RowCache, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if self.rows.prefill:
            return "causal" if n > 1 else None
        return None  # attend to the whole span, padding included

    monkeypatch.setattr(RowCache, "make_mask", leaky)
    got = _greedy_batch(case)
    assert got != case["ref"]


def test_greedy_and_sampled_rows_mix_and_seeds_reproduce(case: dict[str, Any]) -> None:
    temps = [0.0 if i % 3 else 0.9 for i in range(len(case["prompts"]))]

    def run(seed: int) -> list[list[int] | None]:
        return generate_responses(
            case["model"],
            case["prompts"],
            eos_ids=sorted(case["eos"]),
            max_new_tokens=28,
            batch=6,
            temperatures=temps,
            top_p=[0.9 if i % 2 else 1.0 for i in range(len(temps))],
            seed=seed,
        )

    a, b, c = run(1), run(1), run(2)
    assert a == b
    assert a != c
    greedy_rows = [i for i, t in enumerate(temps) if t == 0]
    assert [a[i] for i in greedy_rows] == [case["ref"][i] for i in greedy_rows]


def test_only_the_nucleus_lanes_are_sorted(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # 7 of 21 prompts cut a nucleus: at batch 6 they decode in 2 lanes, and a step sorts those 2 rows, not 6.
    from mlx_dspark.adapters.mlx.training import generate

    steps: list[tuple[int, bool]] = []
    refilling = [False]  # the next draw samples a refill's first tokens, not a step's
    last_logits = generate._last_logits

    def refill_logits(*args: Any) -> mx.array:
        refilling[0] = True
        return last_logits(*args)

    def recording(logits: mx.array, temps: mx.array, tops: mx.array, key: mx.array, *, nucleus: bool) -> mx.array:
        if not refilling[0]:
            steps.append((logits.shape[0], nucleus))
        refilling[0] = False
        return sample_rows(logits, temps, tops, key, nucleus=nucleus)

    monkeypatch.setattr(generate, "sample_rows", recording)
    monkeypatch.setattr(generate, "_last_logits", refill_logits)
    temps = [0.9 if i % 3 == 0 else 0.0 for i in range(len(case["prompts"]))]
    out = generate_responses(
        case["model"],
        case["prompts"],
        eos_ids=sorted(case["eos"]),
        max_new_tokens=28,
        batch=6,
        temperatures=temps,
        top_p=0.8,
        seed=4,
    )
    assert all(r is not None for r in out)
    assert set(steps) == {(2, True), (4, False)} and len(steps) >= 40
    greedy_rows = [i for i, t in enumerate(temps) if t == 0]
    assert [out[i] for i in greedy_rows] == [case["ref"][i] for i in greedy_rows]


def test_a_deadline_stops_new_prompts() -> None:
    model = tiny_model("llama", seed=1)
    prompts = _prompts(12, 5)
    got = generate_responses(
        model, prompts, eos_ids=[], max_new_tokens=6, batch=4, temperatures=[0.0] * 12, seed=0, deadline=0.0
    )
    started = [i for i, r in enumerate(got) if r is not None]
    assert len(started) == 4  # the first batch finishes, no new prompt starts
    # Prompts start shortest first within a window (less refill padding).
    assert sorted(len(prompts[i]) for i in started) == sorted(len(p) for p in prompts)[:4]
    assert all(got[i] == _single_greedy(model, prompts[i], 6, set()) for i in started)


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "nemotron_h", "gemma3_text"])
def test_recurrent_and_windowed_targets_generate_one_prompt_at_a_time_exactly(family: str) -> None:
    """Recurrent, convolutional and sliding-window caches do not fit the lock-step rows: such a target generates
    each prompt on its own mlx-lm caches, greedy rows equal to single-sequence greedy, seeds reproducible."""
    model = tiny_model(family, seed=3, vocab_size=VOCAB)
    assert not lock_step_fits(model) and lock_step_fits(tiny_model("qwen3", seed=3))
    prompts = _prompts(5, 9)
    eos = {5, 17, 40}
    temps = [0.0, 0.9, 0.0, 0.9, 0.0]

    def run(seed: int, deadline: float | None = None) -> list[list[int] | None]:
        return generate_responses(
            model, prompts, eos_ids=sorted(eos), max_new_tokens=12, batch=4, temperatures=temps, top_p=0.9,
            seed=seed, deadline=deadline,
        )  # fmt: skip

    a = run(1)
    for i in (0, 2, 4):
        assert a[i] == _single_greedy(model, prompts[i], 12, eos)
    assert a == run(1) and a != run(2)  # the sampled rows follow the seed
    assert all(r is None for r in run(1, deadline=0.0))  # past the deadline nothing starts


@pytest.mark.parametrize(
    ("temperature", "top_p"),
    [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8), (0.5, 0.6)],
)
def test_vectorised_sampler_matches_each_rows_distribution(temperature: float, top_p: float) -> None:
    """Rows with different settings in one call: each row's draws fit its own reference distribution."""
    vocab, copies = 12, 6000
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(3, vocab)).astype(np.float32) * 2.0
    # Row 0 has this case's setting, row 1 another sampled setting, row 2 is greedy.
    temps = np.array([temperature, 0.9, 0.0], dtype=np.float32)
    tops = np.array([top_p, 0.95, 1.0], dtype=np.float32)
    tiled = mx.array(np.repeat(logits, copies, axis=0))
    draws = sample_rows(
        tiled,
        mx.array(np.repeat(temps, copies)),
        mx.array(np.repeat(tops, copies)),
        mx.random.key(3),
        nucleus=True,
    )
    d = np.array(draws).reshape(3, copies)
    for row in range(2):
        expected = distribution(
            logits[row].tolist(), SamplingParams(temperature=float(temps[row]), top_p=float(tops[row]))
        )
        observed = np.bincount(d[row], minlength=vocab).tolist()
        assert chi_square_p_value(observed, expected) > 1e-3
    assert (d[2] == int(np.argmax(logits[2]))).all()


def test_sampler_without_nucleus_matches_plain_temperature() -> None:
    vocab, copies = 9, 8000
    logits = np.random.default_rng(2).normal(size=(1, vocab)).astype(np.float32)
    draws = sample_rows(
        mx.array(np.repeat(logits, copies, axis=0)),
        mx.full((copies,), 0.8),
        mx.ones((copies,)),
        mx.random.key(5),
        nucleus=False,
    )
    expected = distribution(logits[0].tolist(), SamplingParams(temperature=0.8))
    assert chi_square_p_value(np.bincount(np.array(draws), minlength=vocab).tolist(), expected) > 1e-3
