"""Tool-call arguments stream as the model writes them, once the call is surely a call; forced call openers."""

from __future__ import annotations

import json
import random

import pytest

from mlx_dspark.adapters.families.gemma import Gemma4Codec
from mlx_dspark.adapters.families.hermes import HermesCodec
from mlx_dspark.adapters.families.lfm2 import Lfm2Codec
from mlx_dspark.adapters.families.minicpm import MiniCpm5Codec
from mlx_dspark.adapters.families.muse import MuseCodec
from mlx_dspark.adapters.families.qwen_xml import QwenXmlCodec
from mlx_dspark.domain.chat import ChatEvent, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, ToolSpec
from tests.unit.families.streaming import SHELL, feed_in_chunks

WRITE = ToolSpec(
    name="write",
    parameters={
        "type": "object",
        "properties": {"path": {"type": "string"}, "content": {"type": "string"}, "mode": {"enum": ["w", "a"]}},
        "required": ["path", "content"],
        "additionalProperties": False,
    },
)


def _parser(tools: list[ToolSpec] | None = None, **kwargs: object):  # type: ignore[no-untyped-def]
    ids = iter(f"id{i}" for i in range(100))
    return HermesCodec(native_tools=True).parser(tools or [SHELL, WRITE], id_factory=lambda: next(ids), **kwargs)  # type: ignore[arg-type]


def _feed_chars(parser, text: str) -> list[list[ChatEvent]]:  # type: ignore[no-untyped-def]
    """Events after each character (one list per character), then the finish events as the last list."""
    return [parser.feed(c) for c in text] + [parser.finish()]


def _flat(steps: list[list[ChatEvent]]) -> list[ChatEvent]:
    return [e for step in steps for e in step]


def _args(events: list[ChatEvent], index: int = 0) -> str:
    return "".join(e.delta for e in events if isinstance(e, ToolCallArgsDelta) and e.index == index)


def test_a_long_argument_streams_while_it_is_written() -> None:
    content = 'line one\nline "two" \u00e9\t\U0001f600 end'
    body = json.dumps({"name": "write", "arguments": {"path": "a.txt", "content": content}}, ensure_ascii=True)
    text = f"Writing.\n<tool_call>\n{body}\n</tool_call>"
    parser = _parser()
    steps = _feed_chars(parser, text)
    events = _flat(steps)
    end_at = text.index("</tool_call>")
    start_step = next(i for i, s in enumerate(steps) if any(isinstance(e, ToolCallStart) for e in s))
    delta_steps = [i for i, s in enumerate(steps) if any(isinstance(e, ToolCallArgsDelta) for e in s)]
    assert start_step < end_at and len([i for i in delta_steps if i < end_at]) > 10  # before the end marker
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.arguments == _args(events)  # the deltas are the arguments
    assert json.loads(end.arguments) == {"path": "a.txt", "content": content}
    assert not parser.cut
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Writing."


@pytest.mark.parametrize("seed", range(20))
def test_events_do_not_depend_on_chunking(seed: int) -> None:
    body = '{"name": "shell", "arguments": {"timeout": 5, "command": "echo \\"hi\\" \\u00e9 \\ud83d\\ude00"}}'
    text = f"<tool_call>\n{body}\n</tool_call>after"
    rng = random.Random(seed)
    parser = _parser()
    events = feed_in_chunks(parser, text, rng, 7)
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert json.loads(end.arguments) == {"timeout": 5, "command": 'echo "hi" \u00e9 \U0001f600'}
    assert end.arguments == _args(events) == json.dumps(json.loads(end.arguments), ensure_ascii=False)
    kinds = [type(e) for e in events if not isinstance(e, ToolCallArgsDelta)]
    assert kinds[:2] == [ToolCallStart, ToolCallEnd] and set(kinds[2:]) == {TextDelta}


def test_held_back_until_every_required_argument_has_begun() -> None:
    text = '<tool_call>\n{"name": "shell", "arguments": {"timeout": 30, "command": "ls"}}\n</tool_call>'
    parser = _parser()
    steps = _feed_chars(parser, text)
    first = next(i for i, s in enumerate(steps) if s)
    assert first == text.index('"ls"')  # the opening quote of the required value releases the call
    assert steps[first][0] == ToolCallStart(index=0, id="id0", name="shell")
    assert steps[first][1] == ToolCallArgsDelta(index=0, delta='{"timeout": 30, "command": "')


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "write", "arguments": {"path": "a", "bogus": 1, "content": "x"}}',  # additionalProperties
        '{"name": "write", "arguments": {"path": "a", "mode": "x", "content": "x"}}',  # enum
        '{"name": "shell", "arguments": {"command": 7}}',  # type of a required value
        '{"name": "shell", "arguments": {"timeout": 1, "timeout": 2}}',  # a repeated key
        '{"arguments": {"command": "ls"}, "name": "rm"}',  # name last and not offered
    ],
)
def test_failures_before_release_come_back_as_text(body: str) -> None:
    text = f"<tool_call>\n{body}\n</tool_call>"
    parser = _parser()
    events = _flat(_feed_chars(parser, text))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text
    assert not any(isinstance(e, ToolCallStart | ToolCallEnd) for e in events)


