"""Dashboard routes: pages, /ui/api/* (JSON and SSE) and /metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import attrs
import structlog
from litestar import Request, Response, Router, delete, get, patch, post
from litestar.exceptions import HTTPException, NotAuthorizedException, NotFoundException
from litestar.response import Stream, Template

from mlx_dspark.application.dashboard import metrics, race, roofline
from mlx_dspark.application.dashboard.models import switch_factory
from mlx_dspark.application.dashboard.modes import SELECTABLE
from mlx_dspark.application.dashboard.service import Dashboard
from mlx_dspark.application.dashboard.sessions import TurnOptions
from mlx_dspark.application.engine import EngineJob
from mlx_dspark.domain.dashboard import SessionNotFound
from mlx_dspark.domain.errors import CapacityExceeded, DomainError, InvalidRequest, ModelUnavailable, quoted
from mlx_dspark.entrypoints.http import support
from mlx_dspark.entrypoints.http.request_log import RequestLog
from mlx_dspark.entrypoints.http.sse import SSE_HEADERS, stream_job
from mlx_dspark.entrypoints.http.web.auth import COOKIE, authorized, offered_key, server_key, web_guard

log = structlog.get_logger("mlx_dspark.web")
PAGES = {
    "chat": "Chat",
    "models": "Models",
    "telemetry": "Telemetry",
    "roofline": "Roofline",
    "race": "Race",
}
KEEPALIVE_S = 10.0
TELEMETRY_IDLE_S = 8.0
MAX_BANDWIDTH_MIB = 4096  # the copy benchmark holds two buffers of this size on the device


def dashboard(request: Request[Any, Any, Any]) -> Dashboard:
    d: Dashboard = request.app.state.dashboard
    return d


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, default=str).encode() + b"\n\n"


class _JsonFramer:
    """The app's JSON events as the streamer's framer; an error is one error event."""

    done = False

    def __init__(self, to_json: Callable[[Any], Iterable[dict[str, Any]]]) -> None:
        self._to_json = to_json

    def start(self) -> list[bytes]:
        return []

    def keepalive(self) -> bytes:
        return b": keep-alive\n\n"

    def feed(self, item: Any) -> list[bytes]:
        return [_sse(obj) for obj in self._to_json(item)]

    def error(self, exc: BaseException) -> list[bytes]:
        return [_sse({"type": "error", "message": str(exc) or type(exc).__name__})]


def job_stream(
    job: EngineJob[Any],
    to_json: Callable[[Any], Iterable[dict[str, Any]]],
    *,
    on_end: Callable[[str], Any] | None = None,
) -> Stream:
    """SSE frames of an engine job through the one streamer (`sse.py`); errors become one error frame."""
    return stream_job(
        job,
        _JsonFramer(to_json),
        keepalive_s=KEEPALIVE_S,
        on_failed=lambda exc: log.warning("web.job_failed", error=str(exc)[:300]),
        on_end=on_end,
    )


async def _json(request: Request[Any, Any, Any]) -> dict[str, Any]:
    body = await support.read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequest(message="the body must be a JSON object")
    return body


def _whole(body: dict[str, Any], key: str, default: int, most: int | None = None) -> int:
    """A positive whole-number field of a JSON body, at most `most` (absent or null: `default`)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(message=f"{key} must be a positive whole number; got {quoted(value)}", param=key)
    if most is not None and value > most:
        raise InvalidRequest(message=f"{key} must be at most {most}; got {value}", param=key)
    return value


def _text(body: dict[str, Any], key: str) -> str:
    """A string field of a JSON body (absent or null: "")."""
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequest(message=f"{key} must be a string; got {quoted(value)}", param=key)
    return value


def _names(body: dict[str, Any], key: str, default: list[str]) -> list[str]:
    """A list-of-strings field of a JSON body (absent, null or empty: `default`)."""
    value = body.get(key) or default
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequest(message=f"{key} must be a list of mode names; got {quoted(value)}", param=key)
    return value


