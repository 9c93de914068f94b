"""Which requests the server answers at all: the Host allow-list, the Origin policy and JSON-only POST bodies.

Checked before any route runs, in this order (each refusal in OpenAI's error shape):

- **Host** (against DNS rebinding: a page whose domain the attacker re-points at 127.0.0.1 sends its own name as
  Host): an IP literal (``127.0.0.1``, ``[::1]``, a LAN address: no name to rebind), ``localhost`` and
  ``*.localhost``, the name the server was bound to (``--host``), and the names in ``--allowed-hosts`` (``*``: any).
  A request without a Host header (HTTP/1.0; no browser sends one) passes. Otherwise 403 ``host_not_allowed``.
- **Origin** (against cross-site use: any page a user visits can send requests to the local server): a request with
  an ``Origin`` header passes only when it is the server's own origin (``scheme://Host``, as the chat page served by
  this server sends) or listed in ``--allowed-origins`` (``*``: any); those get CORS headers and preflight answers.
  Otherwise 403 ``origin_not_allowed``. Requests without ``Origin`` (curl, SDKs) pass.
- **Content-Type**: a POST must say ``application/json`` (a browser sends ``text/plain``, form and multipart bodies
  cross-site without a preflight, so they are never parsed); otherwise 415 ``unsupported_media_type``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from .openai_protocol import APIError

ANY = "*"


def _hostname(host_header: str) -> str:
    """The name or address of a Host header value, without its port, lower case, without a trailing dot."""
    host = host_header.strip()
    if host.startswith("["):  # [::1]:8000
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".").lower()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _shown(value: str) -> str:
    """A client's header value quoted for a message or a log line: escaped, at most 80 characters."""
    return ascii(value[:80]) + ("..." if len(value) > 80 else "")


@dataclass(frozen=True)
class RequestPolicy:
    """The Host names and Origins a server accepts beyond its own (``--allowed-hosts``, ``--allowed-origins``)."""

    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", tuple(_hostname(h) if h != ANY else ANY
                                                        for h in self.allowed_hosts))
        object.__setattr__(self, "allowed_origins", tuple(o.rstrip("/").lower() for o in self.allowed_origins))

    def host_allowed(self, host_header: str | None) -> bool:
        if host_header is None:
            return True
        host = _hostname(host_header)
        return (_is_ip(host) or host == "localhost" or host.endswith(".localhost")
                or host == _hostname(self.bound_host) or ANY in self.allowed_hosts or host in self.allowed_hosts)

    def origin_allowed(self, origin: str, scheme: str, host_header: str | None) -> bool:
        origin = origin.rstrip("/").lower()
        same = host_header is not None and origin == f"{scheme}://{host_header.strip().lower()}"
        return same or ANY in self.allowed_origins or origin in self.allowed_origins

    def refusal(self, method: str, scheme: str, headers: dict[str, str]) -> APIError | None:
        """Why a request is refused (an APIError), or None when it may go on."""
        host = headers.get("host")
        if not self.host_allowed(host):
            return APIError(403, f"this server does not answer to the Host {_shown(host or '')}; start it with "
                                 "--allowed-hosts NAME to allow a name", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, scheme, host):
            return APIError(403, f"requests from the web origin {_shown(origin)} are refused; start the server with "
                                 "--allowed-origins ORIGIN to allow one", code="origin_not_allowed")
        if method == "POST":
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                return APIError(415, "POST bodies must be JSON sent with 'Content-Type: application/json', got "
                                     f"{_shown(media_type) if media_type else 'none'}", code="unsupported_media_type")
        return None


class PolicyMiddleware:
    """ASGI middleware applying a RequestPolicy to HTTP requests; allowed cross-origin requests get CORS headers."""

    def __init__(self, app: Any, policy: RequestPolicy) -> None:
        self.policy = policy
        self.app = app
        if policy.allowed_origins:
            origins = [ANY] if ANY in policy.allowed_origins else list(policy.allowed_origins)
            self.app = CORSMiddleware(app, allow_origins=origins, allow_methods=["GET", "POST"],
                                      allow_headers=["Authorization", "Content-Type"], max_age=600)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            error = self.policy.refusal(scope["method"], scope.get("scheme", "http"), headers)
            if error is not None:
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
