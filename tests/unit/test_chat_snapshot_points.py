"""Snapshot points measured on the family's own template survive the next turns' re-rendering.

A Qwen3-style template strips the thinking of assistant turns that precede the latest user turn and
renders the generation prompt differently from an assistant turn in the history; the points the chat
service picks must still be prefixes of every later turn's prompt, and a snapshot-only target must
resume from them with output equal to a cold run.
"""

from __future__ import annotations

from mlx_dspark.adapters.families import select_codec
from mlx_dspark.application.chat_service import ChatService, Report
from mlx_dspark.application.generation import GenerationService
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.prefix_cache import PrefixCache
from mlx_dspark.application.settings import ServerSettings
from mlx_dspark.domain.chat import ChatRequest, Conversation, Message, Role, ToolCall, ToolSpec, TurnFinished
from mlx_dspark.domain.ports import RollbackKind
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.oracle import OracleTarget, oracle_logits
from tests.fakes.tokenizer import CHATML_TOOLS_TEMPLATE, FakeTokenizer

# Our own template in the Qwen3 manner: old thinking dropped, an empty think block in the generation prompt.
THINK_STRIPPING = """
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}
{%- if tools -%}<|im_start|>system
{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>
{% elif messages and messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}<|im_start|>assistant
{% if m.reasoning_content and loop.index0 > ns.last_user %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}{% for c in (m.tool_calls or []) %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' -%}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if not enable_thinking is defined or enable_thinking %}<think>
{% else %}<think>

</think>

{% endif %}{% endif -%}
"""

TOOLS = (ToolSpec(name="read_file", description="Read a file"),)
SYSTEM = "You are a careful coding agent. Prefer small diffs. " * 4


def agent_turns() -> list[tuple[Message, ...]]:
    """The message lists of successive requests of one agent conversation (tool loop, then a new ask)."""
    call = ToolCall(id="c1", name="read_file", arguments={"path": "a.py"})
    call2 = ToolCall(id="c2", name="read_file", arguments={"path": "b.py"})
    u1 = Message(role=Role.USER, text="Fix the bug in a.py please.")
    a1 = Message(role=Role.ASSISTANT, thinking="I should read a.py first.", tool_calls=(call,))
    t1 = Message(role=Role.TOOL, text="def f(): return 1/0", tool_call_id="c1", tool_name="read_file")
    a2 = Message(role=Role.ASSISTANT, thinking="Division by zero; also check b.py.", tool_calls=(call2,))
    t2 = Message(role=Role.TOOL, text="import a", tool_call_id="c2", tool_name="read_file")
    a3 = Message(role=Role.ASSISTANT, text="Fixed: f returns 1 now.", thinking="Done.")
    mid_system = Message(role=Role.SYSTEM, text="The user prefers short answers.")
    u2 = Message(role=Role.USER, text="Thanks. Now add a test.")
    return [(u1,), (u1, a1, t1), (u1, a1, t1, a2, t2), (u1, a1, t1, a2, t2, a3, mid_system, u2)]


def whole_prefix_logits(prefix):
    return oracle_logits(prefix, 64, context=len(prefix) + 1)


def setup(template: str | None = None, tokenizer=None, family: str = "qwen3"):
    """A chat service and a generator on a snapshot-only oracle with `tokenizer` (or a fake one for `template`)."""
    tok = tokenizer or FakeTokenizer(template)
    target = OracleTarget(vocab=64, rollback=RollbackKind.SNAPSHOT, logits_fn=whole_prefix_logits)
    model = LoadedModel(name="fake", identity="fake@0", target=target, tokenizer=tok, context_window=8192,
                        family=family)
    gen = GenerationService(model, source=None, mode="baseline", clock=FakeClock(), telemetry=RecordingTelemetrySink(),
                    prefix_cache=PrefixCache(10**9))
    return ChatService(select_codec, ServerSettings()), gen, target


def request(messages, thinking=None) -> ChatRequest:
    return ChatRequest(conversation=Conversation(system=SYSTEM, messages=messages, tools=TOOLS), max_tokens=3,
                       thinking=thinking)


def check_points_survive(template: str | None, thinking=None, covers_newest=False, tokenizer=None, family="qwen3"):
    """Every point of turn k is a prefix of every later turn's prompt, and the points are not trivial."""
    chat, gen, _ = setup(template, tokenizer, family)
    turns = agent_turns()
    prompts = [chat.prompt_ids(gen.model, request(m, thinking)) for m in turns]
    for k, messages in enumerate(turns):
        points = chat.stable_boundaries(gen, request(messages, thinking), prompts[k])
        assert points, f"no snapshot point in turn {k}"
        covered = gen.model.tokenizer.decode(prompts[k][: max(points)])
        assert messages[0].text in covered  # always past the first user turn
        if covers_newest:  # nothing is re-rendered: the newest user or tool turn is covered too
            assert messages[-1].text in covered
        for later in prompts[k + 1 :]:
            for p in points:
                assert later[:p] == prompts[k][:p], (k, p)
    return chat, gen, prompts


def test_points_survive_a_template_that_strips_old_thinking():
    check_points_survive(THINK_STRIPPING)
    check_points_survive(THINK_STRIPPING, thinking=False)


def test_points_survive_the_plain_chatml_template():
    check_points_survive(CHATML_TOOLS_TEMPLATE, covers_newest=True)


def test_the_naive_point_would_not_survive_stripping():
    """Why the measurement matters: the end of turn 2's prompt is not a prefix of turn 3's prompt."""
    chat, gen, _ = setup(THINK_STRIPPING)
    turns = agent_turns()
    p2 = chat.prompt_ids(gen.model, request(turns[2]))
    p3 = chat.prompt_ids(gen.model, request(turns[3]))
    tail = len(p2) - len("<|im_start|>assistant\n<think>\n")
    assert p3[:tail] != p2[:tail]


def run_turns(warm: bool):
    """Each turn's events and cached prompt tokens (cold: a fresh target and no cache for every turn)."""
    chat, gen, _ = setup(THINK_STRIPPING)
    events, cached = [], []
    for messages in agent_turns():
        if not warm:
            chat, gen, _ = setup(THINK_STRIPPING)
        items = list(chat.stream(gen, request(messages)))
        done = items[-1]
        assert isinstance(done, TurnFinished)
        # Reports carry timings and cached counts, which differ by design; everything else must not.
        events.append([*(i for i in items[1:-1] if not isinstance(i, Report)), done.reason])
        cached.append(done.usage.cached_prompt_tokens)
    return events, cached


def test_a_snapshot_only_target_resumes_each_turn_from_a_measured_point():
    warm_events, cached = run_turns(warm=True)
    cold_events, cold_cached = run_turns(warm=False)
    assert warm_events == cold_events
    assert cold_cached == [0, 0, 0, 0]
    chat, gen, _ = setup(THINK_STRIPPING)
    turns = agent_turns()
    prompts = [chat.prompt_ids(gen.model, request(m)) for m in turns]
    system_point = min(chat.stable_boundaries(gen, request(turns[0]), prompts[0]))
    assert cached[0] == 0
    assert all(c > system_point for c in cached[1:]), cached  # past the system prompt every time
    assert cached[2] > cached[1]  # the tool loop resumes after the previous tool result