def test_name_after_arguments_is_still_a_call_checked_whole() -> None:
    text = '<tool_call>\n{"arguments": {"command": "ls"}, "name": "shell"}\n</tool_call>'
    events = _flat(_feed_chars(_parser(), text))
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta, ToolCallEnd]
    assert json.loads(_args(events)) == {"command": "ls"}


@pytest.mark.parametrize(
    ("body", "args", "rest"),
    [
        ('{"name": "shell", "arguments": {"command": "rm -rf /tm', {"command": "rm -rf /tm"}, ""),  # stops mid-value
        ('{"name": "shell", "arguments": {"command": "ls"', {"command": "ls"}, ""),  # braces never closed
        ('{"name": "shell", "arguments": {"command": "a\\qb"}}', {"command": "a"}, '\\qb"}}'),  # a bad escape
        (
            '{"name": "shell", "arguments": {"command": "ls", "timeout": "soon"}}',  # a later member fails
            {"command": "ls"},
            ', "timeout": "soon"}}',
        ),
    ],
)
def test_a_call_that_fails_after_release_ends_cut_and_keeps_the_rest_as_text(
    body: str, args: dict[str, object], rest: str
) -> None:
    parser = _parser()
    events = _flat(_feed_chars(parser, f"<tool_call>\n{body}"))
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert json.loads(end.arguments) == args and end.arguments == _args(events)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == rest
    assert parser.cut  # the turn then finishes as cut by the limit: clients do not run it


def test_trailing_text_inside_the_block_of_a_whole_call_is_text() -> None:
    parser = _parser()
    text = '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}} oops\n</tool_call>'
    events = _flat(_feed_chars(parser, text))
    assert json.loads(_args(events)) == {"command": "ls"}
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "oops\n</tool_call>"
    assert parser.cut


def test_a_schema_that_cannot_be_checked_member_by_member_is_checked_whole() -> None:
    either = ToolSpec(
        name="pick",
        parameters={"type": "object", "properties": {"a": {"type": "string"}}, "anyOf": [{"required": ["a"]}]},
    )
    text = '<tool_call>\n{"name": "pick", "arguments": {"a": "x"}}\n</tool_call>'
    steps = _feed_chars(_parser([either]), text)
    assert not any(_flat(steps[: text.index("</tool_call>")]))  # nothing before the end marker
    assert json.loads(_args(_flat(steps))) == {"a": "x"}


def test_forced_named_call_is_primed_and_parsed() -> None:
    codec = HermesCodec(native_tools=True, think=("<think>", "</think>"))
    suffix, seen = codec.forced_call("shell", in_thinking=True)
    assert suffix == '</think>\n\n<tool_call>\n{"name": "shell", "arguments": ' and suffix.endswith(seen)
    ids = iter(["c1"])
    parser = codec.parser([SHELL], id_factory=lambda: next(ids), forced=seen)
    events = _flat(_feed_chars(parser, '{"command": "ls"}}\n</tool_call>'))
    assert events[0] == ToolCallStart(index=0, id="c1", name="shell")
    assert json.loads(_args(events)) == {"command": "ls"} and isinstance(events[-1], ToolCallEnd)


def test_forced_call_the_model_botches_is_text_with_its_opening() -> None:
    codec = HermesCodec(native_tools=True)
    suffix, seen = codec.forced_call(None, in_thinking=False)
    assert suffix == '<tool_call>\n{"name": "'
    parser = codec.parser([SHELL], forced=seen)
    events = _flat(_feed_chars(parser, 'nope", "arguments": {}}\n</tool_call>'))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    assert parser.calls == 0


# ---- Qwen XML ------------------------------------------------------------------------------------------------


def _xml_parser(tools: list[ToolSpec] | None = None):  # type: ignore[no-untyped-def]
    ids = iter(f"id{i}" for i in range(100))
    codec = QwenXmlCodec(native_tools=True)
    return codec.parser(tools or [SHELL, WRITE], id_factory=lambda: next(ids))


