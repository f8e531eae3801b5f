"""The dialect codecs take each field only in the type its API gives it, and sampling values only in its range.

A string is not an array of its characters, an array is not an object, and an error names the field.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlx_dspark.adapters.api.anthropic_messages import codec as anthropic
from mlx_dspark.adapters.api.openai_chat import codec as chat
from mlx_dspark.adapters.api.openai_responses import codec as responses
from mlx_dspark.domain.errors import InvalidRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi"}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def _chat(**extra: Any) -> Any:
    return chat.to_chat_request(chat.parse({**CHAT, **extra}))


def _responses(**extra: Any) -> Any:
    return responses.to_chat_request(responses.parse({**RESPONSES, **extra}))[0]


def _messages(**extra: Any) -> Any:
    return anthropic.to_chat_request(anthropic.parse_messages({**MESSAGES, **extra}))


@pytest.mark.parametrize(
    ("convert", "field", "value"),
    [
        (_messages, "stop_sequences", "gx"),  # was split into "g" and "x"
        (_messages, "stop_sequences", {"a": 1}),
        (_messages, "tools", ""),
        (_messages, "tools", {}),
        (_messages, "tool_choice", "auto"),
        (_messages, "tool_choice", []),
        (_messages, "thinking", "enabled"),
        (_messages, "messages", {}),
        (_chat, "stream_options", "x"),
        (_chat, "stream_options", []),
        (_chat, "tools", ""),
        (_chat, "tools", {}),
        (_chat, "messages", "hi"),
        (_chat, "chat_template_kwargs", []),
        (_chat, "logit_bias", "x"),
        (_responses, "reasoning", "x"),
        (_responses, "reasoning", []),
        (_responses, "tools", ""),
        (_responses, "tools", {}),
        (_responses, "tools", ["shell"]),
        (_responses, "include", "reasoning.encrypted_content"),
    ],
)
def test_a_field_of_the_wrong_json_type_is_refused_naming_it(convert: Any, field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        convert(**{field: value})
    assert field in caught.value.message and "expected" in caught.value.message
    assert caught.value.param is not None and caught.value.param.startswith(field)


def test_nested_objects_must_be_objects_too() -> None:
    with pytest.raises(InvalidRequest, match=r"expected an object.*messages\[0\]"):
        _chat(messages=["hi"])
    with pytest.raises(InvalidRequest, match=r"tools\[0\]\.function"):
        _chat(tools=[{"type": "function", "function": "shell"}])
    with pytest.raises(InvalidRequest, match=r"tools\[0\]\.input_schema"):
        _messages(tools=[{"name": "shell", "input_schema": []}])


@pytest.mark.parametrize(
    ("convert", "field", "value"),
    [
        (_chat, "temperature", 2.01),
        (_chat, "temperature", 1e308),
        (_chat, "temperature", -0.1),
        (_chat, "top_p", 1.5),
        (_chat, "top_k", 10**12),
        (_responses, "temperature", 1e308),
        (_responses, "temperature", 2.5),
        (_responses, "top_p", 2),
        (_messages, "temperature", 1.01),
        (_messages, "temperature", 1e308),
        (_messages, "top_p", 1.1),
        (_messages, "top_k", 10**12),
        (_messages, "top_k", -1),
    ],
)
def test_sampling_values_outside_the_dialects_range_are_refused(convert: Any, field: str, value: float) -> None:
    with pytest.raises(InvalidRequest) as caught:
        convert(**{field: value})
    assert caught.value.param == field and field in caught.value.message


@pytest.mark.parametrize(
    ("convert", "values"),
    [
        (_chat, {"temperature": 2, "top_p": 1, "top_k": 1_000_000}),
        (_chat, {"temperature": 0, "top_p": 0.01}),
        (_responses, {"temperature": 2, "top_p": 1}),
        (_messages, {"temperature": 1, "top_p": 1, "top_k": 1_000_000}),
        (_messages, {"temperature": 0, "top_k": 0}),
    ],
)
def test_the_ends_of_each_range_are_accepted(convert: Any, values: dict[str, float]) -> None:
    sampling = convert(**values).sampling
    for name, value in values.items():
        assert getattr(sampling, name) == value


def test_well_typed_lists_and_objects_still_parse() -> None:
    req = _messages(stop_sequences=["gx", "y"], tool_choice={"type": "auto"}, thinking={"type": "disabled"})
    assert req.stop == ("gx", "y")
    assert _chat(stream_options={"include_usage": True}, stop="gx").stop == ("gx",)
    assert _responses(reasoning={"effort": "high"}, tools=[]).thinking is True
