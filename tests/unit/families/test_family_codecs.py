"""Family codecs: selection from the template, rendering with tools and tool history, and incremental parsing
of recorded outputs in random chunkings (the events must not depend on where chunks split)."""

from __future__ import annotations

import json
import random

import pytest

from mlx_dspark.adapters.families import select_codec
from mlx_dspark.adapters.families.gemma import Gemma4Codec
from mlx_dspark.adapters.families.hermes import HermesCodec
from mlx_dspark.adapters.families.lfm2 import Lfm2Codec
from mlx_dspark.adapters.families.minicpm import MiniCpm5Codec
from mlx_dspark.adapters.families.muse import MuseCodec
from mlx_dspark.adapters.families.qwen_xml import QwenXmlCodec
from mlx_dspark.domain.chat import (
    ChatEvent,
    Conversation,
    Message,
    ReasoningDelta,
    Role,
    TextDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from tests.fakes.tokenizer import CHATML_TOOLS_TEMPLATE, FakeTokenizer
from tests.unit.families.streaming import SHELL, feed_in_chunks

# Minimal templates of our own with each family's markers (the real ones are not available offline).
PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_XML = (
    "{% if tools %}<tools>{% for t in tools %}<function><name>{{ t.function.name }}</name></function>{% endfor %}"
    "</tools>\n{% endif %}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}\n{% endfor %}{% if add_generation_prompt %}[assistant]<think>\n{% endif %}"
)
GEMMA4 = (
    "{% if tools %}<|tools>{{ tools | length }} tools<tools|>{% endif %}"
    "{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}<|turn>model\n"
    "{# calls look like <|tool_call>call:name{...}<tool_call|> #}"
)
LFM2 = (
    "{% if tools %}List of tools: <|tool_list_start|>{{ tools | tojson }}<|tool_list_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    "{# <|tool_call_start|> #}"
)
MINICPM5 = (
    '{% if tools %}<tools>{% for t in tools %}<function name="{{ t.function.name }}">{% for k in '
    't.function.parameters.properties %}<param name="{{ k }}"/>{% endfor %}</function>{% endfor %}</tools>\n'
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    '{% for c in m.tool_calls or [] %}<function name="{{ c.function.name }}">'
    '{% for k, v in c.function.arguments.items() %}<param name="{{ k }}">{{ v }}</param>{% endfor %}</function>'
    "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n<think>\n"
)
MUSE = (
    "{% if tools %}<atem:tools>{{ tools | tojson }}</atem:tools>\n{% endif %}"
    "{% for m in messages %}<|header_start|>{{ m.role }}<|header_end|>\n{{ m.content }}"
    '{% for c in m.tool_calls or [] %}<atem:function_calls>\n<atem:invoke name="{{ c.function.name }}">\n'
    '{% for k, v in c.function.arguments.items() %}<atem:parameter name="{{ k }}">{{ v }}</atem:parameter>\n'
    "{% endfor %}</atem:invoke>\n</atem:function_calls>{% endfor %}<|eot|>{% endfor %}"
    "<|header_start|>assistant<|header_end|>\n"
)
GEMMA3 = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}"
    "<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
)

HISTORY = Conversation(
    system="Be brief.",
    messages=(
        Message(role=Role.USER, text="list files"),
        Message(role=Role.SYSTEM, text="cwd is /tmp"),
        Message(role=Role.ASSISTANT, tool_calls=(ToolCall(id="c1", name="shell", arguments={"command": "ls"}),)),
        Message(role=Role.TOOL, text="a.txt", tool_call_id="c1", tool_name="shell"),
        Message(role=Role.USER, text="thanks"),
    ),
    tools=(SHELL,),
)


