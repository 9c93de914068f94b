"""``logitproc serve --replicas 1`` (one engine replica behind the Ray Serve ingress) answers the same tokens as the
single-process server for the same seeds: chat and completions, streamed or not, with ``n``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

pytest.importorskip("ray.serve")

from server_process import ServerProcess  # noqa: E402
from test_server import raw  # noqa: E402

SERVER_OPTIONS = ("--model", "tiny", "--max-batch", "8", "--max-queue", "8")


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    ray, plain = ServerProcess(*SERVER_OPTIONS, "--replicas", "1"), ServerProcess(*SERVER_OPTIONS)
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