def test_xml_string_parameters_stream_and_other_types_are_converted() -> None:
    content = 'first line\n  "quoted" </param> not the end\nlast'
    text = (
        "<tool_call>\n<function=write>\n<parameter=path>\nnotes.txt\n</parameter>\n"
        f"<parameter=content>\n{content}\n</parameter>\n<parameter=mode>\na\n</parameter>\n</function>\n</tool_call>"
    )
    parser = _xml_parser()
    steps = _feed_chars(parser, text)
    events = _flat(steps)
    end_at = text.index("</tool_call>")
    assert len([s for s in steps[:end_at] if any(isinstance(e, ToolCallArgsDelta) for e in s)]) > 20
    assert next(i for i, s in enumerate(steps) if s) == text.index("<parameter=content>") + len("<parameter=content>")
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert json.loads(end.arguments) == {"path": "notes.txt", "content": content, "mode": "a"}
    assert end.arguments == _args(events) and not parser.cut


@pytest.mark.parametrize("seed", range(10))
def test_xml_events_do_not_depend_on_chunking(seed: int) -> None:
    text = (
        "<tool_call>\n<function=shell>\n<parameter=timeout>\n30\n</parameter>\n<parameter=command>\n"
        "ls -la\n\n</parameter>\n</function>\n</tool_call>"
    )
    rng = random.Random(seed)
    parser = _xml_parser()
    events = feed_in_chunks(parser, text, rng, 6)
    assert json.loads(_args(events)) == {"timeout": 30, "command": "ls -la\n"}  # one layout newline each side


@pytest.mark.parametrize(
    "body",
    [
        "<function=shell>\n<parameter=timeout>\nsoon\n</parameter>\n</function>",  # wrong type, before release
        "<function=nope>\n<parameter=command>\nls\n</parameter>\n</function>",  # not an offered tool
        "<function=shell>\n<parameter=cmd>\nls\n</parameter>\n</function>",  # required parameter missing
    ],
)
def test_xml_botched_calls_are_text(body: str) -> None:
    text = f"<tool_call>\n{body}\n</tool_call>"
    events = _flat(_feed_chars(_xml_parser(), text))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text
    assert not any(isinstance(e, ToolCallStart) for e in events)


# ---- forced call openers, every family -------------------------------------------------------------------------

FAMILIES = [
    (
        HermesCodec(native_tools=True),
        '{"command": "ls"}}\n</tool_call>',
        'shell", "arguments": {"command": "ls"}}\n</tool_call>',
    ),
    (
        QwenXmlCodec(native_tools=True),
        "<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>",
        "shell>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>",
    ),
    (Gemma4Codec(native_tools=True), '{command:<|"|>ls<|"|>}<tool_call|>', 'shell{command:<|"|>ls<|"|>}<tool_call|>'),
    (Lfm2Codec(native_tools=True), 'command="ls")]<|tool_call_end|>', 'shell(command="ls")]<|tool_call_end|>'),
    (
        MiniCpm5Codec(native_tools=True),
        '<param name="command">ls</param></function>',
        'shell"><param name="command">ls</param></function>',
    ),
    (
        MuseCodec(native_tools=True),
        '<atem:parameter name="command">ls</atem:parameter>\n</atem:invoke>\n</atem:function_calls>',
        'shell">\n<atem:parameter name="command">ls</atem:parameter>\n</atem:invoke>\n</atem:function_calls>',
    ),
]


@pytest.mark.parametrize(("codec", "named_rest", "any_rest"), FAMILIES, ids=lambda v: getattr(v, "name", ""))
def test_every_family_primes_a_forced_call(codec: object, named_rest: str, any_rest: str) -> None:
    for name, rest in (("shell", named_rest), (None, any_rest)):
        suffix, seen = codec.forced_call(name, in_thinking=False)  # type: ignore[attr-defined]
        assert suffix == codec.tool_start + seen  # type: ignore[attr-defined]
        if name:
            assert "shell" in seen
        parser = codec.parser([SHELL], forced=seen)  # type: ignore[attr-defined]
        events = _flat(_feed_chars(parser, rest))
        assert [e.name for e in events if isinstance(e, ToolCallEnd)] == ["shell"], (codec, name)
        assert json.loads(_args(events)) == {"command": "ls"}


@pytest.mark.parametrize("family", ["json", "xml"])
def test_a_very_long_streamed_value_comes_through_whole(family: str) -> None:
    content = "".join(f'line {i}: "x" \\ \u00e9 </param\n' for i in range(600))  # past the compaction threshold
    if family == "json":
        parser = _parser()
        text = (
            "<tool_call>\n"
            + json.dumps({"name": "write", "arguments": {"path": "p", "content": content}})
            + "\n</tool_call>"
        )
    else:
        parser = _xml_parser()
        text = (
            "<tool_call>\n<function=write>\n<parameter=path>\np\n</parameter>\n"
            f"<parameter=content>\n{content}\n</parameter>\n</function>\n</tool_call>"
        )
    rng = random.Random(family)
    events = feed_in_chunks(parser, text, rng, 40)
    assert sum(isinstance(e, ToolCallArgsDelta) for e in events) > 100
    assert json.loads(_args(events)) == {"path": "p", "content": content} and not parser.cut
