"""``logitproc serve --replicas 1`` (one engine replica behind the Ray Serve ingress) answers the same tokens as the
single-process server for the same seeds: chat and completions, streamed or not, with ``n``, and tool calls (both
serve the tiny model with Qwen3's chat template, whose tool-call syntax the ingress reads as the server does)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import material
import pytest

pytest.importorskip("ray.serve")

from server_process import ServerProcess  # noqa: E402
from test_server import raw  # noqa: E402
from test_server_tools import MESSAGES, TOOLS  # noqa: E402


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    template = material.llama_cpp_models() / "templates" / "Qwen-Qwen3-0.6B.jinja"
    options = ("--model", "tiny", "--max-batch", "8", "--max-queue", "8", "--chat-template", str(template))
    ray, plain = ServerProcess(*options, "--replicas", "1"), ServerProcess(*options)
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
