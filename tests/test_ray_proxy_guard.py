"""The header guard of Ray Serve's HTTP proxy (``serve/ray_proxy_guard.py``), without Ray: which requests it refuses
(Ray Serve's own headers with values that are not UTF-8, the header that disables disconnect handling, in any
spelling Ray Serve accepts), its 400 in OpenAI's error shape, and every other request passing untouched. Through a
real proxy: ``test_ray_hostile_http.py``."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI
from logitproc.serve.ray_proxy_guard import ProxyHeaderGuard, proxy_middlewares, refusal

NOT_UTF8 = b"caf\xe9"  # latin-1, legal in an HTTP header value

REFUSED = [
    ([(b"x-request-id", NOT_UTF8)], "x-request-id", "not valid UTF-8"),
    ([(b"X-Request-Id", b"\xff")], "X-Request-Id", "not valid UTF-8"),
    ([(b"serve_multiplexed_model_id", NOT_UTF8)], "serve_multiplexed_model_id", "not valid UTF-8"),
    ([(b"Serve-Multiplexed-Model-ID", b"\x80")], "Serve-Multiplexed-Model-ID", "not valid UTF-8"),
    ([(b"x-session-id", NOT_UTF8)], "x-session-id", "not valid UTF-8"),
    ([(b"x_session_id", NOT_UTF8)], "x_session_id", "not valid UTF-8"),
    ([(b"x-request-timeout-seconds", b"1\xff")], "x-request-timeout-seconds", "not valid UTF-8"),
    ([(b"x-request-disconnect-disabled", b"?1")], "x-request-disconnect-disabled", "client has gone away"),
    ([(b"X-Request-Disconnect-Disabled", b"?0")], "X-Request-Disconnect-Disabled", "client has gone away"),
    ([(b"host", b"a"), (b"x-custom", NOT_UTF8), (b"x-request-id", NOT_UTF8)], "x-request-id", "not valid UTF-8"),
]

PASSED = [
    [],
    [(b"x-request-id", b"my-id-1")],
    [(b"x-request-id", "é".encode())],
    [(b"x-session-id", b"s1"), (b"x-request-timeout-seconds", b"nan")],
    [(b"x-custom", NOT_UTF8), (b"authorization", b"Bearer \xe9")],  # not read by Ray: the app decides
    [(b"x-request-disconnect", b"?1")],
]


@pytest.mark.parametrize(("headers", "name", "says"), REFUSED, ids=range(len(REFUSED)))
def test_refused_headers_are_named(headers, name, says) -> None:
    found = refusal(headers, "x-session-id")
    assert found is not None and found[0] == name and says in found[1]


@pytest.mark.parametrize("headers", PASSED, ids=range(len(PASSED)))
def test_other_headers_pass(headers) -> None:
    assert refusal(headers, "x-session-id") is None


def call(app, headers: list[tuple[bytes, bytes]], method: str = "GET") -> tuple[int, dict]:
    """Send one HTTP request with these raw headers through the ASGI ``app`` (a client would send the same bytes;
    an HTTP test client re-encodes header values as UTF-8): its status and JSON body."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": "/ok", "raw_path": b"/ok", "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def _app() -> FastAPI:
    app = FastAPI()

    @app.api_route("/ok", methods=["GET", "POST"])
    async def ok() -> dict:
        return {"ok": True}

    return app


def test_the_session_header_is_ray_serves_setting(monkeypatch) -> None:
    assert refusal([(b"x-my-session", NOT_UTF8)], "X-My-Session")[0] == "x-my-session"
    assert refusal([(b"x-session-id", NOT_UTF8)], "X-My-Session") is None
    monkeypatch.setenv("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-my-session")
    guard = ProxyHeaderGuard(_app())
    assert call(guard, [(b"x-my-session", NOT_UTF8)])[0] == 400
    assert call(guard, [(b"x-session-id", NOT_UTF8)])[0] == 200


def test_the_middleware_answers_400_in_openai_shape_and_passes_the_rest() -> None:
    [middleware] = proxy_middlewares()
    guard = middleware.cls(_app())
    assert call(guard, [(b"x-request-id", NOT_UTF8)]) == (400, {"error": {
        "message": "request header x-request-id: its value is not valid UTF-8 (Ray Serve reads it as text)",
        "type": "invalid_request_error", "param": "x-request-id", "code": "invalid_header"}})
    status, body = call(guard, [(b"x-request-disconnect-disabled", b"?1")], "POST")
    assert status == 400 and body["error"]["param"] == "x-request-disconnect-disabled"
    assert call(guard, [(b"x-request-id", b"fine"), (b"x-custom", NOT_UTF8)]) == (200, {"ok": True})
