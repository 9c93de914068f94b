"""``logitproc serve --replicas 1`` (one engine replica behind the Ray Serve ingress) answers the same tokens as the
single-process server for the same seeds: chat and completions, streamed or not, with ``n``, and tool calls (both
serve the tiny model with Qwen3's chat template, whose tool-call syntax the ingress reads as the server does).

The replica coalesces its streams (``--ray-stream-interval`` of a second, far longer than the tiny model's steps):
every token still arrives, in order, as the single-process server's; the end of an answer is not held back for the
interval, and a client that leaves has its request aborted."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import material
import pytest

pytest.importorskip("ray.serve")

from server_process import KEY, ServerProcess, metrics  # noqa: E402
from test_server import raw  # noqa: E402
from test_server_tools import MESSAGES, TOOLS  # noqa: E402

#: The Ray server's ``--ray-stream-interval`` (ms): the most the option takes.
INTERVAL_MS = 1000


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    template = material.llama_cpp_models() / "templates" / "Qwen-Qwen3-0.6B.jinja"
    options = ("--model", "tiny", "--max-batch", "8", "--max-queue", "8", "--chat-template", str(template))
    ray = ServerProcess(*options, "--replicas", "1", "--ray-stream-interval", str(INTERVAL_MS))
    plain = ServerProcess(*options)
    yield ray, plain
    assert ray.stop() == 0 and plain.stop() == 0


def streamed(response) -> list[tuple[int, str]]:
    """Each chunk's (choice index, text) of a completions stream."""
    chunks = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    return [(c["index"], c["text"]) for chunk in chunks for c in chunk["choices"]]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_same_tokens_as_the_single_process_server(servers, seed) -> None:
    completion = {"prompt": f"Tell me {seed}", "max_tokens": 24, "temperature": 1.0, "seed": seed, "logprobs": 1,
                  "n": 2}
    chat = {"messages": [{"role": "user", "content": f"Hello {seed}"}], "max_tokens": 24, "temperature": 0.8,
            "seed": seed, "logprobs": True}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat),
                       ("/v1/completions", {**completion, "stream": True})):
        ours, theirs = (raw(server, path, body) for server in servers)
        assert ours.status_code == theirs.status_code == 200
        if body.get("stream"):
            assert streamed(ours) == streamed(theirs) and streamed(ours)
            continue
        ours, theirs = ours.json(), theirs.json()
        assert [c.get("logprobs") for c in ours["choices"]] == [c.get("logprobs") for c in theirs["choices"]]
        assert [c.get("text", c.get("message")) for c in ours["choices"]] == [
            c.get("text", c.get("message")) for c in theirs["choices"]]


def test_the_same_tool_calls_as_the_single_process_server(servers) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 1.0,
            "seed": 3}
    ours, theirs = (raw(server, "/v1/chat/completions", body).json() for server in servers)
    message = ours["choices"][0]["message"]
    assert ours["choices"][0]["finish_reason"] == "tool_calls" and message["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in theirs["choices"][0]["message"]["tool_calls"]]


def timed_stream(server: ServerProcess, body: dict) -> list[tuple[float, str]]:
    """(arrival time, line) of each ``data:`` line of a streamed answer."""
    lines = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append((time.monotonic(), line[len("data: "):]))
    return lines


def contents(lines: list[tuple[float, str]]) -> list[tuple[int, str | None, str | None]]:
    """Each chunk's (choice index, content, finish reason), in order."""
    chunks = [json.loads(line) for _, line in lines if line != "[DONE]"]
    return [(c["index"], c["delta"].get("content"), c["finish_reason"]) for chunk in chunks for c in chunk["choices"]]


@pytest.mark.parametrize("seed", [4, 5])
def test_a_coalesced_stream_has_every_token_in_order_and_its_end_at_once(servers, seed) -> None:
    body = {"messages": [{"role": "user", "content": f"Count to {seed}"}], "max_tokens": 24, "temperature": 1.0,
            "seed": seed, "stream": True, "n": 2, "ignore_eos": True, "stream_options": {"include_usage": True}}
    ours, theirs = (timed_stream(server, body) for server in servers)
    assert contents(ours) == contents(theirs)
    assert [finish for _, _, finish in contents(ours) if finish] == ["length", "length"]
    assert json.loads(ours[-2][1])["usage"]["completion_tokens"] == 2 * 24
    assert ours[-1][1] == theirs[-1][1] == "[DONE]"
    # the first token goes at once, the rest ride together; the answer's end (24 tiny-model steps, a few ms each)
    # goes when it comes, not a second (the interval) after the first token
    first = next(when for when, line in ours if '"content":"' in line)
    assert ours[-1][0] - first < 0.8 * INTERVAL_MS / 1000


def aborted(server: ServerProcess) -> float:
    prefix = 'logitproc_sequences_finished_total{reason="abort",replica="'
    return sum(value for key, value in metrics(server).items() if key.startswith(prefix))


def test_a_client_that_leaves_a_coalesced_stream_is_aborted(servers) -> None:
    ray, _ = servers
    before = aborted(ray)
    body = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 4000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", ray.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        for line in response.iter_lines():
            if '"content":"' in line:
                break  # the first token; the replica holds the next ones for the interval: the client leaves
    deadline = time.monotonic() + 10  # (the replica's metrics come with each answer's end, and every 2 s)
    while aborted(ray) != before + 1:
        assert time.monotonic() < deadline, "the request was not aborted when its client left"
        raw(ray, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        time.sleep(0.2)
