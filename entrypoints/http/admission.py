"""Who may drive the server: a guard that keeps web pages from other sites out.

A page in the user's browser can reach 127.0.0.1. Three checks stop it, on every route:
- `Host` must name this server: an IP literal, `localhost`, the bound host, or a `--allowed-host` name. A DNS
  rebinding attack needs a name of its own that resolves here, so that name is refused.
- `Origin`, when a browser sends one, must be the server's own (its pages, e.g. the dashboard) or one named
  with `--cors-origin`.
- A POST must say `Content-Type: application/json`: a form or `text/plain` post is what a page can send
  without asking first (no CORS preflight).
CLI agents and SDKs send no `Origin`, the right `Host` and JSON, so they pass untouched.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from litestar.connection import ASGIConnection
from litestar.exceptions import ClientException, HTTPException, PermissionDeniedException
from litestar.handlers.base import BaseRouteHandler

from mlx_dspark.application.settings import ServerSettings
from mlx_dspark.domain.errors import quoted


class UnsupportedMediaType(HTTPException):
    status_code = 415


def host_name(host: str) -> str:
    """The name part of a Host header value: no port, no IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_allowed(host: str, settings: ServerSettings) -> bool:
    name = host_name(host)
    if _is_ip(name) or name == "localhost" or name.endswith(".localhost"):
        return True
    return name in {settings.host.lower(), *(h.lower() for h in settings.allowed_hosts)}


def origin_allowed(origin: str, host: str, settings: ServerSettings) -> bool:
    if "*" in settings.cors_origins or origin in settings.cors_origins:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host.strip().lower()


def is_json(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


def admission_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Refuse foreign hosts (400), foreign origins (403) and non-JSON posts (415)."""
    settings: ServerSettings = connection.app.state.ctx.settings.server
    host = connection.headers.get("host", "")
    if host and not host_allowed(host, settings):
        raise ClientException(
            detail=f"the Host header {quoted(host_name(host))} does not name this server (DNS rebinding protection); "
            "start the server with --allowed-host to accept it"
        )
    origin = connection.headers.get("origin")
    if origin is not None and not origin_allowed(origin, host, settings):
        raise PermissionDeniedException(
            detail=f"cross-origin requests from {quoted(origin)} are refused; start the server with "
            "--cors-origin to allow that origin"
        )
    if connection.scope.get("method") == "POST":
        content_type = connection.headers.get("content-type", "")
        if not is_json(content_type):
            shown = quoted(content_type) if content_type else "none"
            raise UnsupportedMediaType(detail=f"the request body must be sent as application/json (got {shown})")
