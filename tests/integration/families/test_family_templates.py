"""The captured requests of Claude Code, Codex and Pi (../shared/fixtures/clients), through each dialect into the
neutral conversation, rendered with every family's template, and their tool history written in the family's
call syntax and read back. The captures are read at test time, never copied; without them this tier skips.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from mlx_dspark.adapters.api.anthropic_messages import codec as anthropic
from mlx_dspark.adapters.api.openai_chat import codec as openai_chat
from mlx_dspark.adapters.api.openai_responses import codec as responses
from mlx_dspark.adapters.families import select_codec
from mlx_dspark.domain.chat import ChatRequest, Role, ToolCallEnd
from tests.fakes.tokenizer import CHATML_TOOLS_TEMPLATE, FakeTokenizer
from tests.unit.families.streaming import feed_in_chunks
from tests.unit.families.test_family_codecs import GEMMA4, LFM2, MINICPM5, MUSE, QWEN_XML

FIXTURES = Path(__file__).resolve().parents[4] / "shared" / "fixtures" / "clients"
# Each seed family with a template carrying its markers (the real templates are not reachable offline).
TEMPLATES = {
    "qwen3_next": CHATML_TOOLS_TEMPLATE,
    "qwen3_5": QWEN_XML,
    "nemotron_h": QWEN_XML,
    "gemma4_text": GEMMA4,
    "lfm2": LFM2,
    "minicpm": MINICPM5,
    "muse_glimmer": MUSE,
}


def _captures() -> list[Path]:
    if not FIXTURES.is_dir():
        return []
    paths = sorted(FIXTURES.rglob("*.request-*.json"))
    return [p for p in paths if json.loads(p.read_text()).get("method") == "POST"]


CAPTURES = _captures()
pytestmark = pytest.mark.skipif(not CAPTURES, reason=f"client captures not found at {FIXTURES}")


def neutral(capture: Path) -> ChatRequest:
    data = json.loads(capture.read_text())
    body: Any = data["body"]
    if data["path"].endswith("/messages"):
        return anthropic.to_chat_request(anthropic.parse_messages(body))
    if data["path"].endswith("/responses"):
        return responses.to_chat_request(responses.parse(body))[0]
    return openai_chat.to_chat_request(openai_chat.parse(body))


@pytest.mark.parametrize("family", sorted(TEMPLATES))
@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_a_client_request_renders_and_its_tool_history_reads_back(capture: Path, family: str) -> None:
    request = neutral(capture)
    conversation = request.conversation
    template = TEMPLATES[family]
    codec = select_codec(family, template)
    rendered = codec.render(FakeTokenizer(template), conversation, thinking=request.thinking)
    last_user = next(m for m in reversed(conversation.messages) if m.role in (Role.USER, Role.TOOL))
    assert last_user.text.strip()[:40] in rendered.text  # the turn being answered is in the prompt
    calls = [c for m in conversation.messages for c in m.tool_calls]
    if not calls:
        return
    # Earlier calls as this family writes them parse back, with the client's own tool schemas, to the same calls.
    text = "".join(codec.format_call(c) for c in calls)
    parser = codec.parser(conversation.tools, id_factory=iter(f"id{i}" for i in range(99)).__next__)
    ends = [e for e in feed_in_chunks(parser, text, random.Random(family), 11) if isinstance(e, ToolCallEnd)]
    assert [(e.name, json.loads(e.arguments)) for e in ends] == [(c.name, dict(c.arguments)) for c in calls]