def _error(_: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    if isinstance(exc, NotAuthorizedException):
        return Response(content={"error": "invalid or missing API key"}, status_code=401)
    if isinstance(exc, HTTPException):
        return Response(content={"error": str(exc.detail)}, status_code=exc.status_code)
    if isinstance(exc, SessionNotFound):
        return Response(content={"error": exc.message}, status_code=404)
    if isinstance(exc, InvalidRequest):
        return Response(content={"error": exc.message, "param": exc.param}, status_code=400)
    if isinstance(exc, DomainError):
        status = 503 if isinstance(exc, CapacityExceeded) else 404 if isinstance(exc, ModelUnavailable) else 400
        return Response(content={"error": str(exc)}, status_code=status)
    log.error("web.error", error=repr(exc), exc_info=exc)
    return Response(content={"error": "internal error"}, status_code=500)


# ---- pages ---------------------------------------------------------------------------------------------


def _page(request: Request[Any, Any, Any], page: str) -> Template | Response[Any]:
    if not authorized(request):
        return Template(
            template_name="login.html",
            context={"pages": PAGES, "page": "login"},
            status_code=401,
            media_type="text/html",
        )
    return Template(
        template_name=f"{page}.html",
        context={"pages": PAGES, "page": page, "title": PAGES[page]},
        media_type="text/html",
    )


@get(["/ui", "/ui/{page:str}"], sync_to_thread=False, include_in_schema=False)
def page_view(request: Request[Any, Any, Any], page: str = "chat") -> Any:
    """Every page of the app (`/ui` is the chat page)."""
    if page not in PAGES and authorized(request):  # without the key every path gets the login page
        raise NotFoundException(detail=f"there is no page {quoted(page)}")
    return _page(request, page)


def home(request: Request[Any, Any, Any]) -> Any:
    """`/` for a browser: the chat page (the app's home)."""
    return _page(request, "chat")


@post("/ui/api/login", status_code=200)
async def login(request: Request[Any, Any, Any]) -> Response[Any]:
    """Trade the API key for an HttpOnly, SameSite=Strict cookie."""
    body = await _json(request)
    key = server_key(request)
    offered = str(body.get("key") or "") or offered_key(request)  # a client may also log in with its header
    if key is not None and not hmac.compare_digest(offered.encode(), key.encode()):
        return Response(content={"error": "wrong key"}, status_code=401)
    response: Response[Any] = Response(content={"ok": True})
    if key is not None:
        response.set_cookie(COOKIE, offered, httponly=True, samesite="strict", path="/")
    return response


# ---- status, gauge, metrics ----------------------------------------------------------------------------


def _model_bytes(request: Request[Any, Any, Any]) -> int:
    """The served model's weight bytes, measured by the engine when it began serving it (`Dashboard.served`):
    never a job, so the gauge answers while a long exclusive job (race, roofline) holds the engine."""
    ctx, d = support.context(request), dashboard(request)
    if not ctx.engine.ready:
        return 0
    return d.model_bytes.get(ctx.engine.generator.model.identity, 0)


@get("/ui/api/status")
async def status(request: Request[Any, Any, Any]) -> dict[str, Any]:
    ctx, d = support.context(request), dashboard(request)
    engine = ctx.engine
    snap = d.feed.snapshot() if d.feed is not None else {}
    last = snap.get("last") or {}
    out: dict[str, Any] = {
        "ready": engine.ready,
        "loading": engine.alive and not engine.ready,
        "error": str(engine.load_error) if engine.load_error else None,
        "model": engine.generator.model.name if engine.ready else ctx.settings.model.model,
        "mode": engine.generator.mode if engine.ready else ctx.settings.model.mode,
        "modes": list(SELECTABLE),
        "context_window": engine.generator.model.context_window if engine.ready else None,
        "queue_depth": engine.queue_depth,
        "live_tok_s": snap.get("live_tok_s", 0.0),
        "last_tok_s": last.get("tok_s", 0.0),
        "active_requests": snap.get("active_requests", 0),
        "model_bytes": _model_bytes(request),
        # What the served model's tok/s reads against (`top`'s scale): measured by a race or a roofline, else null.
        "plain_tok_s": d.plain_tok_s.get(engine.generator.model.identity) if engine.ready else None,
        "ceiling_tok_s": d.ceiling_tok_s.get(engine.generator.model.identity) if engine.ready else None,
        "memory": d.probe.memory_in_use(),
        "totals": snap.get("totals", {}),
    }
    out["drafters"] = _drafters(request) if engine.ready else []
    return out


def _drafters(request: Request[Any, Any, Any]) -> list[str]:
    ctx = support.context(request)
    services = request.app.state.services
    try:
        return list(services.loader.available_drafters(ctx.engine.generator.model))
    except Exception:  # a listing problem must not break the gauge
        return []


@get("/metrics")
async def prometheus(request: Request[Any, Any, Any]) -> Response[str]:
    """Prometheus text format: requests, tokens, acceptance, cache hits, queue depth, memory."""
    ctx, d = support.context(request), dashboard(request)
    engine = ctx.engine
    body = metrics.render(
        d.feed.snapshot() if d.feed is not None else None,
        model=engine.generator.model.name if engine.ready else ctx.settings.model.model,
        mode=engine.generator.mode if engine.ready else ctx.settings.model.mode,
        ready=engine.ready,
        queue_depth=engine.queue_depth,
        memory=d.probe.memory_in_use(),
        model_bytes=_model_bytes(request),
        http_streams=dict(ctx.stream_outcomes),
        engine_restarts=engine.restarts,
    )
    return Response(content=body, media_type=metrics.MEDIA_TYPE)


# ---- telemetry -----------------------------------------------------------------------------------------


@get("/ui/api/telemetry/stream")
async def telemetry_stream(request: Request[Any, Any, Any], replay: int = 200) -> Stream:
    """Live decode events (SSE, `id:` = the event's seq): request, prefill, round, cap, finished.

    Recent events are replayed first (`Last-Event-ID` resumes a reconnecting browser exactly where it left off).
    The stream ends after TELEMETRY_IDLE_S without events and EventSource reconnects a second later, so an
    idle stream holds no connection open and a plain HTTP client reading it to the end gets an answer.
    """
    feed = dashboard(request).feed
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=5000)
    after = _last_event_id(request.headers.get("last-event-id", ""))

    def listener(item: dict[str, Any]) -> None:
        def put() -> None:
            if not queue.full():  # a slow browser drops events rather than growing memory
                queue.put_nowait(item)

        loop.call_soon_threadsafe(put)

    def frame(item: dict[str, Any]) -> bytes:
        return f"id: {item['seq']}\n".encode() + _sse(item)

    async def frames() -> AsyncIterator[bytes]:
        if feed is None:
            yield _sse({"type": "error", "message": "telemetry is not available on this server"})
            return
        unsubscribe = feed.subscribe(listener, replay=max(0, min(replay, 2000)), after=after)
        try:
            yield b"retry: 1000\n" + _sse({"type": "hello", "snapshot": feed.snapshot()})
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), TELEMETRY_IDLE_S)
                except TimeoutError:
                    return
                yield frame(item)
        finally:
            unsubscribe()

    return Stream(frames, media_type="text/event-stream", headers=SSE_HEADERS)


