"""The admission floor is a lower bound on real prompt tokens: a conversation refused by it could never fit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_dspark.domain.chat.admission import conversation_bytes, prompt_token_floor
from mlx_dspark.domain.chat.conversation import Conversation, Message, Role, ToolCall, ToolSpec
from tests.fakes.tokenizer import FakeTokenizer

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=400)


def conversations() -> st.SearchStrategy[Conversation]:
    message = st.builds(
        Message,
        role=st.sampled_from([Role.USER, Role.ASSISTANT]),
        text=TEXT,
        thinking=st.one_of(st.just(""), TEXT),
        tool_calls=st.lists(
            st.builds(ToolCall, id=st.just("c1"), name=st.text(max_size=10), arguments=st.dictionaries(
                st.text(max_size=5), TEXT, max_size=2)),
            max_size=2,
        ).map(tuple),
    )
    tool = st.builds(ToolSpec, name=st.text(min_size=1, max_size=10), description=TEXT)
    return st.builds(
        Conversation,
        system=TEXT,
        messages=st.lists(message, min_size=1, max_size=6).map(tuple),
        tools=st.lists(tool, max_size=2).map(tuple),
    )


def rendered(conversation: Conversation) -> str:
    """Every text of the conversation as the prompt would carry it (a template only adds to it)."""
    import json

    parts = [conversation.system]
    for m in conversation.messages:
        parts += [m.text, m.thinking] + [c.name + json.dumps(c.arguments, ensure_ascii=False) for c in m.tool_calls]
    parts += [t.name + t.description + json.dumps(t.parameters, ensure_ascii=False) for t in conversation.tools]
    return "".join(parts)


@settings(max_examples=200, deadline=None)
@given(conversations())
def test_the_floor_never_exceeds_the_tokens_a_real_tokenization_gives(conversation: Conversation) -> None:
    tok = FakeTokenizer()
    floor = prompt_token_floor(conversation, tok.max_token_bytes)
    tokens = len(tok.encode(rendered(conversation), add_special_tokens=False))
    assert floor <= max(tokens, len(conversation.messages))
    assert conversation_bytes(conversation) <= len(rendered(conversation).encode("utf-8"))


def test_a_huge_conversation_gets_a_floor_past_any_window_and_an_unknown_tokenizer_none() -> None:
    big = Conversation(messages=(Message(role=Role.USER, text="x" * 50_000_000),))
    assert prompt_token_floor(big, 81) == 50_000_000 // 162
    many = Conversation(messages=tuple(Message(role=Role.USER, text="0123456789") for _ in range(100_000)))
    assert prompt_token_floor(many, 81) == 100_000  # every message costs at least one token
    assert prompt_token_floor(big, 0) == 0


@pytest.mark.slow
def test_the_floor_is_below_the_default_models_own_token_count() -> None:
    # The real SmolLM2 tokenizer (byte-level BPE, longest token 81 bytes) on texts of every kind.
    from mlx_dspark.application import bootstrap
    from mlx_dspark.application.settings import load_settings

    services = bootstrap.build(load_settings({}, environ={}))
    tok = services.loader.load_target("default").tokenizer
    assert tok.max_token_bytes >= 16
    samples = ["#" * 5000, " " * 5000, "\n" * 5000, "é日本🙂" * 1000, "def f(x):\n    return x\n" * 300, "a" * 9999]
    for text in samples:
        conv = Conversation(messages=(Message(role=Role.USER, text=text),))
        assert prompt_token_floor(conv, tok.max_token_bytes) <= len(tok.encode(text, add_special_tokens=False))