def test_selection_follows_the_template_not_the_output() -> None:
    assert isinstance(select_codec("qwen3", CHATML_TOOLS_TEMPLATE), HermesCodec)
    assert select_codec("qwen3", CHATML_TOOLS_TEMPLATE).native_tools
    assert isinstance(select_codec("qwen3_5", QWEN_XML), QwenXmlCodec)
    assert isinstance(select_codec("gemma4", GEMMA4), Gemma4Codec)
    assert isinstance(select_codec("lfm2", LFM2), Lfm2Codec)
    assert isinstance(select_codec("minicpm", MINICPM5), MiniCpm5Codec)
    assert select_codec("minicpm", MINICPM5).think == ("<think>", "</think>")
    assert isinstance(select_codec("muse_glimmer", MUSE), MuseCodec)
    assert isinstance(select_codec("nemotron_h", QWEN_XML.replace("[assistant]<think>", "[assistant]")), QwenXmlCodec)
    assert not isinstance(select_codec("muse_glimmer", PLAIN_CHATML), MuseCodec)  # no markers: the text fallback
    fallback = select_codec("llama", PLAIN_CHATML)  # SmolLM2-style template without tool support
    assert isinstance(fallback, HermesCodec) and not fallback.native_tools and fallback.think is None
    assert not select_codec("gemma3", GEMMA3).native_tools


def test_render_native_hermes_golden() -> None:
    tok = FakeTokenizer()
    rendered = select_codec("qwen3", tok.chat_template).render(tok, HISTORY, thinking=False)
    expected_tail = (
        "<|im_start|>user\nlist files\n\n<system>\ncwd is /tmp\n</system><|im_end|>\n"
        "<|im_start|>assistant\n\n<tool_call>\n"
        '{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nthanks<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert rendered.text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert rendered.text.endswith(expected_tail)
    assert not rendered.starts_in_thinking
    assert select_codec("qwen3", tok.chat_template).render(tok, HISTORY, thinking=True).starts_in_thinking


def test_render_fallback_writes_tools_and_history_as_text() -> None:
    tok = FakeTokenizer(PLAIN_CHATML)
    text = select_codec("llama", PLAIN_CHATML).render(tok, HISTORY, thinking=None).text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "shell"' in text.split("<|im_end|>")[0]
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        + '{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
    ) in text
    assert "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n\nthanks<|im_end|>" in text  # merged turns


def test_render_other_families() -> None:
    q = select_codec("qwen3_5", QWEN_XML).render(FakeTokenizer(QWEN_XML), HISTORY, thinking=True)
    assert "<tools><function><name>shell</name></function></tools>" in q.text
    assert "<function=shell>\n<parameter=command>\nls\n</parameter>\n</function>" in q.text
    assert q.starts_in_thinking
    g = select_codec("gemma4", GEMMA4).render(FakeTokenizer(GEMMA4), HISTORY, thinking=None)
    assert "<|tools>1 tools<tools|>" in g.text
    lfm = select_codec("lfm2", LFM2).render(FakeTokenizer(LFM2), HISTORY, thinking=None)
    assert "<|tool_call_start|>[shell(command='ls')]<|tool_call_end|>" in lfm.text  # calls go in as text
    mc = select_codec("minicpm", MINICPM5).render(FakeTokenizer(MINICPM5), HISTORY, thinking=True)
    assert '<function name="shell"><param name="command">ls</param></function>' in mc.text
    assert mc.starts_in_thinking
    mu = select_codec("muse_glimmer", MUSE).render(FakeTokenizer(MUSE), HISTORY, thinking=None)
    assert '<atem:invoke name="shell">\n<atem:parameter name="command">ls</atem:parameter>' in mu.text
    g3 = select_codec("gemma3", GEMMA3).render(FakeTokenizer(GEMMA3), HISTORY, thinking=None)
    assert "<start_of_turn>model\n<tool_call>" in g3.text


