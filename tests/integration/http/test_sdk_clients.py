"""Every endpoint driven by the official openai and anthropic SDKs (their stream helpers check event order)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.integration.http import scripts
from tests.integration.http.conftest import LiveServer


@pytest.fixture
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0)


@pytest.fixture
def ant(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.base_url, api_key=live.api_key, max_retries=0)


USER = [{"role": "user", "content": "say hi"}]


# ---- Chat Completions ---------------------------------------------------------------------------------


def test_chat_text(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="local-model", messages=USER)  # type: ignore[arg-type]
    assert r.choices[0].message.content == "Hello from the scripted model."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == len("Hello from the scripted model.")


def test_chat_stream_text_with_usage(oai: openai.OpenAI) -> None:
    with oai.chat.completions.stream(
        model="local-model",
        messages=USER,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Hello from the scripted model."
    assert final.usage is not None and final.usage.prompt_tokens > 0


def _final_completion(live: LiveServer, oai: openai.OpenAI, script: Any) -> Any:
    """The streamed chat completion of `script`'s reply to USER with the shell tool offered."""
    live.script(script)
    with oai.chat.completions.stream(
        model="local-model",
        messages=USER,
        tools=[scripts.SHELL_TOOL_OPENAI],  # type: ignore[arg-type, list-item]
    ) as stream:
        return stream.get_final_completion()


def test_chat_stream_tool_call_then_result(live: LiveServer, oai: openai.OpenAI) -> None:
    final = _final_completion(live, oai, scripts.tool)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["shell"]  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"command": "echo hi"}  # type: ignore[union-attr]
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "hi\n"},
    ]
    r = oai.chat.completions.create(model="local-model", messages=history, tools=[scripts.SHELL_TOOL_OPENAI])  # type: ignore[arg-type, list-item]
    assert r.choices[0].message.content == "Tool result received: hi"


def test_chat_parallel_calls(live: LiveServer, oai: openai.OpenAI) -> None:
    final = _final_completion(live, oai, scripts.parallel)
    args = [json.loads(c.function.arguments) for c in final.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    assert args == [{"command": "echo one"}, {"command": "echo two"}]


def test_chat_botched_call_is_text(live: LiveServer, oai: openai.OpenAI) -> None:
    live.script(scripts.botched)
    r = oai.chat.completions.create(model="local-model", messages=USER, tools=[scripts.SHELL_TOOL_OPENAI])  # type: ignore[arg-type, list-item]
    assert r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    assert "<tool_call>" in (r.choices[0].message.content or "")


def test_chat_reasoning_content(live: LiveServer, oai: openai.OpenAI) -> None:
    live.script(scripts.thinking)
    r = oai.chat.completions.create(
        model="local-model",
        messages=USER,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},  # type: ignore[arg-type]
    )
    msg = r.choices[0].message
    assert msg.content == "The answer is 4."
    assert getattr(msg, "reasoning_content", None) == "Let me think about this."


def test_chat_stop_and_max_tokens(live: LiveServer, oai: openai.OpenAI) -> None:
    live.script(scripts.stop_words)
    r = oai.chat.completions.create(model="local-model", messages=USER, stop=["STOP"])  # type: ignore[arg-type]
    assert r.choices[0].message.content == "one two" and r.choices[0].finish_reason == "stop"
    live.script(scripts.long)
    r = oai.chat.completions.create(model="local-model", messages=USER, max_completion_tokens=7)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 7


def test_chat_errors(oai: openai.OpenAI, live: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-nope", messages=USER)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="local-model", messages=[{"role": "user", "content": "x" * 5000}])  # type: ignore[arg-type]
    assert exc.value.code == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in str(exc.value)
    bad = openai.OpenAI(base_url=live.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="local-model", messages=USER)  # type: ignore[arg-type]


def test_models_both_shapes(oai: openai.OpenAI, ant: anthropic.Anthropic, live: LiveServer) -> None:
    assert [m.id for m in oai.models.list()] == ["local-model"]
    assert [m.id for m in ant.models.list()] == ["local-model"]
    r = httpx.get(
        live.base_url + "/v1/models?limit=1000",
        headers={"x-api-key": live.api_key or "", "anthropic-version": "2023-06-01"},
    )
    assert r.json()["data"][0]["type"] == "model" and r.json()["has_more"] is False
    assert oai.models.retrieve("local-model").id == "local-model"


# ---- Responses ------------------------------------------------------------------------------------------


def test_responses_text_and_stream(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model="local-model", input="say hi")
    assert r.output_text == "Hello from the scripted model." and r.status == "completed"
    with oai.responses.stream(model="local-model", input="say hi") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == "Hello from the scripted model."
    assert final.usage is not None and final.usage.output_tokens > 0


def test_responses_tool_round_trip(live: LiveServer, oai: openai.OpenAI) -> None:
    live.script(scripts.tool)
    with oai.responses.stream(model="local-model", input="run it", tools=[scripts.SHELL_TOOL_RESPONSES]) as stream:  # type: ignore[list-item]
        final = stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"command": "echo hi"}
    history = [
        {"role": "user", "content": "run it"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "shell", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "hi\n"},
    ]
    r = oai.responses.create(model="local-model", input=history, tools=[scripts.SHELL_TOOL_RESPONSES])  # type: ignore[arg-type, list-item]
    assert r.output_text == "Tool result received: hi"


