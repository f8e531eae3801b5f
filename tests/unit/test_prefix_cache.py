"""The prefix cache through the generation use case, on the oracle target (plain KV and snapshot-only).

Greedy output with the cache equals output without it over random conversation trees (branches, side
requests, evictions); drafter features stay aligned with the rows; a side request between two turns
keeps the conversation's hit; snapshots serve a snapshot-only target at turn boundaries.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_dspark.application.generation import GenerationRequest, GenerationService
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.prefix_cache import PrefixCache
from mlx_dspark.domain.events import PrefillProgress
from mlx_dspark.domain.ports import RollbackKind
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.drafts import ScriptedDraftSource
from tests.fakes.oracle import OracleTarget, oracle_logits
from tests.unit.test_generation import CharTokenizer

VOCAB = 16


def whole_prefix_logits(prefix):
    # Depends on every token: a wrong cached row anywhere changes the output.
    return oracle_logits(prefix, VOCAB, context=len(prefix) + 1)


def make(rollback=RollbackKind.TRIM, budget=10**9, drafts=False):
    target = OracleTarget(vocab=VOCAB, rollback=rollback, logits_fn=whole_prefix_logits)
    model = LoadedModel(
        name="fake", identity="fake@0", target=target, tokenizer=CharTokenizer(), context_window=4096, family="fake"
    )
    source = ScriptedDraftSource(target, lambda r, i: (r + i) % 3 != 2, block=3) if drafts else None
    cache = PrefixCache(budget)
    telemetry = RecordingTelemetrySink()
    gen = GenerationService(
        model,
        source=source,
        mode="scripted" if drafts else "baseline",
        clock=FakeClock(),
        telemetry=telemetry,
        prefix_cache=cache,
    )
    return gen, target, cache, source, telemetry


def run(gen, prompt, n=4, boundaries=()):
    return gen.generate(GenerationRequest(prompt=list(prompt), max_tokens=n, boundaries=tuple(boundaries)))


def fresh_greedy(prompt, n):
    return OracleTarget(vocab=VOCAB, logits_fn=whole_prefix_logits).greedy_continuation(list(prompt), n)


step = st.tuples(
    st.integers(0, 10**6),  # which earlier sequence to branch from
    st.floats(0, 1),  # where to cut it
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),  # new tokens
    st.integers(1, 4),  # max tokens
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(step, min_size=1, max_size=10),
    st.sampled_from([RollbackKind.TRIM, RollbackKind.SNAPSHOT]),
    st.sampled_from([10**9, 300, 60]),
    st.booleans(),
)
def test_greedy_output_with_the_cache_equals_output_without(steps, rollback, budget, drafts):
    gen, _target, cache, source, _ = make(rollback, budget, drafts)
    seen: list[list[int]] = [[]]
    for parent, cut, new, n in steps:
        base = seen[parent % len(seen)]
        prompt = base[: round(cut * len(base))] + new
        boundaries = [len(prompt) - len(new)] if len(prompt) > len(new) else []
        result = run(gen, prompt, n, boundaries)
        assert list(result.token_ids) == fresh_greedy(prompt, n)
        assert 0 <= result.cached_prompt_tokens < len(prompt)
        if source is not None and source.features_seen:  # the drafter saw every row once, in order
            history = [*prompt, *result.token_ids]
            assert source.features_seen == list(enumerate(history[: len(source.features_seen)]))
        seen.append([*prompt, *result.token_ids])
        for tag_entries in cache._memory.values():
            assert tag_entries.used_bytes <= budget


def test_a_side_request_between_turns_keeps_the_conversations_hit():
    gen, _target, _cache, _, _ = make(budget=8 * 400)
    system = [1, 2, 3, 4, 5, 6, 7, 8] * 20
    turn1 = run(gen, [*system, 9, 9, 10], n=4)
    conversation = [*system, 9, 9, 10, *turn1.token_ids]
    side = run(gen, [3, 3, 2, 1], n=2)  # a short title request in between
    assert side.cached_prompt_tokens == 0
    turn2 = run(gen, [*conversation, 11, 12], n=4)
    # Every row of turn 1 was served: the prompt, and all generated tokens but the last (never fed back).
    assert turn2.cached_prompt_tokens == len(conversation) - 1
    assert list(turn2.token_ids) == fresh_greedy([*conversation, 11, 12], 4)


def test_without_the_cache_a_side_request_evicts_the_conversation():
    """The old behaviour, for contrast: only the live target cache is reused."""
    gen, _target, _cache, _, _ = make(budget=0)
    system = [1, 2, 3, 4] * 10
    turn1 = run(gen, [*system, 9], n=3)
    run(gen, [3, 3, 2, 1], n=2)
    turn2 = run(gen, [*system, 9, *turn1.token_ids, 5], n=2)
    assert turn2.cached_prompt_tokens == 0


def test_a_snapshot_only_target_resumes_from_the_turn_boundary():
    gen, _target, _cache, _, _ = make(rollback=RollbackKind.SNAPSHOT)
    system = list(range(16)) * 3
    user1 = [3, 1, 4, 1, 5]
    prompt1 = [*system, *user1, 15]  # 15 plays the generation prompt
    turn1 = run(gen, prompt1, n=3, boundaries=[len(system), len(system) + len(user1)])
    # The template re-renders the tail: the next prompt agrees only up to the end of the user turn.
    prompt2 = [*system, *user1, 14, *turn1.token_ids, 2, 7, 15]
    turn2 = run(gen, prompt2, n=3)
    assert turn2.cached_prompt_tokens == len(system) + len(user1)
    assert list(turn2.token_ids) == fresh_greedy(prompt2, 3)
    # Another conversation on the same system prompt resumes after the system prompt.
    other = run(gen, [*system, 9, 9, 9, 15], n=2)
    assert other.cached_prompt_tokens == len(system)


def test_a_cold_request_neither_reuses_nor_remembers():
    gen, target, cache, _, _ = make()
    run(gen, [1, 2, 3, 4, 5], n=2)
    entries = len(cache.entries(target.state_tag))
    cold = gen.generate(GenerationRequest(prompt=[1, 2, 3, 4, 5, 6], max_tokens=2, prefix_cache=False))
    assert cold.cached_prompt_tokens == 0
    assert len(cache.entries(target.state_tag)) == entries


def test_long_prefills_report_progress(monkeypatch):
    import mlx_dspark.domain.decoder as prefill_module

    monkeypatch.setattr(prefill_module, "PROGRESS_EVERY", 10)
    gen, _target, _cache, _, telemetry = make()
    run(gen, list(range(16)) * 2, n=1)  # 32 tokens
    progress = [e for _, e in telemetry.events if isinstance(e, PrefillProgress)]
    assert [(p.done, p.total, p.reused) for p in progress] == [(10, 32, 0), (20, 32, 0), (30, 32, 0), (32, 32, 0)]
    telemetry.events.clear()
    run(gen, [*range(16), *range(16), 1, 2, 3], n=1)  # short after reuse: no progress events
    assert not [e for _, e in telemetry.events if isinstance(e, PrefillProgress)]
