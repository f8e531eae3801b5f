"""The Litestar app: three API dialects on one port over one engine thread, plus /health.

`create_app(server)` mounts the routers over the server face that `bootstrap.build_server` composes; the
engine (and so the model load) starts with the app's lifespan. Tests compose theirs over fakes. Every route
sits behind the admission guard (admission.py); unknown routes answer 404 in the OpenAI envelope (Anthropic's
for its paths).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request, Response, get, route
from litestar.config.cors import CORSConfig
from litestar.contrib.jinja import JinjaTemplateEngine
from litestar.datastructures import State
from litestar.exceptions import HTTPException, NotAuthorizedException
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig

from mlx_dspark.application.services import Server
from mlx_dspark.entrypoints.http import (
    admission,
    routes_anthropic,
    routes_openai_chat,
    routes_openai_responses,
    support,
    web,
)
from mlx_dspark.entrypoints.http.web import routes as web_routes
from mlx_dspark.entrypoints.http.web.auth import authorized, web_guard


@get("/health", sync_to_thread=False)
def health(request: Request[Any, Any, Any]) -> Response[Any]:
    """200 once the model is loaded (its name, mode and context window); 503 while loading or when down."""
    ctx = support.context(request)
    engine = ctx.engine
    restarts: dict[str, Any] = {"restarts": engine.restarts}
    if engine.last_restart is not None:
        last = engine.last_restart
        restarts["last_restart"] = {"at": last.at, "cause": last.cause, "reloaded": last.reloaded}
    if engine.ready:
        generator = engine.generator
        window = ctx.chat.context_window(generator.model)
        body = {"status": "ok", "model": generator.model.name, "mode": generator.mode, "context_window": window}
        return Response(content={**body, **restarts})
    if engine.alive and not engine.wait_ready(0):
        return Response(content={"status": "loading", **restarts}, status_code=503)
    error = str(engine.load_error) if engine.load_error else "the inference engine is not running"
    return Response(content={"status": "error", "error": error, **restarts}, status_code=503)


@route("/", http_method=["GET", "HEAD"], sync_to_thread=False)
def root(request: Request[Any, Any, Any]) -> Any:
    """The dashboard for a browser (its login page without the key); a small JSON status, behind the key, for
    clients that probe the base URL. HEAD stays open: Claude Code's connectivity preflight sends no key, and
    an empty 200 tells no more than /health."""
    if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
        from mlx_dspark.entrypoints.http.web.routes import home

        return home(request)
    if request.method == "GET" and not authorized(request):
        raise NotAuthorizedException(detail="invalid or missing API key")
    return Response(content={"status": "ok", "service": "mlx-dspark"})


def _fallback_handler() -> Any:
    """Errors outside the dialect routers (unknown paths, /health): OpenAI's envelope, Anthropic's for its paths."""
    openai = support.error_handler(
        routes_openai_chat.DIALECT.name, routes_openai_chat.DIALECT.from_exception, routes_openai_chat.DIALECT.envelope
    )
    anthropic = support.error_handler(
        routes_anthropic.DIALECT.name, routes_anthropic.DIALECT.from_exception, routes_anthropic.DIALECT.envelope
    )

    def handle(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        path = request.scope["path"]
        if path.startswith(("/v1/messages", "/messages")) or "anthropic-version" in request.headers:
            return anthropic(request, exc)
        return openai(request, exc)

    return handle


def create_app(server: Server) -> Litestar:
    """The server app over the composed server face (`bootstrap.build_server`): it mounts the routers and starts
    the engine (and so the model load) with the app's lifespan. Tests compose theirs over fakes."""
    settings, engine, dashboard = server.settings, server.engine, server.dashboard
    ctx = support.HttpContext(engine=engine, chat=server.chat, settings=settings, responses=server.responses)

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop(timeout=5)

    cors = CORSConfig(allow_origins=list(settings.server.cors_origins)) if settings.server.cors_origins else None
    fallback = _fallback_handler()
    return Litestar(
        route_handlers=[
            health,
            root,
            routes_anthropic.router(),
            routes_openai_chat.router(),
            routes_openai_responses.router(),
            *web_routes.routers(),
            create_static_files_router(path="/static", directories=[web.STATIC], name="static", guards=[web_guard]),
        ],
        guards=[admission.admission_guard],
        template_config=TemplateConfig(directory=web.TEMPLATES, engine=JinjaTemplateEngine),
        lifespan=[lifespan],
        cors_config=cors,
        request_max_body_size=None,  # enforced per dialect, so the 413 comes in the dialect's envelope
        exception_handlers={HTTPException: fallback, Exception: fallback},
        state=State({"ctx": ctx, "dashboard": dashboard, "services": server.services}),
        openapi_config=None,
        logging_config=None,
    )