def _merged(events: list[ChatEvent]) -> list[ChatEvent]:
    out: list[ChatEvent] = []
    for e in events:
        if out and type(e) is type(out[-1]) and isinstance(e, TextDelta | ReasoningDelta):
            out[-1] = type(e)(out[-1].text + e.text)  # type: ignore[union-attr]
        elif out and isinstance(e, ToolCallArgsDelta) and isinstance(out[-1], ToolCallArgsDelta):
            out[-1] = ToolCallArgsDelta(index=e.index, delta=out[-1].delta + e.delta)  # streamed in pieces
        else:
            out.append(e)
    return out


def _parse(codec: object, text: str, rng: random.Random, *, thinking: bool = False) -> list[ChatEvent]:
    ids = iter(f"id{i}" for i in range(100))
    parser = codec.parser([SHELL], starts_in_thinking=thinking, id_factory=lambda: next(ids))  # type: ignore[attr-defined]
    return _merged(feed_in_chunks(parser, text, rng, 9))


def _call(i: int, args: str) -> list[ChatEvent]:
    return [
        ToolCallStart(index=i, id=f"id{i}", name="shell"),
        ToolCallArgsDelta(index=i, delta=args),
        ToolCallEnd(index=i, id=f"id{i}", name="shell", arguments=args),
    ]


RECORDED = [
    (
        "hermes",
        HermesCodec(native_tools=True, think=("<think>", "</think>")),
        "<think>\nNeed ls.\n</think>\n\nOk.\n<tool_call>\n"
        '{"name": "shell", "arguments": {"command": "ls", "timeout": 5}}\n'
        '</tool_call>\n<tool_call>\n{"name": "shell", "arguments": "{\\"command\\": \\"pwd\\"}"}\n</tool_call>',
        False,
        [
            ReasoningDelta("Need ls."),
            TextDelta("Ok."),
            *_call(0, '{"command": "ls", "timeout": 5}'),
            *_call(1, '{"command": "pwd"}'),
        ],
    ),
    (
        "hermes-preopened-think",
        HermesCodec(native_tools=True, think=("<think>", "</think>")),
        "Thinking already.\n</think>\n\nDone <tool_call> is a tag I mention.",
        True,
        [ReasoningDelta("Thinking already."), TextDelta("Done <tool_call> is a tag I mention.")],
    ),
    (
        "qwen-xml",
        QwenXmlCodec(native_tools=True, think=("<think>", "</think>")),
        "Sure.\n<tool_call>\n<function=shell>\n<parameter=command>\nls -la\n</parameter>\n<parameter=timeout>\n30\n"
        "</parameter>\n</function>\n</tool_call>",
        False,
        [TextDelta("Sure."), *_call(0, '{"command": "ls -la", "timeout": 30}')],
    ),
    (
        "gemma4",
        Gemma4Codec(native_tools=True, think=("<|channel>thought", "<channel|>")),
        "<|channel>thought\nHmm.<channel|>On it."
        '<|tool_call>call:shell{command:<|"|>echo "a,b"<|"|>,timeout:2}<tool_call|>',
        False,
        [ReasoningDelta("Hmm."), TextDelta("On it."), *_call(0, '{"command": "echo \\"a,b\\"", "timeout": 2}')],
    ),
    (
        "lfm2",
        Lfm2Codec(native_tools=True, calls_in_content=True),
        'Running.<|tool_call_start|>[shell(command="ls", timeout=3), shell(command="pwd")]<|tool_call_end|>Bye.',
        False,
        [
            TextDelta("Running."),
            *_call(0, '{"command": "ls", "timeout": 3}'),
            *_call(1, '{"command": "pwd"}'),
            TextDelta("Bye."),
        ],
    ),
    (
        "minicpm5",
        MiniCpm5Codec(native_tools=True, think=("<think>", "</think>")),
        "Plan.\n</think>\n\nChecking."
        '<function name="shell"><param name="command"><![CDATA[grep -c "<a>" x &&\nwc -l]]></param>'
        '<param name="timeout">7</param></function><function name="shell"><param name="command">pwd</param></function>',
        True,
        [
            ReasoningDelta("Plan."),
            TextDelta("Checking."),
            *_call(0, '{"command": "grep -c \\"<a>\\" x &&\\nwc -l", "timeout": 7}'),
            *_call(1, '{"command": "pwd"}'),
        ],
    ),
    (
        "muse",
        MuseCodec(native_tools=True),
        'Two calls.<atem:function_calls>\n<atem:invoke name="shell">\n<atem:parameter name="command">ls "d"'
        '</atem:parameter>\n<atem:parameter name="timeout">4</atem:parameter>\n</atem:invoke>\n'
        '<atem:invoke name="shell">\n<atem:parameter name="command">42</atem:parameter>\n</atem:invoke>\n'
        "</atem:function_calls>",
        False,
        [
            TextDelta("Two calls."),
            *_call(0, '{"command": "ls \\"d\\"", "timeout": 4}'),
            *_call(1, '{"command": "42"}'),
        ],
    ),
]


