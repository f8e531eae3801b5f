"""The dashboard's API-key rule: the same key as the API, sent as a header or as a same-site cookie.

Browsers cannot add a Bearer header to a page load, so the login page trades the key for an HttpOnly,
SameSite=Strict cookie; the comparison is constant-time either way.
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler

COOKIE = "mlx_dspark_key"


def server_key(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    key: str | None = connection.app.state.ctx.settings.server.api_key
    return key or None


def offered_key(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    auth = connection.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return connection.headers.get("x-api-key", "") or connection.cookies.get(COOKIE, "")


def authorized(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    key = server_key(connection)
    return key is None or hmac.compare_digest(offered_key(connection).encode(), key.encode())


def web_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    if not authorized(connection):
        raise NotAuthorizedException(detail="invalid or missing API key")
