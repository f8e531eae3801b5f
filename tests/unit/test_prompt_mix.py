"""The mixed training prompt set: varied sources, distinct conversations, and no held-out prompt anywhere in
it (nor in self-instruct output or follow-ups run through the same filter)."""

from __future__ import annotations

import random
from collections import Counter

from mlx_dspark.application.lab import prompt_mix
from mlx_dspark.application.lab.training import builtin_conversations, heldout_prompts

HELD = [p["prompt"] for p in heldout_prompts()]


def test_the_filter_rejects_held_out_prompts_inside_longer_text_and_near_copies() -> None:
    keep = prompt_mix.HeldoutFilter(HELD)
    for text in HELD:
        assert not keep.clean(text)
        assert not keep.clean(f"Please help. {text.upper()} Thanks!")
    # Eight consecutive words of a held-out prompt are enough to reject.
    assert not keep.clean("so tell me what is the difference between weather and climate really")
    assert keep.clean("What is the difference between a lake and a pond?")
    assert keep.clean("Write a Python function that returns the largest number in a list.")


def test_mixed_set_is_varied_distinct_and_free_of_held_out_prompts() -> None:
    builtin = builtin_conversations(3000, 0)
    mixed = prompt_mix.mixed_conversations(6000, 1, HELD, builtin=builtin)
    assert len(mixed) == 6000
    sources = Counter(s for s, _ in mixed)
    assert set(sources) == {"builtin", "math", "code", "tools", "agent"}
    assert len({str(c) for _, c in mixed}) == len(mixed)
    keep = prompt_mix.HeldoutFilter(HELD)
    assert all(keep.clean_conversation(c) for _, c in mixed)
    held_lower = [h.lower() for h in HELD]
    assert not any(h in m["content"].lower() for _, c in mixed for m in c for h in held_lower)
    # Tool-use transcripts carry the tools in the system prompt and, often, a call and its result.
    tools = [c for s, c in mixed if s == "tools"]
    assert any(c[-1]["role"] == "tool" for c in tools) and all(c[0]["role"] == "system" for c in tools)
    # Agent system prompts are long.
    assert min(len(c[0]["content"]) for s, c in mixed if s == "agent") > 400


def test_template_conversations_that_touch_a_held_out_prompt_are_dropped() -> None:
    planted = [
        [{"role": "user", "content": f"Quick question: {HELD[3]}"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HELD[17].lower()}],
    ]
    builtin = builtin_conversations(500, 0)
    mixed = prompt_mix.mixed_conversations(800, 0, HELD, builtin=planted + builtin)
    kept = [c for s, c in mixed if s == "builtin"]
    assert len(kept) == 500 and not any(c in kept for c in planted)


def test_self_instruct_seeds_and_follow_ups() -> None:
    rng = random.Random(0)
    seeds = prompt_mix.self_instruct_seeds(rng, 50)
    assert len(seeds) == 50 and all(len(s) == 1 and s[0]["role"] == "user" for s in seeds)
    conv = [{"role": "user", "content": "Hi"}]
    cont = prompt_mix.follow_up(conv, "Hello!", rng)
    assert [m["role"] for m in cont] == ["user", "assistant", "user"]
    assert cont[2]["content"] in prompt_mix.FOLLOW_UPS
