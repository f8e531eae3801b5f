"""Use case: one chat turn — neutral conversation → prompt (family codec) → GenerationService → neutral events.

Also counts prompt tokens with the real template and tokenizer, and enforces the context window before
any token is generated, so each dialect can answer with its clients' exact overflow wording.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs

from mlx_dspark.application.generation import (
    GenerationEvent,
    GenerationJob,
    GenerationRequest,
    GenerationResult,
    GenerationService,
    TextChunk,
)
from mlx_dspark.application.ports import LoadedModel, Tokenizer
from mlx_dspark.application.settings import ServerSettings
from mlx_dspark.domain.cache import common_prefix
from mlx_dspark.domain.chat import (
    ChatEvent,
    ChatRequest,
    ChatUsage,
    Conversation,
    Message,
    OutputTooLong,
    PromptTooLong,
    Role,
    ToolCall,
    ToolChoiceMode,
    ToolSpec,
    TurnFinished,
)
from mlx_dspark.domain.chat.admission import prompt_token_floor
from mlx_dspark.domain.decoder import Work
from mlx_dspark.domain.errors import InvalidRequest, quoted
from mlx_dspark.domain.ports import RollbackKind
from mlx_dspark.domain.tokens import FinishReason

BOUNDARY_TURNS = 2  # user/tool turn ends measured per request (older ones were snapshotted by earlier turns)
_PROBE = "Ok."  # the stand-in for whatever message follows in a later turn


class RenderedPrompt(Protocol):
    @property
    def text(self) -> str: ...

    @property
    def starts_in_thinking(self) -> bool: ...


class OutputParser(Protocol):
    """Incremental model-output parser of one turn (see adapters.families.base.StreamParser)."""

    calls: int
    cut: bool  # a tool call went out that the model did not finish
    reasoning_text: list[str]

    def feed(self, chunk: str) -> list[ChatEvent]: ...

    def finish(self) -> list[ChatEvent]: ...


class FamilyCodec(Protocol):
    """Renders a conversation for one model family and parses its output."""

    tool_end: str  # the marker that ends one call

    def render(
        self, template: Tokenizer, conversation: Conversation, *, thinking: bool | None, offer_tools: bool = True
    ) -> RenderedPrompt: ...

    def forced_call(self, name: str | None, *, in_thinking: bool) -> tuple[str, str]: ...

    def parser(
        self,
        tools: Sequence[ToolSpec],
        *,
        starts_in_thinking: bool = False,
        id_factory: Callable[[], str] | None = None,
        forced: str | None = None,
    ) -> OutputParser: ...


# (model family, chat template) → codec; wired by bootstrap so use cases never import adapters.
FamilySelector = Callable[[str, str | None], FamilyCodec]


@attrs.frozen(kw_only=True)
class Prepared:
    """The turn fits: sent before the first event so the caller can answer errors with a status code."""

    prompt_tokens: int
    max_tokens: int


@attrs.frozen(kw_only=True)
class Report:
    """Sent just before TurnFinished: how the turn ran (mode, rounds, acceptance, timings) for the request log."""

    result: GenerationResult


ChatItem = Prepared | Report | ChatEvent


@attrs.frozen(kw_only=True)
class _Rendered:
    ids: list[int]
    tools: tuple[ToolSpec, ...]  # the tools the model may call (its output is parsed against these)
    starts_in_thinking: bool
    forced: str | None  # the primed start of a call the model must make
    codec: FamilyCodec


@attrs.frozen(kw_only=True)
class Turn:
    """A checked, rendered turn for one model (`identity`): its prompt ids, output budget and parse plan. A
    server prepares it in a worker thread before the engine sees the request."""

    identity: str
    rendered: _Rendered
    max_tokens: int

    @property
    def prepared(self) -> Prepared:
        return Prepared(prompt_tokens=len(self.rendered.ids), max_tokens=self.max_tokens)


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

    def prompt_ids(self, model: LoadedModel, request: ChatRequest) -> list[int]:
        """The turn's prompt token ids, rendered through the family codec and the chat template."""
        return self._render(model, request).ids

    def messages_prompt(
        self,
        model: LoadedModel,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt of plain {"role", "content"} messages (the CLI's and the Python API's), rendered through the
        same family codec as a server request, so every face sends the model the same tokens."""
        request = ChatRequest(
            conversation=conversation_of(messages, tools),
            thinking=(template_kwargs or {}).get("enable_thinking"),
        )
        return self._render(model, request).ids

    def count_tokens(self, generator: GenerationService, request: ChatRequest) -> int:
        """Prompt tokens of the request through the real chat template and tokenizer."""
        return len(self._render(generator.model, request).ids)

    def prepare(self, model: LoadedModel, request: ChatRequest) -> Prepared:
        """Check that the turn fits without running it.

        Raises:
            PromptTooLong, OutputTooLong, InvalidRequest: as `stream` would.
        """
        return self.prepare_turn(model, request).prepared

    def prepare_turn(self, model: LoadedModel, request: ChatRequest) -> Turn:
        """Render and check the turn for `model` (any thread: the tokenizer serialises its calls), so the engine
        thread only decodes it (`job(..., turn=)`).

        Raises:
            PromptTooLong, OutputTooLong, InvalidRequest: as `stream` would.
        """
        return self._prepare(model, request)

    def stream(self, generator: GenerationService, request: ChatRequest) -> Iterator[ChatItem]:
        """Yield Prepared, then text / reasoning / tool-call events, then a Report and one TurnFinished (the turn
        alone on the step engine, a batch of one over the service's target).

        Raises:
            PromptTooLong: the prompt alone does not fit the context window.
            OutputTooLong: a strict-budget request's max_tokens does not fit next to the prompt.
            InvalidRequest: the chat template cannot render the conversation.
        """
        from mlx_dspark.application.engine.rows import SerialRows
        from mlx_dspark.application.engine.step import Engine

        items: list[ChatItem] = []
        engine = Engine(SerialRows(generator.model.target), generator, fork=False, report_steps=False)
        yield from engine.run_alone(lambda _row: self.job(generator, request, items.append), items)

    def job(
        self,
        generator: GenerationService,
        request: ChatRequest,
        emit: Callable[[ChatItem], None],
        turn: Turn | None = None,
    ) -> ChatJob:
        """The turn as the step engine drives it over `generator` (the service of its row): `turn` as prepared
        earlier for the same model, else rendered and checked now (the errors of `stream`); then it emits
        Prepared and the rest as `stream` yields them."""
        return ChatJob(self, generator, request, emit, turn)

    def stable_boundaries(
        self, generator: GenerationService, request: ChatRequest, ids: Sequence[int]
    ) -> tuple[int, ...]:
        """Prompt lengths a later turn's prompt will still start with: snapshot points for targets that
        cannot cut their cache back (recurrent, wrapped sliding window); () for the others.

        Measured on the family's own template: the history up to the end of the system prompt and of
        the latest user (or tool) turns is rendered as a later turn would render it — followed by the
        next message instead of the generation prompt, with thinking stripped wherever the template
        strips it — and each point is where those tokens stop agreeing with this prompt.
        """
        cache = generator.prefix_cache
        if cache is None or not cache.enabled or generator.model.target.rollback_kind is not RollbackKind.SNAPSHOT:
            return ()
        model = generator.model
        conv = request.conversation
        messages = conv.messages
        inputs = (Role.USER, Role.TOOL)
        ends = [
            j
            for j in range(1, len(messages) + 1)
            if messages[j - 1].role in inputs and (j == len(messages) or messages[j].role not in inputs)
        ]
        cuts = ([0] if conv.system or conv.tools else []) + ends[-BOUNDARY_TURNS:]
        codec = self.codec(model)
        tools, _, _, _ = _tool_plan(request)
        points: list[int] = []
        user, assistant = Message(role=Role.USER, text=_PROBE), Message(role=Role.ASSISTANT, text=_PROBE)
        for j in cuts:
            # What may follow: the next user turn, or the model's reply — with or without a user turn after
            # it (templates that strip old thinking do so once a later user turn exists).
            followers = [(user,)] if j == 0 else [(assistant,), (assistant, user)]
            agreed: list[int] = []
            for follow in followers:
                probe = attrs.evolve(conv, messages=(*messages[:j], *follow))
                try:
                    text = codec.render(model.tokenizer, probe, thinking=request.thinking, offer_tools=bool(tools)).text
                except Exception:  # a template that refuses the probe gives no point here
                    agreed = []
                    break
                agreed.append(common_prefix(ids, model.tokenizer.encode(text, add_special_tokens=False)))
            if agreed:
                points.append(min(agreed))
        return tuple(sorted(set(p for p in points if p > 0)))

    def _render(self, model: LoadedModel, request: ChatRequest) -> _Rendered:
        codec = self.codec(model)
        offered, callable_tools, must_call, forced_name = _tool_plan(request)
        try:
            rendered = codec.render(
                model.tokenizer, request.conversation, thinking=request.thinking, offer_tools=bool(offered)
            )
        except (ValueError, TypeError, KeyError, LookupError) as exc:
            raise InvalidRequest(message=f"the model's chat template cannot render this conversation: {exc}") from exc
        except Exception as exc:  # jinja2 TemplateError and friends come from the tokenizer adapter
            if type(exc).__module__.startswith("jinja2"):
                raise InvalidRequest(
                    message=f"the model's chat template cannot render this conversation: {exc}"
                ) from exc
            raise
        text, in_thinking, forced = rendered.text, rendered.starts_in_thinking, None
        if must_call:
            # tool_choice forces a call: prime the family's call opener (and the tool's name) after the prompt
            suffix, forced = codec.forced_call(forced_name, in_thinking=in_thinking)
            text, in_thinking = text + suffix, False
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        return _Rendered(
            ids=ids, tools=callable_tools, starts_in_thinking=in_thinking, forced=forced, codec=codec
        )

    def admit(self, model: LoadedModel, request: ChatRequest) -> None:
        """Refuse, before anything is rendered or tokenized, a conversation whose size alone proves that it
        cannot fit the context window (`domain/chat/admission.py`); milliseconds even for a huge body.

        Raises:
            PromptTooLong: the prompt's proven floor reaches the window.
        """
        window = self.context_window(model)
        floor = prompt_token_floor(request.conversation, int(getattr(model.tokenizer, "max_token_bytes", 0)))
        if floor >= window:
            raise PromptTooLong(
                message=f"prompt is too long: {floor} tokens > {window - 1} maximum", limit=window, requested=floor
            )

    def _prepare(self, model: LoadedModel, request: ChatRequest) -> Turn:
        self.admit(model, request)
        rendered = self._render(model, request)
        ids = rendered.ids
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
        return Turn(identity=model.identity, rendered=rendered, max_tokens=wanted)


class ChatJob:
    """One chat turn as a StepJob: the family codec's parser over the generation job's text."""

    def __init__(
        self,
        chat: ChatService,
        generator: GenerationService,
        request: ChatRequest,
        emit: Callable[[ChatItem], None],
        turn: Turn | None = None,
    ) -> None:
        if turn is None or turn.identity != generator.model.identity:  # none, or for a model switched out since
            turn = chat._prepare(generator.model, request)
        r = turn.rendered
        self._emit = emit
        self._request = request
        self._tokenizer = generator.model.tokenizer
        emit(turn.prepared)
        self._parser = r.codec.parser(r.tools, starts_in_thinking=r.starts_in_thinking, forced=r.forced)
        # one call only: the call's end marker stops generation (an internal stop, never reported as one)
        single = bool(r.tools) and not request.tool_choice.parallel and r.codec.tool_end not in request.stop
        self._internal_stop = (r.codec.tool_end,) if single and r.codec.tool_end else ()
        greq = GenerationRequest(
            prompt=r.ids,
            max_tokens=turn.max_tokens,
            sampling=request.sampling,
            stop=request.stop + self._internal_stop,
            request_id=request.request_id or GenerationRequest(prompt="").request_id,
            boundaries=chat.stable_boundaries(generator, request, r.ids),
        )
        self._generation = GenerationJob(generator, greq, self._on_generation, prompt_ids=r.ids)

    def work(self) -> Work | None:
        return self._generation.work()

    def advance(self, result: Any) -> int | None:
        return self._generation.advance(result)

    def cancel(self) -> None:
        self._generation.cancel()

    def _count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def _on_generation(self, event: GenerationEvent) -> None:
        if isinstance(event, TextChunk):
            for item in self._parser.feed(event.text):
                self._emit(item)
            return
        for item in self._parser.finish():
            self._emit(item)
        result = event.result
        parser = self._parser
        reasoning = "".join(parser.reasoning_text)
        usage = ChatUsage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.generated_tokens,
            cached_prompt_tokens=result.cached_prompt_tokens,
            reasoning_tokens=min(self._count(reasoning), result.generated_tokens) if reasoning else 0,
        )
        reason = result.finish_reason
        if reason is FinishReason.STOP_SEQUENCE and result.stop_sequence in self._internal_stop:
            reason = FinishReason.STOP  # our own one-call stop, not the client's
        if parser.cut and reason is not FinishReason.CONTEXT:
            reason = FinishReason.LENGTH  # a call went out that the model did not finish: no client runs it
        elif parser.calls and reason in (FinishReason.STOP, FinishReason.CANCELLED):
            reason = FinishReason.TOOL_CALLS
        self._emit(Report(result=result))
        stop_sequence = result.stop_sequence if reason is FinishReason.STOP_SEQUENCE else None
        self._emit(TurnFinished(reason=reason, usage=usage, stop_sequence=stop_sequence))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # a list of parts: the text ones count
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return "" if content is None else str(content)


def conversation_of(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> Conversation:
    """Plain chat messages (OpenAI-shaped dicts: role, content, tool_calls, tool_call_id) and tool specs (OpenAI's
    {"type": "function", "function": {...}} or a bare {"name", "description", "parameters"}) as a Conversation.

    Raises:
        InvalidRequest: a message without a known role.
    """
    system: list[str] = []
    turns: list[Message] = []
    for i, m in enumerate(messages):
        role = str(m.get("role", ""))
        if role in ("system", "developer"):
            system.append(_text(m.get("content")))
            continue
        if role not in ("user", "assistant", "tool"):
            raise InvalidRequest(message=f"message {i} has no known role (user, assistant, system, tool)", param="role")
        calls = []
        for c in m.get("tool_calls") or ():
            fn = c.get("function", c)
            args = fn.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args or "{}")
            calls.append(ToolCall(id=str(c.get("id", f"call_{i}")), name=str(fn.get("name", "")), arguments=args))
        turns.append(
            Message(
                role=Role(role),
                text=_text(m.get("content")),
                thinking=str(m.get("reasoning_content") or m.get("thinking") or ""),
                tool_calls=tuple(calls),
                tool_call_id=m.get("tool_call_id"),
                tool_name=m.get("name"),
            )
        )
    specs = []
    for t in tools or ():
        fn = t.get("function", t)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        name, description = str(fn.get("name", "")), str(fn.get("description", ""))
        specs.append(ToolSpec(name=name, description=description, parameters=params))
    return Conversation(system="\n\n".join(system), messages=tuple(turns), tools=tuple(specs))


def _tool_plan(request: ChatRequest) -> tuple[tuple[ToolSpec, ...], tuple[ToolSpec, ...], bool, str | None]:
    """(tools in the prompt, tools the model may call, whether it must call one, the one it must call).

    Raises:
        InvalidRequest: a forced or allowed tool that is not offered, or a forced call with no tools.
    """
    tools = request.conversation.tools
    choice = request.tool_choice
    if choice.mode is ToolChoiceMode.NONE:
        return (), (), False, None  # no tools in the prompt, and call markers in the output stay text
    names = {t.name for t in tools}
    wanted = [choice.name] if choice.name is not None else list(choice.allowed or ())
    unknown = [n for n in wanted if n not in names]
    if unknown:
        offered = ", ".join(sorted(names)) or "none"
        raise InvalidRequest(
            message=f"tool_choice names tool {quoted(unknown[0])}, which is not among the offered tools ({offered})",
            param="tool_choice",
        )
    callable_tools = tools
    if choice.name is not None:
        callable_tools = tuple(t for t in tools if t.name == choice.name)
    elif choice.allowed is not None:
        callable_tools = tuple(t for t in tools if t.name in choice.allowed)
    must_call = choice.mode is ToolChoiceMode.REQUIRED or choice.name is not None
    if must_call and not callable_tools:
        raise InvalidRequest(message="tool_choice requires a tool call, but no tools are offered", param="tool_choice")
    forced_name = choice.name or (callable_tools[0].name if must_call and len(callable_tools) == 1 else None)
    return tools, callable_tools, must_call, forced_name
