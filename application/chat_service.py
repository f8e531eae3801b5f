"""Use case: one chat turn — neutral conversation → prompt (family codec) → GenerationService → neutral events.

Also counts prompt tokens with the real template and tokenizer, and enforces the context window before
any token is generated, so each dialect can answer with its clients' exact overflow wording.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import attrs

from mlx_dspark.application.generation import GenerationDone, GenerationRequest, GenerationService, TextChunk
from mlx_dspark.application.ports import LoadedModel, Tokenizer
from mlx_dspark.application.settings import ServerSettings
from mlx_dspark.domain.chat import (
    ChatEvent,
    ChatRequest,
    ChatUsage,
    Conversation,
    OutputTooLong,
    PromptTooLong,
    ToolChoiceMode,
    ToolSpec,
    TurnFinished,
)
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.tokens import FinishReason


class RenderedPrompt(Protocol):
    @property
    def text(self) -> str: ...

    @property
    def starts_in_thinking(self) -> bool: ...


class OutputParser(Protocol):
    """Incremental model-output parser of one turn (see adapters.families.base.StreamParser)."""

    calls: int
    reasoning_text: list[str]

    def feed(self, chunk: str) -> list[ChatEvent]: ...

    def finish(self) -> list[ChatEvent]: ...


class FamilyCodec(Protocol):
    """Renders a conversation for one model family and parses its output."""

    def render(
        self, template: Tokenizer, conversation: Conversation, *, thinking: bool | None, offer_tools: bool = True
    ) -> RenderedPrompt: ...

    def parser(
        self,
        tools: Sequence[ToolSpec],
        *,
        starts_in_thinking: bool = False,
        id_factory: Callable[[], str] | None = None,
    ) -> OutputParser: ...


# (model family, chat template) → codec; wired by bootstrap so use cases never import adapters.
FamilySelector = Callable[[str, str | None], FamilyCodec]


@attrs.frozen(kw_only=True)
class Prepared:
    """The turn fits: sent before the first event so the caller can answer errors with a status code."""

    prompt_tokens: int
    max_tokens: int


ChatItem = Prepared | ChatEvent


@attrs.frozen(kw_only=True)
class _Turn:
    ids: list[int]
    max_tokens: int
    tools: tuple[ToolSpec, ...]
    starts_in_thinking: bool
    codec: FamilyCodec


class ChatService:
    """Runs chat turns on whatever GenerationService the engine owns.

    Args:
        families: picks the family codec of a model.
        settings: server limits (context window override, max-tokens cap).
    """

    def __init__(self, families: FamilySelector, settings: ServerSettings) -> None:
        self._families = families
        self._settings = settings
        self._codecs: dict[str, FamilyCodec] = {}

    def context_window(self, model: LoadedModel) -> int:
        return self._settings.context_window or model.context_window

    def codec(self, model: LoadedModel) -> FamilyCodec:
        if model.identity not in self._codecs:
            self._codecs[model.identity] = self._families(model.family, model.tokenizer.chat_template)
        return self._codecs[model.identity]

    def count_tokens(self, generator: GenerationService, request: ChatRequest) -> int:
        """Prompt tokens of the request through the real chat template and tokenizer."""
        ids, _, _, _ = self._render(generator.model, request)
        return len(ids)

    def stream(self, generator: GenerationService, request: ChatRequest) -> Iterator[ChatItem]:
        """Yield Prepared, then text / reasoning / tool-call events, then one TurnFinished.

        Raises:
            PromptTooLong: the prompt alone does not fit the context window.
            OutputTooLong: a strict-budget request's max_tokens does not fit next to the prompt.
            InvalidRequest: the chat template cannot render the conversation.
        """
        turn = self._prepare(generator.model, request)
        yield Prepared(prompt_tokens=len(turn.ids), max_tokens=turn.max_tokens)
        parser = turn.codec.parser(turn.tools, starts_in_thinking=turn.starts_in_thinking)
        greq = GenerationRequest(
            prompt=turn.ids,
            max_tokens=turn.max_tokens,
            sampling=request.sampling,
            stop=request.stop,
            request_id=request.request_id or GenerationRequest(prompt="").request_id,
        )
        done: GenerationDone | None = None
        with contextlib.closing(generator.stream(greq, prompt_ids=turn.ids)) as events:
            for event in events:
                if isinstance(event, TextChunk):
                    yield from parser.feed(event.text)
                else:
                    done = event
        yield from parser.finish()
        if done is None:  # pragma: no cover - GenerationService always ends with GenerationDone
            raise AssertionError("generation ended without a result")
        result = done.result
        reasoning = "".join(parser.reasoning_text)
        tok = generator.model.tokenizer
        usage = ChatUsage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.generated_tokens,
            cached_prompt_tokens=result.cached_prompt_tokens,
            reasoning_tokens=min(len(tok.encode(reasoning, add_special_tokens=False)), result.generated_tokens)
            if reasoning
            else 0,
        )
        reason = result.finish_reason
        if parser.calls and reason in (FinishReason.STOP, FinishReason.CANCELLED):
            reason = FinishReason.TOOL_CALLS
        yield TurnFinished(
            reason=reason,
            usage=usage,
            stop_sequence=result.stop_sequence if reason is FinishReason.STOP_SEQUENCE else None,
        )

    def _render(
        self, model: LoadedModel, request: ChatRequest
    ) -> tuple[list[int], tuple[ToolSpec, ...], bool, FamilyCodec]:
        codec = self.codec(model)
        tools = _offered_tools(request)
        try:
            rendered = codec.render(
                model.tokenizer, request.conversation, thinking=request.thinking, offer_tools=bool(tools)
            )
        except (ValueError, TypeError, KeyError, LookupError) as exc:
            raise InvalidRequest(message=f"the model's chat template cannot render this conversation: {exc}") from exc
        except Exception as exc:  # jinja2 TemplateError and friends come from the tokenizer adapter
            if type(exc).__module__.startswith("jinja2"):
                raise InvalidRequest(
                    message=f"the model's chat template cannot render this conversation: {exc}"
                ) from exc
            raise
        ids = model.tokenizer.encode(rendered.text, add_special_tokens=False)
        return ids, tools, rendered.starts_in_thinking, codec

    def _prepare(self, model: LoadedModel, request: ChatRequest) -> _Turn:
        ids, tools, thinking, codec = self._render(model, request)
        window = self.context_window(model)
        n = len(ids)
        if n >= window:
            raise PromptTooLong(
                message=f"prompt is too long: {n} tokens > {window - 1} maximum", limit=window, requested=n
            )
        room = window - n
        wanted = request.max_tokens if request.max_tokens is not None else room
        if self._settings.max_tokens_cap:
            wanted = min(wanted, self._settings.max_tokens_cap)
        if wanted > room:
            if request.strict_budget and request.max_tokens is not None:
                raise OutputTooLong(
                    message=f"input length and `max_tokens` exceed context limit: {n} + {wanted} > {window}",
                    limit=window,
                    requested=n + wanted,
                    prompt_tokens=n,
                    max_tokens=wanted,
                )
            wanted = room
        return _Turn(ids=ids, max_tokens=wanted, tools=tools, starts_in_thinking=thinking, codec=codec)


def _offered_tools(request: ChatRequest) -> tuple[ToolSpec, ...]:
    tools = request.conversation.tools
    choice = request.tool_choice
    if choice.mode is ToolChoiceMode.NONE:
        return ()
    if choice.name is not None:
        return tuple(t for t in tools if t.name == choice.name)
    return tools


