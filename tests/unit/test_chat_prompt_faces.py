"""Every face renders a chat the same way: the CLI's and the Python API's messages go through the model family's
codec, as a server request does, so the model sees the same tokens from each."""

from __future__ import annotations

from mlx_dspark.application import bootstrap
from mlx_dspark.application.chat_service import ChatService, conversation_of
from mlx_dspark.application.generation import GenerationRequest
from mlx_dspark.application.modes import build_generator
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.chat import ChatRequest, Role
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.scripted import ScriptedLoader

TOOLS = [
    {
        "type": "function",
        "function": {"name": "read", "description": "Read a file", "parameters": {"type": "object", "properties": {}}},
    }
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Read a.txt"}]},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "function": {"name": "read", "arguments": '{"path": "a.txt"}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "name": "read", "content": "hello"},
]


def _setup() -> tuple[object, ChatService, object]:
    settings = load_settings({"mode": "baseline"}, environ={})
    services = bootstrap.build(
        settings, loader=ScriptedLoader(), telemetry=RecordingTelemetrySink(), clock=FakeClock(), calibration=object()
    )
    gen = build_generator(services, settings)
    return gen, ChatService(services.families, settings.server), gen.model


def test_messages_from_the_cli_or_the_api_render_as_a_server_request_does() -> None:
    gen, chat, model = _setup()
    ids = gen.encode_prompt(GenerationRequest(prompt=MESSAGES, tools=tuple(TOOLS)))  # type: ignore[attr-defined]
    server = chat.prompt_ids(model, ChatRequest(conversation=conversation_of(MESSAGES, TOOLS)))  # type: ignore[arg-type]
    assert ids == server
    text = model.tokenizer.decode(ids)  # type: ignore[attr-defined]
    assert "You are terse." in text and "hello" in text and '"path": "a.txt"' in text


def test_a_text_prompt_is_one_user_turn_through_the_codec() -> None:
    gen, chat, model = _setup()
    ids = gen.encode_prompt(GenerationRequest(prompt="hi there"))  # type: ignore[attr-defined]
    one = conversation_of([{"role": "user", "content": "hi there"}])
    assert ids == chat.prompt_ids(model, ChatRequest(conversation=one))  # type: ignore[arg-type]


def test_plain_messages_become_the_neutral_conversation() -> None:
    conv = conversation_of(MESSAGES, TOOLS)
    assert conv.system == "You are terse." and [t.name for t in conv.tools] == ["read"]
    assert [m.role for m in conv.messages] == [Role.USER, Role.ASSISTANT, Role.TOOL]
    assert conv.messages[0].text == "Read a.txt"
    assert conv.messages[1].tool_calls[0].arguments == {"path": "a.txt"}
    assert conv.messages[2].tool_call_id == "c1" and conv.messages[2].text == "hello"
