"""The hostile-client tests of ``test_hostile_http.py`` through Ray Serve's HTTP proxy (``--replicas 2``).

With ``--replicas`` the client talks to Ray Serve's proxy (its own uvicorn and HTTP parser), which hands each request
to the ingress deployment running the server's app: what the single-process server promises against careless and
hostile clients must hold there too. The tests of ``test_hostile_http.py`` that drive a server run here unchanged
against ``logitproc serve --model tiny --replicas 2 --replica-threads 1`` (malformed, deep, huge and non-Unicode JSON,
half-sent bodies and broken chunked framing, an 8 MB body, the queue's limit, a recursive schema, cross-site requests
and DNS rebinding, the fuzz over methods, paths, bodies, headers and framing); the ones whose observation differs
through Ray are written here: the unknown-field log line (it comes from the ingress's process, through Ray's log
streaming), a client that never reads its stream or gives up waiting (the request is aborted on its replica), the
fuzz's check that nothing is left running (per replica), and Ctrl-C with a client that never reads (a second,
one-replica instance, about 60 s: marked ``slow``). Added for Ray: the request headers Ray Serve's proxy reads
itself, with values it cannot read (``serve/ray_proxy_guard.py``), and its own routes. Bad fields' 400s naming the
field, 401, 404 and 429 through Ray are in ``test_ray_serve.py``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("ray.serve")

from server_process import KEY, ServerProcess, metrics  # noqa: E402
from test_hostile_http import (  # noqa: E402, F401 (the tests themselves, run here against the Ray server)
    JSON,
    MAX_QUEUE,
    MESSAGES,
    _fuzz,
    ctrl_c_beside_an_unread_stream,
    post,
    test_a_deep_answer_to_a_recursive_schema_ends,
    test_a_huge_message_is_refused_by_its_size_before_tokenizing_and_health_stays_quick,
    test_a_request_the_queue_can_never_hold_is_a_400_not_a_429,
    test_cross_site_requests_are_refused_and_the_same_origin_works,
    test_dns_rebinding_hosts_are_refused,
    test_half_sent_bodies_and_broken_chunked_framing_end_without_a_500,
    test_hostile_json_bodies_get_a_400_naming_the_limit,
)
from test_ray_serve import aborted_everywhere, wait_healthy  # noqa: E402

#: The prefix Ray puts before each line a worker writes when it streams it to the command's output.
RAY_LINE_PREFIX = re.compile(r"^\([^)]*pid=\d+[^)]*\) ")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--model", "tiny", "--replicas", "2", "--replica-threads", "1", "--max-batch", "4",
                         "--max-queue", str(MAX_QUEUE))
    wait_healthy(proc)
    yield proc
    assert proc.stop() == 0


def _lines(text: str) -> list[str]:
    """The lines of the command's output, without Ray's worker prefix."""
    return [RAY_LINE_PREFIX.sub("", line) for line in text.splitlines()]


def test_unknown_field_names_are_logged_escaped_counted_and_bounded(server) -> None:
    before = len(server.output())
    body = {"messages": MESSAGES, "max_tokens": 1, "x\nFORGED: admin logged in": 1}
    body.update({f"f{i}": i for i in range(20_000)})
    assert post(server, body).status_code == 200
    deadline = time.monotonic() + 15  # (Ray streams a worker's output to the command's a moment later)
    while "ignoring 20001 unknown field(s)" not in (written := server.output()[before:]):
        assert time.monotonic() < deadline, f"the ingress's log line did not reach the command's output:\n{written}"
        time.sleep(0.2)
    [line] = [line for line in _lines(written) if "unknown field(s)" in line]
    assert len(line) < 2000, len(line)
    assert "ignoring 20001 unknown field(s): 'x\\nFORGED: admin logged in', f0, f1, f2" in line
    assert "and 19991 more" in line
    assert not any(line.startswith("FORGED") for line in _lines(written))


#: Ray Serve's own request headers, with values its proxy could not read (a 500 from the proxy before
#: serve/ray_proxy_guard.py) or that would keep a request running after its client left: a 400 naming the header.
REFUSED_RAY_HEADERS = [("x-request-id", b"caf\xe9"), ("serve_multiplexed_model_id", b"\xff"),
                       ("Serve-Multiplexed-Model-Id", b"\x80"), ("x-session-id", b"\xff"),
                       ("x-request-timeout-seconds", b"1\xff"), ("x-request-disconnect-disabled", b"?1")]
#: Values Ray Serve reads without failing (a malformed timeout is ignored, a tiny one ends the request with 408).
TAKEN_RAY_HEADERS = [("x-request-timeout-seconds", b"inf"), ("x-request-timeout-seconds", b"nan"),
                     ("x-request-timeout-seconds", b"1e400"), ("x-request-timeout-seconds", b"-1"),
                     ("x-request-timeout-seconds", b"soon"), ("x-request-timeout-seconds", b"0.000001"),
                     ("x-request-id", "é".encode() * 2000), ("x-session-id", b"s1")]


def test_ray_serves_own_headers_never_get_a_500(server) -> None:
    assert "header guard" not in server.output()  # the command found its proxy guarded
    for name, value in REFUSED_RAY_HEADERS:
        r = post(server, {"messages": MESSAGES, "max_tokens": 2}, headers={**JSON, name: value})
        assert r.status_code == 400, (name, value, r.text)
        # (names reach the proxy's app lower-cased, as ASGI has them)
        assert r.json()["error"]["param"] == name.lower() and r.json()["error"]["code"] == "invalid_header"
    for name, value in TAKEN_RAY_HEADERS:
        r = post(server, {"messages": MESSAGES, "max_tokens": 2}, headers={**JSON, name: value})
        assert r.status_code in (200, 408), (name, value, r.status_code, r.text)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    # Ray Serve's proxy answers its own routes itself, without the key (docs/server.md says so)
    assert httpx.get(server.url + "/-/healthz", timeout=10).status_code == 200
    assert httpx.get(server.url + "/-/routes", timeout=10).json() == {"/": "logitproc"}


def _replica_sum(server: ServerProcess, name: str) -> float:
    """A metric summed over the replicas (each reports with a ``replica`` label)."""
    return sum(value for key, value in metrics(server).items() if key.startswith(name + "{") and "replica=" in key)


def _wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_client_that_never_reads_or_gives_up_is_aborted_on_its_replica(server) -> None:
    """A stream nobody reads holds no one else up, and is aborted on its replica once its client goes; so is a
    non-streaming request whose client stops waiting."""
    before = aborted_everywhere(server)
    body = json.dumps({"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        _wait_for(lambda: _replica_sum(server, "logitproc_requests_running") == 1, 30,
                  "the unread stream never ran")
        started = time.monotonic()
        assert post(server, {"messages": MESSAGES, "max_tokens": 4}).status_code == 200
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert time.monotonic() - started < 20
    # the client has gone: its replica stops generating for it
    _wait_for(lambda: aborted_everywhere(server) == before + 1, 20, "the unread stream was not aborted")
    with pytest.raises(httpx.ReadTimeout):
        post(server, {"prompt": "x", "max_tokens": 4000, "ignore_eos": True}, "/v1/completions", timeout=1.0)
    _wait_for(lambda: aborted_everywhere(server) == before + 2, 20, "the abandoned request was not aborted")
    _wait_for(lambda: _replica_sum(server, "logitproc_requests_running") == 0, 10, "a request still runs")


def wait_replicas_idle(server: ServerProcess, timeout: float) -> None:
    """Until no replica has a sequence running or KV cache held (each reports every 2 s and after each request)."""
    _wait_for(lambda: _replica_sum(server, "logitproc_batch_sequences") == 0
              and _replica_sum(server, "logitproc_kv_cache_tokens") == 0, timeout, "a replica is still busy")


def test_fuzz_the_http_layer(server) -> None:
    """test_hostile_http.py's fuzz through Ray's proxy: no 5xx, no traceback, /health answering, every accepted
    request ending, nothing left running."""
    _fuzz(server, 120, wait_replicas_idle)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LOGITPROC_FUZZ_LONG"), reason="the long fuzz run: set LOGITPROC_FUZZ_LONG=1")
def test_fuzz_the_http_layer_long(server) -> None:
    _fuzz(server, 2000, wait_replicas_idle)


@pytest.mark.slow
def test_ctrl_c_with_a_client_that_never_reads_drains_then_exits_130() -> None:
    """As test_hostile_http.py's, with one replica behind Ray: Ctrl-C deletes the application (Ray Serve's drain of
    --drain-timeout seconds for the stream nobody reads), stops the local Ray instance, and exits 130."""
    proc = ServerProcess("--model", "tiny", "--replicas", "1", "--replica-threads", "1", "--drain-timeout", "1",
                         api_key=None)
    try:
        log = ctrl_c_beside_an_unread_stream(proc, exit_within=60)
        assert "Traceback" not in log, log[-3000:]
    finally:
        proc.stop()
