"""ProxyHeaderGuard: refuses, in Ray Serve's HTTP proxy, requests whose Ray Serve headers the proxy cannot read safely.

Ray Serve's HTTP proxy reads a few request headers itself before the app sees the request: ``x-request-id``,
``serve_multiplexed_model_id``, the session-id header (``x-session-id``, or ``$RAY_SERVE_SESSION_ID_HEADER_KEY``),
``x-request-timeout-seconds`` and ``x-request-disconnect-disabled`` (the names compared as Ray does: any case, ``-``
and ``_`` alike). It decodes their values as UTF-8 without catching the error, so a value that is not UTF-8 (bytes
0x80-0xFF are legal in HTTP) made the proxy answer 500; and ``x-request-disconnect-disabled: ?1`` would keep a
request generating after its client left, which this server never does. This ASGI middleware, installed in each
proxy through Ray Serve's ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (``proxy_middlewares``), answers those
requests with a 400 in OpenAI's error shape naming the header, before the proxy reads them; every other request
passes untouched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.middleware import Middleware

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The import path Ray Serve's proxy calls for its middlewares (the environment variable's value).
CALLBACK_IMPORT_PATH = "logitproc.serve.ray_proxy_guard.proxy_middlewares"
#: The environment variable that names it, read by each proxy process.
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
#: Ray Serve's session-id header: its environment variable and default.
SESSION_HEADER_ENV, SESSION_HEADER_DEFAULT = "RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id"
#: The headers Ray Serve's proxy decodes as UTF-8, normalized as it compares them (lower case, ``-`` as ``_``).
DECODED_HEADERS = ("x_request_id", "serve_multiplexed_model_id", "x_request_timeout_seconds",
                   "x_request_disconnect_disabled")
#: The header that would keep a request running after its client left.
DISCONNECT_DISABLED = "x_request_disconnect_disabled"


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_")


def refusal(headers: list[tuple[bytes, bytes]], session_header: str) -> tuple[str, str] | None:
    """The first of ``headers`` (ASGI's raw name/value pairs) that the proxy cannot take, as (its name as sent,
    why), or None."""
    decoded = {*DECODED_HEADERS, _normalized(session_header)}
    for raw_name, value in headers:
        name = raw_name.decode("latin-1")
        normalized = _normalized(name)
        if normalized not in decoded:
            continue
        if normalized == DISCONNECT_DISABLED:
            return name, ("this server ends a request whose client has gone away: the header that disables it is "
                          "refused")
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return name, "its value is not valid UTF-8 (Ray Serve reads it as text)"
    return None


class ProxyHeaderGuard:
    """ASGI middleware: a 400 naming the header for an HTTP request that ``refusal`` finds fault with."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._session_header = os.environ.get(SESSION_HEADER_ENV, SESSION_HEADER_DEFAULT)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = refusal(scope["headers"], self._session_header) if scope["type"] == "http" else None
        if found is None:
            await self._app(scope, receive, send)
            return
        name, why = found
        body = json.dumps({"error": {"message": f"request header {name}: {why}", "type": "invalid_request_error",
                                     "param": name, "code": "invalid_header"}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list[Middleware]:
    """What Ray Serve's proxy calls (``CALLBACK_ENV``): its extra middlewares, outermost last."""
    return [Middleware(ProxyHeaderGuard)]
