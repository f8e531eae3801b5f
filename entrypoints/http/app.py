"""The Litestar app: three API dialects on one port over one engine thread, plus /health.

`create_app(services, settings)` wires everything; the engine (and so the model load) starts with the
app's lifespan. Tests pass services built on fakes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request, Response, get, route
from litestar.config.cors import CORSConfig
from litestar.contrib.jinja import JinjaTemplateEngine
from litestar.datastructures import State
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig

from mlx_dspark.application.bootstrap import build_dashboard
from mlx_dspark.application.chat_service import ChatService
from mlx_dspark.application.dashboard.service import Dashboard
from mlx_dspark.application.engine import EngineThread
from mlx_dspark.application.generation import GenerationService
from mlx_dspark.application.services import Services
from mlx_dspark.application.settings import Settings
from mlx_dspark.entrypoints.http import routes_anthropic, routes_openai_chat, routes_openai_responses, support, web
from mlx_dspark.entrypoints.http.web import routes as web_routes
from mlx_dspark.entrypoints.http.web.auth import web_guard

DEFAULT_MAX_BODY = 64 * 1024 * 1024
DEFAULT_KEEPALIVE_S = 5.0


@get("/health", sync_to_thread=False)
def health(request: Request[Any, Any, Any]) -> Response[Any]:
    """200 once the model is loaded; 503 while loading or when the engine is down."""
    ctx = support.context(request)
    engine = ctx.engine
    if engine.ready:
        generator = engine.generator
        return Response(content={"status": "ok", "model": generator.model.name, "mode": generator.mode})
    if engine.alive and not engine.wait_ready(0):
        return Response(content={"status": "loading"}, status_code=503)
    error = str(engine.load_error) if engine.load_error else "the inference engine is not running"
    return Response(content={"status": "error", "error": error}, status_code=503)


@route("/", http_method=["GET", "HEAD"], sync_to_thread=False)
def root(request: Request[Any, Any, Any]) -> Any:
    """The dashboard for a browser; a small JSON status for clients that probe the base URL."""
    if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
        from mlx_dspark.entrypoints.http.web.routes import home

        return home(request)
    return Response(content={"status": "ok", "service": "mlx-dspark"})


def create_app(
    services: Services,
    settings: Settings | None = None,
    *,
    engine: EngineThread | None = None,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    dashboard: Dashboard | None = None,
) -> Litestar:
    """The server app.

    Args:
        services: wired adapters (a fake loader in tests).
        settings: the settings tree (defaults to services.settings).
        engine: an engine to use instead of one that builds the configured GenerationService.
        keepalive_s: seconds of engine silence before a dialect keep-alive event.
        max_body_bytes: the largest accepted request body.
        dashboard: the web dashboard's use cases (default: built over the real adapters).
    """
    settings = settings or services.settings

    def build() -> GenerationService:
        from mlx_dspark.application.modes import build_generator

        return build_generator(services, settings)

    engine = engine or EngineThread(build)
    ctx = support.HttpContext(
        engine=engine,
        chat=ChatService(services.families, settings.server),
        settings=settings,
        keepalive_s=keepalive_s,
        max_body_bytes=max_body_bytes,
    )

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop(timeout=5)

    dashboard = dashboard or build_dashboard(services, settings)
    cors = CORSConfig(allow_origins=list(settings.server.cors_origins)) if settings.server.cors_origins else None
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
        template_config=TemplateConfig(directory=web.TEMPLATES, engine=JinjaTemplateEngine),
        lifespan=[lifespan],
        cors_config=cors,
        request_max_body_size=None,  # enforced per dialect, so the 413 comes in the dialect's envelope
        state=State({"ctx": ctx, "dashboard": dashboard, "services": services}),
        openapi_config=None,
        logging_config=None,
    )
