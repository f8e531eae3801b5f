"""The soak tier's clients: a drawn plan of requests in the three dialects, sent over loopback, and each outcome
as its client saw it (status, text, finish reason, the error it got, what it read before it went away).

A plan is drawn from one seeded `random.Random`, so a run is reproducible; the order in which eight clients
finish is not, and nothing here depends on it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx

from tests.soak.loader import NAME

DIALECTS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
HEADERS = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
CLIENT_TIMEOUT_S = 120.0  # a request with no answer by then is a hang (a loaded 2-core CPU answers in seconds)

# What a client may send and expect: a whole answer, a 400 for a prompt that cannot fit, a 413 for a body over
# the limit; it may also go away mid-stream (disconnect) or stop waiting (timeout).
COMPLETE, TOO_LONG, DISCONNECT, TIMEOUT, HUGE, OVERSIZED, LONG = (
    "complete",
    "too_long",
    "disconnect",
    "timeout",
    "huge",
    "oversized",
    "long",
)
HUGE_CHARS = 7_000_000  # under the default body limit (8 MiB), far over what the window can hold
OVERSIZED_CHARS = 10_000_000  # over the body limit: refused at its Content-Length
LONG_CHARS = 370  # with the template's markers about 400 of the 512 tokens: prefilled in several chunks

_MOTIFS = ("ab", "xyz ", "hello ", "0123", "the cat ", "qq", "lorem ipsum ", "=-", "to be or ", "mlx", "{[(", "k")
_STOPS = ("a", "e", " ", "z", "$", "T", "0", "ab", "\n")


@attrs.frozen
class Call:
    """One request as planned: the wire request (dialect, stream, prompt, budget, seed, stops, model) and what
    the client does with it (`kind`; a disconnect reads `cut_after` text deltas, a timeout waits `timeout_s`)."""

    dialect: str
    stream: bool
    prompt: str
    budget: int
    seed: int | None = None
    stop: tuple[str, ...] = ()
    kind: str = COMPLETE
    cut_after: int = 0
    timeout_s: float = 0.0
    model: str = NAME

    @property
    def wire(self) -> tuple[object, ...]:
        """What the server sees: calls with equal `wire` must get equal answers."""
        return (self.dialect, self.stream, self.prompt, self.budget, self.seed, self.stop, self.model)

    def body(self) -> dict[str, Any]:
        messages = [{"role": "user", "content": self.prompt}]
        if self.dialect == "chat":
            out: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.budget}
            if self.stream:
                out["stream"] = True
                out["stream_options"] = {"include_usage": True}
            if self.seed is not None:
                out.update(temperature=0.8, top_p=0.95, seed=self.seed)
            if self.stop:
                out["stop"] = list(self.stop)
            return out
        if self.dialect == "responses":  # no stop strings and no seed in the Responses API
            return {"model": self.model, "input": self.prompt, "max_output_tokens": self.budget, "stream": self.stream}
        out = {"model": self.model, "messages": messages, "max_tokens": self.budget, "stream": self.stream}
        if self.stop:
            out["stop_sequences"] = list(self.stop)
        return out

    def describe(self) -> str:
        prompt = self.prompt if len(self.prompt) < 40 else f"{self.prompt[:20]}…({len(self.prompt)} chars)"
        stop = f" stop={list(self.stop)}" if self.stop else ""
        return f"{self.kind} {self.dialect} stream={self.stream} budget={self.budget} seed={self.seed}{stop} {prompt!r}"


@attrs.define
class Outcome:
    """What one client got.

    Attributes:
        status: the HTTP status (None: no answer at all).
        text: the whole answer's text (None unless it completed); reasoning, if any, leads, marked.
        finish: the dialect's own finish value (finish_reason, status, stop_reason).
        tokens: completion tokens as the dialect reported them.
        error: the error's message, from an error body or an SSE error event.
        error_code: the error's code or type where the dialect gives one.
        sse_error: the error came as an SSE event after a 200.
        partial: the text read before the client went away or the stream failed.
        left: the client went away on purpose (disconnect, timeout) before the end.
        hung: no answer within the client's timeout.
        ended: monotonic time the client finished.
    """

    call: Call
    status: int | None = None
    text: str | None = None
    finish: str | None = None
    tokens: int | None = None
    error: str | None = None
    error_code: str | None = None
    sse_error: bool = False
    partial: str = ""
    left: bool = False
    hung: bool = False
    ended: float = 0.0

    @property
    def completed(self) -> bool:
        return self.text is not None

    @property
    def answer(self) -> tuple[str | None, str | None, int | None]:
        return self.text, self.finish, self.tokens

    @property
    def server_error(self) -> bool:
        """A 5xx, or an error event inside a stream."""
        return self.sse_error or (self.status is not None and self.status >= 500)

    @property
    def restarted(self) -> bool:
        """The dialect's retryable error for an engine restart (OpenAI 503, Anthropic 529, or an SSE error)."""
        retryable = self.sse_error or self.status == (529 if self.call.dialect == "messages" else 503)
        return (
            retryable
            and self.error is not None
            and "restarted" in self.error
            and "send the request again" in self.error
        )

    def context_error(self) -> bool:
        """The dialect's 400 for a prompt that cannot fit."""
        if self.status != 400 or self.error is None:
            return False
        if self.call.dialect == "messages":
            return self.error.startswith(("prompt is too long", "input length and `max_tokens` exceed"))
        return self.error_code == "context_length_exceeded"