def test_responses_reasoning_and_previous_response(live: LiveServer, oai: openai.OpenAI) -> None:
    live.script(scripts.thinking)
    with oai.responses.stream(model="local-model", input="2+2?", reasoning={"effort": "medium"}) as stream:
        final = stream.get_final_response()
    reasoning = [o for o in final.output if o.type == "reasoning"]
    assert reasoning and reasoning[0].summary[0].text == "Let me think about this."
    assert final.output_text == "The answer is 4."
    live.script(scripts.text)
    follow = oai.responses.create(model="local-model", input="and now?", previous_response_id=final.id)
    assert (
        "Let me think about this." in live.loader.target.prompts[-1]
        or "The answer is 4." in live.loader.target.prompts[-1]
    )
    assert follow.output_text == "Hello from the scripted model."
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="local-model", input="x", previous_response_id="resp_unknown")


def test_responses_max_output_tokens_and_overflow(live: LiveServer, oai: openai.OpenAI) -> None:
    live.script(scripts.long)
    r = oai.responses.create(model="local-model", input="go", max_output_tokens=5)
    assert r.status == "incomplete" and r.usage is not None and r.usage.output_tokens == 5
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model="local-model", input="y" * 5000)
    assert exc.value.code == "context_length_exceeded"


# ---- Anthropic Messages ---------------------------------------------------------------------------------


def _final_message(live: LiveServer, ant: anthropic.Anthropic, script: Any, **kw: Any) -> Any:
    """The streamed Anthropic message of `script`'s reply to USER (the SDK assembles it from the events)."""
    live.script(script)
    with ant.messages.stream(model="local-model", max_tokens=200, messages=USER, **kw) as stream:  # type: ignore[arg-type]
        return stream.get_final_message()


def test_messages_text_and_stream(ant: anthropic.Anthropic) -> None:
    m = ant.messages.create(model="local-model", max_tokens=100, messages=USER)  # type: ignore[arg-type]
    assert m.content[0].text == "Hello from the scripted model." and m.stop_reason == "end_turn"  # type: ignore[union-attr]
    with ant.messages.stream(model="local-model", max_tokens=100, messages=USER) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello from the scripted model." and final.usage.output_tokens == len(text)


def test_messages_tool_use_round_trip(live: LiveServer, ant: anthropic.Anthropic) -> None:
    final = _final_message(live, ant, scripts.tool, tools=[scripts.SHELL_TOOL_ANTHROPIC])
    assert final.stop_reason == "tool_use"
    use = next(b for b in final.content if b.type == "tool_use")
    assert use.name == "shell" and use.input == {"command": "echo hi"} and use.id.startswith("toolu_")
    history = [
        *USER,
        {"role": "assistant", "content": [b.model_dump() for b in final.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hi", "is_error": False}],
        },
    ]
    m = ant.messages.create(model="local-model", max_tokens=200, messages=history, tools=[scripts.SHELL_TOOL_ANTHROPIC])  # type: ignore[arg-type, list-item]
    assert m.content[0].text == "Tool result received: hi"  # type: ignore[union-attr]


def test_messages_parallel_tool_use(live: LiveServer, ant: anthropic.Anthropic) -> None:
    final = _final_message(live, ant, scripts.parallel, tools=[scripts.SHELL_TOOL_ANTHROPIC])
    assert [b.input for b in final.content if b.type == "tool_use"] == [
        {"command": "echo one"},
        {"command": "echo two"},
    ]


def test_messages_thinking_round_trips_signature(live: LiveServer, ant: anthropic.Anthropic) -> None:
    final = _final_message(live, ant, scripts.thinking, thinking={"type": "enabled", "budget_tokens": 100})
    block = final.content[0]
    assert block.type == "thinking" and block.thinking == "Let me think about this." and block.signature
    assert final.content[1].text == "The answer is 4."  # type: ignore[union-attr]
    history = [
        *USER,
        {"role": "assistant", "content": [b.model_dump() for b in final.content]},
        {"role": "user", "content": "ok"},
    ]
    again = ant.messages.create(model="local-model", max_tokens=300, messages=history)  # type: ignore[arg-type]
    assert again.stop_reason == "end_turn"
    assert live.loader.target.prompts[-1].endswith("<think>\n\n</think>\n\n")  # thinking absent = off


def test_messages_stop_sequence_and_max_tokens(live: LiveServer, ant: anthropic.Anthropic) -> None:
    live.script(scripts.stop_words)
    m = ant.messages.create(model="local-model", max_tokens=50, messages=USER, stop_sequences=["STOP"])  # type: ignore[arg-type]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP"
    live.script(scripts.long)
    m = ant.messages.create(model="local-model", max_tokens=6, messages=USER)  # type: ignore[arg-type]
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6


def test_messages_overflow_wording_and_count_tokens(ant: anthropic.Anthropic) -> None:
    n = ant.messages.count_tokens(model="local-model", messages=USER).input_tokens  # type: ignore[arg-type]
    assert n > 0
    with pytest.raises(anthropic.BadRequestError) as exc:
        ant.messages.create(model="local-model", max_tokens=4090, messages=USER)  # type: ignore[arg-type]
    assert f"input length and `max_tokens` exceed context limit: {n} + 4090 > 4096" in str(exc.value)
    with pytest.raises(anthropic.BadRequestError) as exc:
        ant.messages.create(model="local-model", max_tokens=10, messages=[{"role": "user", "content": "z" * 5000}])
    assert "prompt is too long: " in str(exc.value) and "> 4096 maximum" in str(exc.value)
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.create(model="claude-nope", max_tokens=10, messages=USER)  # type: ignore[arg-type]