@pytest.mark.parametrize(
    "codec",
    [
        HermesCodec(native_tools=True),
        QwenXmlCodec(native_tools=True),
        Gemma4Codec(native_tools=True),
        Lfm2Codec(native_tools=True),
        MiniCpm5Codec(native_tools=True),
        MuseCodec(native_tools=True),
    ],
    ids=lambda c: c.name,
)
def test_every_codec_reads_back_the_calls_it_writes(codec: object) -> None:
    """Tool history as the family writes it parses back to the same calls (names, typed arguments)."""
    calls = [
        ToolCall(id="a", name="shell", arguments={"command": 'printf "<%s>" a & b\n', "timeout": 3}),
        ToolCall(id="b", name="shell", arguments={"command": "ls"}),
    ]
    text = "".join(codec.format_call(c) for c in calls)  # type: ignore[attr-defined]
    events = _parse(codec, text, random.Random(codec.name))  # type: ignore[attr-defined]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [(e.name, json.loads(e.arguments)) for e in ends] == [(c.name, dict(c.arguments)) for c in calls]
    assert not [e for e in events if isinstance(e, TextDelta) and e.text.strip()]


@pytest.mark.parametrize(("name", "codec", "text", "thinking", "expected"), RECORDED, ids=[r[0] for r in RECORDED])
def test_parse_recorded_outputs_in_random_chunkings(
    name: str, codec: object, text: str, thinking: bool, expected: list[ChatEvent]
) -> None:
    rng = random.Random(name)
    for _ in range(40):
        assert _parse(codec, text, rng, thinking=thinking) == expected


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "shell", "arguments": {"cmd": "ls"}}',  # required parameter missing
        '{"name": "shell", "arguments": {"command": 3}}',  # wrong type
        '{"name": "rm_rf", "arguments": {}}',  # not an offered tool
        '{"name": "shell", "arguments": {"timeout": 3, "cmd": "ls"',  # truncated before it is surely a call
        '{"name": "shell", "arguments": {"timeout": "soon", "command": "ls"}}',  # a member fails first
        '["shell", "ls"]',  # not a call object
    ],
)
def test_botched_calls_come_back_as_text(body: str) -> None:
    text = f"<tool_call>\n{body}\n</tool_call>"
    events = _parse(HermesCodec(native_tools=True), text, random.Random(0))
    assert events == [TextDelta(text)]


def test_unterminated_call_at_end_of_output_is_still_tried() -> None:
    text = '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}\n'
    assert _parse(HermesCodec(native_tools=True), text, random.Random(1)) == _call(0, '{"command": "ls"}')


def test_no_tools_means_markers_are_text() -> None:
    parser = HermesCodec(native_tools=True).parser([])
    events = parser.feed('<tool_call>{"name": "shell", "arguments": {}}</tool_call>') + parser.finish()
    assert _merged(events) == [TextDelta('<tool_call>{"name": "shell", "arguments": {}}</tool_call>')]