MAX_EVENT_ID_DIGITS = 18  # the feed's seq counts events one by one: it never gets near 10**18


def _last_event_id(value: str) -> int | None:
    """The seq a reconnecting EventSource saw last (none sent: None).

    Raises:
        InvalidRequest: anything but an id this server could have sent.
    """
    if not value:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= MAX_EVENT_ID_DIGITS):
        raise InvalidRequest(
            message=f"Last-Event-ID must be the id of an event this stream sent (a whole number); got {quoted(value)}",
            param="Last-Event-ID",
        )
    return int(value)


@get("/ui/api/telemetry/snapshot")
async def telemetry_snapshot(request: Request[Any, Any, Any]) -> dict[str, Any]:
    feed = dashboard(request).feed
    return feed.snapshot() if feed is not None else {}


# ---- sessions and chat ---------------------------------------------------------------------------------


def _session_json(info: Any) -> dict[str, Any]:
    return {**attrs.asdict(info), "settings": dict(info.settings)}


@get("/ui/api/sessions", sync_to_thread=True)
def list_sessions(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    return [_session_json(s) for s in dashboard(request).sessions.sessions()]


@post("/ui/api/sessions", status_code=201)
async def create_session(request: Request[Any, Any, Any]) -> dict[str, Any]:
    body = await _json(request)
    sessions = dashboard(request).sessions
    settings = body.get("settings") or {}
    if not isinstance(settings, dict):
        raise InvalidRequest(message=f"settings must be an object; got {quoted(settings)}", param="settings")
    info = await asyncio.to_thread(sessions.create, _text(body, "title"), settings)
    return _session_json(info)


@get("/ui/api/sessions/{session_id:str}", sync_to_thread=True)
def get_session(request: Request[Any, Any, Any], session_id: str) -> dict[str, Any]:
    sessions = dashboard(request).sessions
    info = sessions.require(session_id)
    messages = [{**attrs.asdict(m), "stats": dict(m.stats)} for m in sessions.messages(session_id)]
    return {**_session_json(info), "messages": messages}


@patch("/ui/api/sessions/{session_id:str}")
async def rename_session(request: Request[Any, Any, Any], session_id: str) -> dict[str, Any]:
    body = await _json(request)
    await asyncio.to_thread(dashboard(request).sessions.rename, session_id, _text(body, "title"))
    return {"ok": True}


@post("/ui/api/sessions/{session_id:str}/rewind", status_code=200)
async def rewind_session(request: Request[Any, Any, Any], session_id: str) -> dict[str, Any]:
    """Drop a user message and what follows it; its text comes back (regenerate resends it, edit refills it)."""
    body = await _json(request)
    message_id = body.get("message_id")
    if isinstance(message_id, bool) or not isinstance(message_id, int):
        raise InvalidRequest(message=f"message_id must be a message's id; got {quoted(message_id)}", param="message_id")
    text = await asyncio.to_thread(dashboard(request).sessions.rewind, session_id, message_id)
    return {"ok": True, "content": text}


@delete("/ui/api/sessions/{session_id:str}", status_code=200, sync_to_thread=True)
def delete_session(request: Request[Any, Any, Any], session_id: str) -> dict[str, Any]:
    dashboard(request).sessions.delete(session_id)
    return {"ok": True}


@get("/ui/api/sessions/{session_id:str}/export", sync_to_thread=True)
def export_session(request: Request[Any, Any, Any], session_id: str, format: str = "md") -> Response[Any]:
    sessions = dashboard(request).sessions
    if format == "json":
        body = json.dumps(sessions.export_json(session_id), indent=2, ensure_ascii=False)
        media, ext = "application/json", "json"
    elif format in ("md", "markdown"):
        body, media, ext = sessions.export_markdown(session_id), "text/markdown; charset=utf-8", "md"
    else:
        raise InvalidRequest(message="format must be md or json", param="format")
    headers = {"Content-Disposition": f'attachment; filename="session-{session_id[:8]}.{ext}"'}
    return Response(content=body, media_type=media, headers=headers)


@post("/ui/api/sessions/{session_id:str}/chat", status_code=200)
async def chat(request: Request[Any, Any, Any], session_id: str) -> Stream:
    """One streamed turn: the user message is committed first, the reply when the stream ends."""
    ctx, d = support.context(request), dashboard(request)
    body = await _json(request)
    options = TurnOptions.from_json(body.get("options"))
    sessions = d.sessions
    creq = await asyncio.to_thread(sessions.begin_turn, session_id, _text(body, "content"), options)
    served = ctx.engine.generator.mode if ctx.engine.ready else None
    mode = sessions.mode_of(ctx.engine.generator, options.mode) if ctx.engine.ready else options.mode
    # The served mode's turn decodes beside the other requests; another mode's runs alone on its own service.
    if mode == served:
        job = ctx.engine.submit_decode(lambda g, emit: sessions.turn_job(g, creq, emit))
    else:
        job = ctx.engine.submit(lambda g: sessions.run_turn(g, creq, options.mode), exclusive=True)
    reply = sessions.reply(session_id, creq, mode, time.perf_counter())
    # The chat page's turns log the same canonical line as the API's requests (never their text).
    record = RequestLog.of(request, "ui")
    record.model, record.stream = ctx.engine.generator.model.name if ctx.engine.ready else None, True

    def page_events(item: Any) -> list[dict[str, Any]]:
        record.observe(item)
        return reply.page_events(item)

    async def save(outcome: str) -> None:
        record.emit(200, outcome=outcome)
        await asyncio.to_thread(reply.finish, outcome)

    return job_stream(job, page_events, on_end=save)


# ---- race and roofline ---------------------------------------------------------------------------------


@post("/ui/api/race", status_code=200)
async def run_race(request: Request[Any, Any, Any]) -> Stream:
    """Plain decoding and each chosen mode on one prompt, tokens live, then the checked verdict."""
    ctx, d = support.context(request), dashboard(request)
    body = await _json(request)
    prompt = str(body.get("prompt") or "")
    lanes = _names(body, "modes", [])
    max_tokens = _whole(body, "max_tokens", 64)
    repeats = _whole(body, "repeats", 2, most=race.MAX_REPEATS)
    modes, engine = d.modes, ctx.engine
    # Exclusive: the lanes share a private batch of their own, and their solo timings the machine with nothing.
    job = engine.submit(
        lambda g: d.remember_race(g, race.race(modes, g, prompt, lanes, max_tokens=max_tokens, repeats=repeats,
                                               side_by_side=engine.side_by_side)),
        exclusive=True,
    )  # fmt: skip
    return job_stream(job, lambda ev: [race.as_json(ev)])


@post("/ui/api/roofline", status_code=200)
async def run_roofline(request: Request[Any, Any, Any]) -> Stream:
    ctx, d = support.context(request), dashboard(request)
    body = await _json(request)
    lanes = _names(body, "modes", ["lookup"])
    size = _whole(body, "bandwidth_mib", 256, most=MAX_BANDWIDTH_MIB) << 20
    max_tokens = _whole(body, "max_tokens", 48)
    repeats = _whole(body, "repeats", 2, most=race.MAX_REPEATS)
    modes, probe = d.modes, d.probe
    job = ctx.engine.submit(
        lambda g: d.remember_roofline(g, roofline.measure(modes, g, probe, lanes, max_tokens=max_tokens,
                                                          bandwidth_bytes=size, repeats=repeats)),
        exclusive=True,
    )  # fmt: skip
    return job_stream(job, lambda ev: [ev])


# ---- models --------------------------------------------------------------------------------------------


@get("/ui/api/models/local", sync_to_thread=True)
def local_models(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    return dashboard(request).models.local()


@get("/ui/api/models/search", sync_to_thread=True)
def search_models(request: Request[Any, Any, Any], q: str = "") -> list[dict[str, Any]]:
    return dashboard(request).models.hub.search(q)


@get("/ui/api/models/fit", sync_to_thread=True)
def fit_estimate(request: Request[Any, Any, Any], repo: str, drafter: str = "") -> dict[str, Any]:
    return dashboard(request).models.fit(repo, drafter or None)


@post("/ui/api/models/download", status_code=202)
async def start_download(request: Request[Any, Any, Any]) -> dict[str, Any]:
    body = await _json(request)
    return dashboard(request).models.start_download(str(body.get("repo_id") or "")).as_json()


@get("/ui/api/models/downloads", sync_to_thread=False)
def downloads(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    return dashboard(request).models.downloads()


@post("/ui/api/models/delete", status_code=200)
async def delete_model(request: Request[Any, Any, Any]) -> dict[str, Any]:
    body = await _json(request)
    engine = support.context(request).engine
    served = engine.generator.model.name if engine.ready else None
    await asyncio.to_thread(dashboard(request).models.delete, str(body.get("path") or ""), served=served)
    return {"ok": True}


@post("/ui/api/models/load", status_code=200)
async def load_model(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """Serve another model / mode / drafter: built on the engine thread after the queued jobs."""
    ctx, d = support.context(request), dashboard(request)
    body = await _json(request)
    services = request.app.state.services
    factory = switch_factory(
        services,
        ctx.settings,
        model=str(body.get("model") or ""),
        mode=str(body.get("mode") or "") or None,
        drafter=str(body.get("drafter") or "") or None,
    )
    job = ctx.engine.switch(factory)
    async for generator in job:
        d.modes.forget()
        return {"ok": True, "model": generator.model.name, "mode": generator.mode}
    raise InvalidRequest(message="the engine did not switch")


def routers() -> list[Router]:
    """Pages and login (which answer a missing key with the login page) and the guarded API routes."""
    pages = Router(
        path="/",
        route_handlers=[page_view, login],
        exception_handlers={Exception: _error},
    )
    api = Router(
        path="/",
        route_handlers=[
            status,
            prometheus,
            telemetry_stream,
            telemetry_snapshot,
            list_sessions,
            create_session,
            get_session,
            rename_session,
            rewind_session,
            delete_session,
            export_session,
            chat,
            run_race,
            run_roofline,
            local_models,
            search_models,
            fit_estimate,
            start_download,
            downloads,
            delete_model,
            load_model,
        ],
        guards=[web_guard],
        exception_handlers={Exception: _error},
    )
    return [pages, api]
