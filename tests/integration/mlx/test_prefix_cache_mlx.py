"""The prefix cache on real MLX caches through the generation use case: plain KV, a sliding window that
wraps, gated-DeltaNet recurrent state, and a DSpark drafter reading target features.

Over random conversation trees, greedy output with the cache equals a cold run of each prompt; the
drafter proposes exactly what it proposes cold (same drafted/accepted counts), so its context — the
target features stored with each entry — is consistent with the rows; the byte budget holds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.generation import GenerationRequest, GenerationResult, GenerationService
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.prefix_cache import PrefixCache
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.tiny_models import FAMILIES, GEMMA_WINDOW, VOCAB, tiny_model
from tests.integration.drafters import helpers


class IdTokenizer:
    """Token ids as text ("<7>"), no EOS: enough for the use case's detokenizer."""

    eos_ids: frozenset[int] = frozenset()
    chat_template = None

    def __init__(self, vocab: int) -> None:
        self.vocab_size = vocab

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in text.replace(">", " ").replace("<", " ").split()]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


@functools.cache
def _model(family: str):
    return tiny_model(family, seed=11)


def generator(family: str, cache: PrefixCache | None, source=None, model=None) -> GenerationService:
    model = model or _model(family)
    target = MlxTargetModel(model)
    if source is not None:
        target.configure_capture(tuple(source.target_layer_ids))
    loaded = LoadedModel(
        name=family,
        identity=f"{family}@11",
        target=target,
        tokenizer=IdTokenizer(VOCAB),
        context_window=4096,
        family=family,
    )
    return GenerationService(
        loaded, source=source, mode="test", clock=FakeClock(), telemetry=RecordingTelemetrySink(), prefix_cache=cache
    )


def run(gen: GenerationService, prompt: list[int], n: int, boundaries=()) -> GenerationResult:
    return gen.generate(GenerationRequest(prompt=prompt, max_tokens=n, boundaries=tuple(boundaries)))


def cold(gen: GenerationService, prompt: list[int], n: int) -> GenerationResult:
    gen.model.target.reset(0)
    return gen.generate(GenerationRequest(prompt=prompt, max_tokens=n, prefix_cache=False))


step = st.tuples(
    st.integers(0, 10**6),
    st.floats(0, 1),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2 * GEMMA_WINDOW),
    st.integers(1, 5),
)


def check_tree(family: str, steps, budget: int) -> list[int]:
    cache = PrefixCache(budget)
    warm, reference = generator(family, cache), generator(family, None)
    seen: list[list[int]] = [[]]
    hits = []
    for parent, cut, new, n in steps:
        base = seen[parent % len(seen)]
        prompt = base[: round(cut * len(base))] + new
        # The branch point plays the end of a turn: a snapshot candidate.
        result = run(warm, prompt, n, boundaries=[len(prompt) - len(new)])
        assert list(result.token_ids) == list(cold(reference, prompt, n).token_ids), (family, prompt)
        hits.append(result.cached_prompt_tokens)
        seen.append([*prompt, *result.token_ids])
        target = warm.model.target
        assert cache._memory_index(target.state_tag).used_bytes <= budget
    return hits


trees = st.lists(step, min_size=2, max_size=6)


@settings(max_examples=12, deadline=None)
@given(trees, st.sampled_from([10**9, 60_000]))
def test_plain_kv_conversation_trees(steps, budget):
    check_tree("llama", steps, budget)


@settings(max_examples=12, deadline=None)
@given(trees)
def test_sliding_window_conversation_trees(steps):
    check_tree("gemma3_text", steps, 10**9)


@settings(max_examples=12, deadline=None)
@given(trees)
def test_recurrent_conversation_trees(steps):
    check_tree("qwen3_5", steps, 10**9)


def test_each_cache_kind_resumes_a_second_turn_from_its_snapshot():
    system = [(7 * i) % VOCAB for i in range(3 * GEMMA_WINDOW)]  # longer than the window
    user1, reply_tail, user2 = [5, 6, 7, 8], [9, 9], [40, 41, 42]
    for family in FAMILIES:
        gen = generator(family, PrefixCache(10**9))
        turn1 = run(gen, [*system, *user1, 1], 4, boundaries=[len(system), len(system) + len(user1)])
        run(gen, [3, 3, 3], 2)  # a side request in between
        prompt2 = [*system, *user1, 2, *turn1.token_ids, *reply_tail, *user2, 1]  # the tail is re-rendered
        turn2 = run(gen, prompt2, 4)
        assert turn2.cached_prompt_tokens == len(system) + len(user1), family
        assert list(turn2.token_ids) == list(cold(generator(family, None), prompt2, 4).token_ids), family


def test_a_dspark_drafter_sees_the_same_context_from_a_cached_prefix(tmp_path):
    model = helpers.tiny_target("qwen3", seed=2)
    source = load_drafter("dspark", str(helpers.write_dspark(tmp_path / "d", model)), model, bits=0)
    warm = generator("qwen3", PrefixCache(10**9), source=source, model=model)
    prompt1 = [4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23, 42, 7, 7]
    turn1 = run(warm, prompt1, 12)
    run(warm, [1, 2, 3], 3)  # a side request
    prompt2 = [*prompt1, *turn1.token_ids, 5, 6, 4, 8]
    got = run(warm, prompt2, 16)
    assert got.cached_prompt_tokens == len(prompt1) + len(turn1.token_ids) - 1
    ref = cold(generator("qwen3", None, source=source, model=model), prompt2, 16)
    assert got.token_ids == ref.token_ids
    assert (got.drafted, got.accepted, got.rounds) == (ref.drafted, ref.accepted, ref.rounds)
    assert got.accepted > 0
