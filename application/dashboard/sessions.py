"""Use case: chat sessions — saved turns, replay into a conversation, a streamed turn, exports.

The user's message is committed before generation starts and the reply when it ends (each one
transaction), so a crash mid-answer loses only the unfinished reply.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import attrs

from mlx_dspark.application.chat_service import ChatItem, ChatService
from mlx_dspark.application.dashboard.modes import SELECTABLE, ModeSet
from mlx_dspark.application.dashboard.ports import SessionInfo, SessionStore, StoredMessage, TelemetryFeed
from mlx_dspark.application.generation import GenerationService
from mlx_dspark.domain.chat import (
    ChatRequest,
    Conversation,
    Message,
    ReasoningDelta,
    Role,
    TextDelta,
    ToolCallEnd,
    TurnFinished,
)
from mlx_dspark.domain.dashboard import SessionNotFound
from mlx_dspark.domain.errors import InvalidRequest, quoted
from mlx_dspark.domain.tokens import SamplingParams

T = TypeVar("T")
TITLE_CHARS = 60  # a title made from the first message
MAX_TITLE_CHARS = 200  # a title the user gives
MAX_TEMPERATURE = 2.0  # as OpenAI: beyond it sampling is noise


@attrs.frozen(kw_only=True)
class TurnOptions:
    """What the chat page sends with a message (validated here, errors name the field)."""

    system: str = ""
    mode: str = ""
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    thinking: bool | None = None

    @classmethod
    def from_json(cls, raw: object) -> TurnOptions:
        """The options of a chat message (absent fields: the defaults).

        Raises:
            InvalidRequest: not an object, or a field of the wrong type or out of range (`param` names it).
        """
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise InvalidRequest(message=f"options must be an object; got {quoted(raw)}", param="options")
        opts = cls(
            system=_field(raw, "system", _text, ""),
            mode=_field(raw, "mode", _mode, ""),
            max_tokens=_field(raw, "max_tokens", _whole, 256),
            temperature=_field(raw, "temperature", _real, 0.0),
            top_p=_field(raw, "top_p", _real, 1.0),
            top_k=_field(raw, "top_k", _whole, 0),
            seed=_field(raw, "seed", _whole, None),
            stop=_field(raw, "stop", _stop, ()),
            thinking=None if raw.get("thinking") in (None, "", "default") else bool(raw.get("thinking")),
        )
        if opts.max_tokens < 1:
            raise InvalidRequest(message="max_tokens must be >= 1", param="max_tokens")
        if opts.temperature > MAX_TEMPERATURE:
            raise InvalidRequest(message=f"temperature must be at most {MAX_TEMPERATURE:g}", param="temperature")
        opts.sampling()  # top_p and top_k ranges, before anything is saved
        return opts

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)

    def as_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["stop"] = list(self.stop)
        return out


class SessionService:
    """Sessions over a SessionStore, and chat turns on the engine's generators.

    Args:
        store: where sessions live.
        chat: the chat use case (family codecs, context window).
        modes: per-mode generators on the served model.
        feed: live telemetry, for per-message round statistics (None = usage only).
    """

    def __init__(self, store: SessionStore, chat: ChatService, modes: ModeSet, feed: TelemetryFeed | None) -> None:
        self.store = store
        self._chat = chat
        self._modes = modes
        self._feed = feed

    def create(self, title: str = "", settings: Mapping[str, Any] | None = None) -> SessionInfo:
        """A new session (an empty title: "New chat").

        Raises:
            InvalidRequest: a title over MAX_TITLE_CHARS.
        """
        return self.store.create(_given_title(title) or "New chat", settings)

    def rename(self, session_id: str, title: str) -> None:
        """Give a session the user's title.

        Raises:
            InvalidRequest: an empty title or one over MAX_TITLE_CHARS.
            SessionNotFound: no such session.
        """
        title = _given_title(title)
        if not title:
            raise InvalidRequest(message="the title is empty", param="title")
        if not self.store.rename(session_id, title):
            raise SessionNotFound(message=f"no session {quoted(session_id)}", param="session_id")

    def require(self, session_id: str) -> SessionInfo:
        """The session, or SessionNotFound."""
        info = self.store.get(session_id)
        if info is None:
            raise SessionNotFound(message=f"no session {quoted(session_id)}", param="session_id")
        return info

    def begin_turn(self, session_id: str, text: str, options: TurnOptions) -> ChatRequest:
        """Commit the user's message and the settings, and build the request from the whole history.

        Raises:
            SessionNotFound: no such session.
            InvalidRequest: an empty message or bad sampling settings.
        """
        if not text.strip():
            raise InvalidRequest(message="the message is empty", param="content")
        sampling = options.sampling()
        info = self.require(session_id)
        self.store.update_settings(session_id, options.as_json())
        if info.messages == 0 and info.title == "New chat":
            self.store.rename(session_id, _title(text))
        self.store.append(session_id, "user", text)
        history = tuple(_message(m) for m in self.store.messages(session_id))
        return ChatRequest(
            conversation=Conversation(system=options.system, messages=history),
            max_tokens=options.max_tokens,
            sampling=sampling,
            stop=options.stop,
            thinking=options.thinking,
            request_id=f"chat-{session_id[:8]}-{int(time.time() * 1000) % 10**8}",
        )

    def run_turn(self, served: GenerationService, request: ChatRequest, mode: str) -> Iterator[ChatItem]:
        """The engine-thread job of one turn in another mode than the served one (alone, on that mode's service)."""
        generator = self._modes.get(served, mode)
        yield from self._chat.stream(generator, request)

    def turn_job(self, row: GenerationService, request: ChatRequest, emit: Callable[[ChatItem], None]) -> Any:
        """One turn in the served mode as a decode job over its row's service (beside other requests)."""
        return self._chat.job(row, request, emit)

    def sessions(self) -> list[SessionInfo]:
        return list(self.store.sessions())

    def messages(self, session_id: str) -> list[StoredMessage]:
        """The session's saved turns, oldest first.

        Raises:
            SessionNotFound: no such session.
        """
        self.require(session_id)
        return list(self.store.messages(session_id))

    def rewind(self, session_id: str, message_id: int) -> str:
        """Drop a user message and everything after it, and return its text: the page resends it (regenerate) or
        puts it back in the composer to edit (edit and resend). The history the next turn sees ends before it.

        Raises:
            SessionNotFound: no such session.
            InvalidRequest: `message_id` is not one of this session's user messages.
        """
        self.require(session_id)
        target = next((m for m in self.store.messages(session_id) if m.id == message_id), None)
        if target is None or target.role != "user":
            raise InvalidRequest(message="rewind takes one of this session's user messages", param="message_id")
        self.store.truncate(session_id, message_id)
        return target.content

    def delete(self, session_id: str) -> None:
        """Raises SessionNotFound when there is no such session."""
        if not self.store.delete(session_id):
            raise SessionNotFound(message=f"no session {quoted(session_id)}", param="session_id")

    def reply(self, session_id: str, request: ChatRequest, mode: str, started: float) -> TurnReply:
        """The bookkeeping of one streamed reply: what the page is sent of each chat item, and what is saved
        when the stream ends (`TurnReply.finish`)."""
        return TurnReply(self, session_id, request.request_id, mode, started)

    def mode_of(self, served: GenerationService, mode: str) -> str:
        return mode if mode and mode not in ("auto", "served") else served.mode

    def stats(self, request_id: str, usage: Mapping[str, Any], mode: str, elapsed_s: float) -> dict[str, Any]:
        """Per-message statistics: tokens, tok/s, accepted per round, cached prompt tokens."""
        out = {"mode": mode, **usage, "elapsed_s": round(elapsed_s, 3)}
        summary = self._feed.summary(request_id) if self._feed is not None else None
        if summary is not None:
            out.update(
                tok_s=round(summary["tok_s"], 2),
                mean_accepted=round(summary["mean_accepted"], 3),
                rounds=summary["rounds"],
                drafted=summary["drafted"],
                accepted=summary["accepted"],
                prefill_s=round(summary["prefill_s"], 4),
            )
        return out

    def finish_turn(self, session_id: str, text: str, thinking: str, stats: Mapping[str, Any]) -> StoredMessage | None:
        """Save the reply (None when the session was deleted while the reply streamed)."""
        try:
            return self.store.append(session_id, "assistant", text, thinking=thinking, stats=stats)
        except KeyError:
            return None

    def export_json(self, session_id: str) -> dict[str, Any]:
        info = self.require(session_id)
        return {
            "session": {**attrs.asdict(info), "settings": dict(info.settings)},
            "messages": [{**attrs.asdict(m), "stats": dict(m.stats)} for m in self.store.messages(session_id)],
        }

    def export_markdown(self, session_id: str) -> str:
        info = self.require(session_id)
        lines = [f"# {info.title}", ""]
        system = str(info.settings.get("system") or "")
        if system:
            lines += ["**System:** " + system, ""]
        for m in self.store.messages(session_id):
            lines += [f"## {m.role.capitalize()}", ""]
            if m.thinking:
                lines += ["<details><summary>Thinking</summary>", "", m.thinking, "", "</details>", ""]
            lines += [m.content, ""]
            if m.stats:
                shown = {k: m.stats[k] for k in ("mode", "completion_tokens", "tok_s", "mean_accepted") if k in m.stats}
                lines += ["_" + json.dumps(shown) + "_", ""]
        return "\n".join(lines)


def _given_title(title: str) -> str:
    title = title.strip()
    if len(title) > MAX_TITLE_CHARS:
        raise InvalidRequest(
            message=f"the title is {len(title):,} characters long; at most {MAX_TITLE_CHARS} are kept", param="title"
        )
    return title


def _field(raw: Mapping[str, Any], key: str, convert: Callable[[Any], T], default: T) -> T:
    """`raw[key]` through `convert` (absent, null or "": `default`); a value it refuses names the field."""
    value = raw.get(key)
    if value is None or value == "":
        return default
    try:
        return convert(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequest(message=f"{key}: {exc}; got {quoted(value)}", param=key) from exc


def _whole(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError("expected a whole number")
    if isinstance(value, float) and not value.is_integer():  # also inf and nan
        raise ValueError("expected a whole number")
    return int(value)


def _real(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError("expected a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError("expected a finite number")
    return number


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("expected a string")
    return value


def _mode(value: Any) -> str:
    if value not in ("auto", "served", *SELECTABLE):
        raise ValueError(f"expected one of auto, {', '.join(SELECTABLE)}")
    return str(value)


def _stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(s for s in value.split("\n") if s)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise TypeError("expected a string or a list of strings")
    return tuple(value)


def _title(text: str) -> str:
    first = " ".join(text.split())
    return first if len(first) <= TITLE_CHARS else first[: TITLE_CHARS - 1] + "…"


def _message(m: StoredMessage) -> Message:
    role = Role.ASSISTANT if m.role == "assistant" else Role.USER
    return Message(role=role, text=m.content)


class TurnReply:
    """One reply as it streams: the page's events of each chat item, and the saved message at its end."""

    def __init__(self, service: SessionService, session_id: str, request_id: str, mode: str, started: float) -> None:
        self._service = service
        self._session = session_id
        self._request_id = request_id
        self._mode = mode
        self._started = started
        self._text: list[str] = []
        self._thinking: list[str] = []
        self._usage: dict[str, Any] = {}
        self._stats: dict[str, Any] | None = None

    def page_events(self, item: Any) -> list[dict[str, Any]]:
        """What the chat page is sent of one chat item (and what the saved reply keeps of it)."""
        if isinstance(item, TextDelta):
            self._text.append(item.text)
            return [{"type": "text", "text": item.text}]
        if isinstance(item, ReasoningDelta):
            self._thinking.append(item.text)
            return [{"type": "thinking", "text": item.text}]
        if isinstance(item, ToolCallEnd):
            text = f"\n[tool call {item.name}({item.arguments})]"
            self._text.append(text)
            return [{"type": "text", "text": text}]
        if isinstance(item, TurnFinished):
            u = item.usage
            self._usage = {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "cached_prompt_tokens": u.cached_prompt_tokens,
                "reasoning_tokens": u.reasoning_tokens,
            }
            stats = self._service.stats(self._request_id, self._usage, self._mode, time.perf_counter() - self._started)
            stats["finish_reason"] = item.reason.value
            self._stats = stats
            return [{"type": "done", "stats": stats}]
        return []

    def finish(self, outcome: str) -> StoredMessage | None:
        """Save the reply as far as it went (`outcome`: completed, cancelled, failed); an empty reply that did not
        complete is not saved."""
        stats = self._stats or {"mode": self._mode, "finish_reason": outcome, **self._usage}
        if outcome != "completed":
            stats = {**stats, "outcome": outcome}
        text, thinking = "".join(self._text), "".join(self._thinking)
        if text or thinking or outcome == "completed":
            return self._service.finish_turn(self._session, text, thinking, stats)
        return None
