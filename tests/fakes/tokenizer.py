"""A character-level tokenizer with a real Jinja chat template (ChatML with Hermes-style tools and thinking)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_dspark.domain.model import ChatMessages, TemplateVars, ToolSpecs

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = "?"

# Our own ChatML-style template in the shape of the Qwen/Hermes family: tools listed in the system turn,
# calls as <tool_call> JSON, tool results as <tool_response> user turns, optional <think> prefill.
CHATML_TOOLS_TEMPLATE = """
{%- set msgs = messages -%}
{%- if tools -%}
<|im_start|>system
{% if msgs and msgs[0].role == 'system' %}{{ msgs[0].content }}

{% endif %}# Tools
Call a function by replying with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
Available functions:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools><|im_end|>
{% elif msgs and msgs[0].role == 'system' -%}
<|im_start|>system
{{ msgs[0].content }}<|im_end|>
{% endif -%}
{%- for m in msgs -%}
{%- if m.role == 'system' -%}
{%- if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif -%}
{%- elif m.role == 'user' -%}
<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- for c in (m.tool_calls or []) %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else -%}
{{ raise_exception('Unknown role: ' ~ m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% elif enable_thinking is defined %}<think>

</think>

{% endif -%}
{%- endif -%}
"""


def _raise(message: str) -> None:
    raise TemplateError(message)


class FakeTokenizer:
    """One id per character (printable ASCII, tab, newline; anything else reads back as '?').

    Args:
        chat_template: the Jinja source; defaults to CHATML_TOOLS_TEMPLATE.
    """

    def __init__(self, chat_template: str | None = CHATML_TOOLS_TEMPLATE) -> None:
        self._template_source = chat_template
        self._pieces = list(SPECIALS) + list(CHARS)
        self._ids = {p: i for i, p in enumerate(self._pieces)}
        self._unknown = self._ids[UNKNOWN]
        env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(chat_template) if chat_template else None
        self.renders = 0

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset({self._ids["<|im_end|>"], self._ids["<|endoftext|>"]})

    @property
    def eos_id(self) -> int:
        return self._ids["<|im_end|>"]

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    @property
    def max_token_bytes(self) -> int:
        return max(len(p.encode("utf-8")) for p in self._pieces)

    @property
    def chat_template(self) -> str | None:
        return self._template_source

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        out: list[int] = []
        i = 0
        while i < len(text):
            if text[i] == "<":
                special = next((s for s in SPECIALS if text.startswith(s, i)), None)
                if special is not None:
                    out.append(self._ids[special])
                    i += len(special)
                    continue
            out.append(self._ids.get(text[i], self._unknown))
            i += 1
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._pieces[i] for i in ids)

    def render_chat(
        self, messages: ChatMessages, *, tools: ToolSpecs | None = None, template_kwargs: TemplateVars | None = None
    ) -> str:
        if self._template is None:
            raise ValueError("no chat template")
        self.renders += 1
        return self._template.render(
            messages=list(messages), tools=tools, add_generation_prompt=True, **(template_kwargs or {})
        )