# ---- the plan ------------------------------------------------------------------------------------------------


def prompt_pool(rng: random.Random, n: int = 40) -> list[str]:
    """Repetitive prompts (lookup drafts find their n-grams), 3-120 characters."""
    out = []
    for _ in range(n):
        motif = rng.choice(_MOTIFS) + rng.choice(_MOTIFS)[: rng.randrange(1, 3)]
        length = rng.choice((rng.randrange(3, 12), rng.randrange(12, 60), rng.randrange(60, 121)))
        out.append((motif * (length // len(motif) + 1))[:length])
    return out


def budget(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.15:
        return 1
    if roll < 0.25:
        return 2
    if roll < 0.65:
        return rng.randrange(3, 9)
    return rng.randrange(30, 61)


def plan(seed: int, n: int, *, seeded: bool = True) -> list[Call]:
    """`n` calls of mixed traffic, then the special ones spread through it: a huge prompt, an oversized body and
    three long prompts that fit.

    Args:
        seed: the plan's only source of randomness.
        n: calls of ordinary traffic (the special ones come on top).
        seeded: whether Chat calls may ask for seeded sampling (auto mode's sources move a seeded row's tokens).
    """
    rng = random.Random(seed)
    pool = prompt_pool(rng)
    calls = []
    for _ in range(n):
        dialect = rng.choice(DIALECTS)
        stream = rng.random() < 0.5
        seed_value = rng.randrange(1000) if seeded and dialect == "chat" and rng.random() < 0.4 else None
        stop = tuple(rng.sample(_STOPS, rng.randrange(1, 3))) if dialect != "responses" and rng.random() < 0.3 else ()
        call = Call(dialect, stream, rng.choice(pool), budget(rng), seed_value, stop)
        roll = rng.random()
        if roll < 0.06:
            length = rng.randrange(560, 700)  # far past the 512-token window: refused after tokenizing
            call = attrs.evolve(call, kind=TOO_LONG, prompt=(call.prompt * 700)[:length])
        elif roll < 0.16:
            call = attrs.evolve(
                call, kind=DISCONNECT, stream=True, budget=rng.randrange(20, 61), cut_after=rng.randrange(1, 4)
            )
        elif roll < 0.21:
            call = attrs.evolve(
                call, kind=TIMEOUT, stream=False, budget=rng.randrange(30, 61), timeout_s=rng.uniform(0.05, 0.4)
            )
        calls.append(call)
    specials = [
        Call(rng.choice(DIALECTS), rng.random() < 0.5, "h" * HUGE_CHARS, 4, kind=HUGE),
        Call(rng.choice(DIALECTS), False, "o" * OVERSIZED_CHARS, 4, kind=OVERSIZED),
    ]
    for i in range(3):
        dialect = DIALECTS[i]
        text = (f"{i}: " + pool[i] * LONG_CHARS)[:LONG_CHARS]  # each its own, so none is served by the prefix cache
        specials.append(Call(dialect, i != 1, text, rng.randrange(30, 61), kind=LONG))
    for k, special in enumerate(specials):
        calls.insert(len(calls) * (k + 1) // (len(specials) + 1), special)
    return calls


# ---- sending -------------------------------------------------------------------------------------------------


def _encoded(call: Call) -> bytes:
    return json.dumps(call.body()).encode()


async def send(client: httpx.AsyncClient, base: str, call: Call, out: Outcome | None = None) -> Outcome:
    """Send `call` and record what came back into `out` (a new Outcome by default; a stream's `partial` grows as
    it is read); never raises for what a server may answer."""
    out = out or Outcome(call)
    deadline = call.timeout_s if call.kind == TIMEOUT else CLIENT_TIMEOUT_S
    try:
        await asyncio.wait_for(_exchange(client, base, call, out), deadline)
    except TimeoutError:
        if call.kind == TIMEOUT:
            out.left = True
        else:
            out.hung = True
    out.ended = time.monotonic()
    return out


async def _exchange(client: httpx.AsyncClient, base: str, call: Call, out: Outcome) -> None:
    url = base + PATHS[call.dialect]
    content = _encoded(call)
    if not call.stream:
        r = await client.post(url, content=content, headers=HEADERS, timeout=CLIENT_TIMEOUT_S)
        out.status = r.status_code
        _read_body(call.dialect, r, out)
        return
    async with client.stream("POST", url, content=content, headers=HEADERS, timeout=CLIENT_TIMEOUT_S) as r:
        out.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            _read_body(call.dialect, r, out)
            return
        await _read_stream(call, r, out)


def _error_of(body: Any) -> tuple[str | None, str | None]:
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return (str(body)[:300], None)
    return error.get("message"), error.get("code") or error.get("type")


def _read_body(dialect: str, r: httpx.Response, out: Outcome) -> None:
    try:
        body = r.json()
    except ValueError:
        out.error = r.text[:300]
        return
    if r.status_code != 200:
        out.error, out.error_code = _error_of(body)
        return
    if dialect == "chat":
        choice = body["choices"][0]
        message = choice["message"]
        out.text = _joined(message.get("reasoning_content") or "", message.get("content") or "")
        out.finish, out.tokens = choice["finish_reason"], body["usage"]["completion_tokens"]
    elif dialect == "responses":
        out.text, out.finish, out.tokens = _response_text(body), body["status"], body["usage"]["output_tokens"]
    else:
        thinking = "".join(b.get("thinking", "") for b in body["content"] if b["type"] == "thinking")
        text = "".join(b.get("text", "") for b in body["content"] if b["type"] == "text")
        out.text, out.finish, out.tokens = _joined(thinking, text), body["stop_reason"], body["usage"]["output_tokens"]


def _joined(reasoning: str, text: str) -> str:
    return f"<reasoning>{reasoning}</reasoning>{text}" if reasoning else text


def _response_text(response: dict[str, Any]) -> str:
    reasoning, text = [], []
    for item in response.get("output", []):
        if item["type"] == "message":
            text += [p.get("text", "") for p in item.get("content", []) if p["type"] == "output_text"]
        elif item["type"] == "reasoning":
            reasoning += [p.get("text", "") for p in item.get("summary", [])]
    return _joined("".join(reasoning), "".join(text))


async def _events(r: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """(event name, data) of each SSE event; comments (keep-alives) skipped."""
    name: str | None = None
    data: list[str] = []
    async for line in r.aiter_lines():
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


async def _read_stream(call: Call, r: httpx.Response, out: Outcome) -> None:
    """Read a stream to its end (or, for a disconnect, until `cut_after` text deltas: then close it)."""
    parts: list[str] = []
    reasoning: list[str] = []
    deltas = 0
    done = False
    async for name, data in _events(r):
        if data == "[DONE]":
            break
        event = json.loads(data)
        delta = _stream_event(call.dialect, name, event, out, reasoning)
        if out.sse_error:
            break
        if delta is not None:
            parts.append(delta)
            deltas += 1
            out.partial = _joined("".join(reasoning), "".join(parts))
        if out.finish is not None and (call.dialect != "chat" or out.tokens is not None):
            done = True
        if call.kind == DISCONNECT and deltas >= call.cut_after and not done:
            out.left = True
            break  # leaving the `async with` closes the connection mid-stream
    out.partial = _joined("".join(reasoning), "".join(parts))
    if not out.sse_error and not out.left:
        out.text = out.partial


def _stream_event(
    dialect: str, name: str | None, event: dict[str, Any], out: Outcome, reasoning: list[str]
) -> str | None:
    """Fold one event into `out`; the visible text it adds, if any."""
    if dialect == "chat":
        if "error" in event:
            out.sse_error = True
            out.error, out.error_code = _error_of(event)
            return None
        if event.get("usage"):
            out.tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            if choice.get("finish_reason"):
                out.finish = choice["finish_reason"]
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
            if delta.get("content"):
                return str(delta["content"])
        return None
    if dialect == "responses":
        if name == "response.failed":
            out.sse_error = True
            error = event["response"].get("error") or {}
            out.error, out.error_code = error.get("message"), error.get("code")
        elif name in ("response.completed", "response.incomplete"):
            out.finish, out.tokens = event["response"]["status"], event["response"]["usage"]["output_tokens"]
        elif name == "response.reasoning_summary_text.delta":
            reasoning.append(event["delta"])
        elif name == "response.output_text.delta":
            return str(event["delta"])
        return None
    if name == "error":
        out.sse_error = True
        out.error, out.error_code = _error_of(event)
    elif name == "message_delta":
        out.finish, out.tokens = event["delta"]["stop_reason"], event["usage"]["output_tokens"]
    elif name == "content_block_delta":
        delta = event["delta"]
        if delta["type"] == "thinking_delta":
            reasoning.append(delta["thinking"])
        elif delta["type"] == "text_delta":
            return str(delta["text"])
    return None


async def run_traffic(base: str, calls: list[Call], *, clients: int = 8) -> list[Outcome]:
    """Send every call from `clients` concurrent clients (each its own connection pool), in plan order."""
    todo: asyncio.Queue[Call] = asyncio.Queue()
    for call in calls:
        todo.put_nowait(call)
    outcomes: list[Outcome] = []

    async def client() -> None:
        async with httpx.AsyncClient() as http:
            while not todo.empty():
                outcomes.append(await send(http, base, todo.get_nowait()))

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes


async def replay(base: str, calls: list[Call]) -> list[Outcome]:
    """Each call alone, one after another (the solo reference), read to its end."""
    async with httpx.AsyncClient() as http:
        return [await send(http, base, attrs.evolve(c, kind=COMPLETE, cut_after=0, timeout_s=0.0)) for c in calls]
