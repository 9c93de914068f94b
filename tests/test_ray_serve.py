"""``logitproc serve --replicas 2`` on Ray Serve, through the official openai client and raw HTTP.

One local Ray instance for the module: ``python -m logitproc serve --model tiny --replicas 2 --replica-threads 1``
(two engine replicas of one thread each behind the Ray Serve ingress). The same requests as the single-process
server's tests (chat, streams, ``n``, seeds, JSON schemas, bad inputs, 401/404/429), the same answers as the
single-process server for the same seeds, a shared-prefix workload served from one replica's prefix cache, and a
replica's process killed while 16 streams run. ``/metrics`` lists every live replica from the moment it is up, and
drops one that died.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

pytest.importorskip("ray.serve")

from server_process import KEY, ServerProcess, metrics  # noqa: E402
from test_server import BAD_REQUESTS, MESSAGES, raw  # noqa: E402

#: The process title Ray gives an engine replica's worker.
REPLICA_TITLE = b"ServeReplica:logitproc:EngineReplica"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--model", "tiny", "--replicas", "2", "--replica-threads", "1", "--max-batch", "8",
                         "--max-queue", "8")  # the 16 streams of the kill test fit on one replica
    wait_healthy(proc)  # (/health is 200 "degraded" while the second replica still loads)
    yield proc
    assert proc.stop() == 0
    assert not replica_pids(proc), "replicas left running after the command stopped"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    return children


def replica_pids(server: ServerProcess) -> list[int]:
    """The live engine replica processes the server's local Ray instance runs (its descendants)."""
    children, found, todo = _children(), [], [server.proc.pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    title = f.read()
                with open(f"/proc/{child}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue
            if REPLICA_TITLE in title and state != b"Z":
                found.append(child)
    return sorted(found)


def health(server: ServerProcess) -> tuple[int, dict]:
    r = httpx.get(server.url + "/health", timeout=30)
    return r.status_code, r.json()


def wait_healthy(server: ServerProcess, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while health(server) != (200, {"status": "ok", "replicas": 2, "replicas_wanted": 2}):
        assert time.monotonic() < deadline, f"not back to 2 replicas: {health(server)}"
        time.sleep(0.5)


def listed_replicas(server: ServerProcess) -> set[str]:
    """The replicas ``/metrics`` lists (each exports its KV cache's capacity from the moment it is up)."""
    prefix = 'logitproc_kv_cache_capacity_tokens{replica="'
    return {key[len(prefix):-2] for key, value in metrics(server).items() if key.startswith(prefix) and value > 0}


def wait_listed(server: ServerProcess, check, timeout: float = 60) -> set[str]:
    """The replicas ``/metrics`` lists, once ``check`` holds for them (fails after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not check(listed := listed_replicas(server)):
        assert time.monotonic() < deadline, f"/metrics lists {listed}"
        time.sleep(0.5)
    return listed


def cached_by_replica(server: ServerProcess) -> dict[str, float]:
    """``logitproc_cached_prompt_tokens_total`` of each replica that has reported."""
    prefix = 'logitproc_cached_prompt_tokens_total{replica="'
    return {key[len(prefix):-2]: value for key, value in metrics(server).items() if key.startswith(prefix)}


# ---------------------------------------------------------------------------------------------------- the app
def test_every_replica_is_in_the_metrics_before_it_serves(server) -> None:
    # (the module's first test: nothing has been generated yet; a replica reports every 2 s from the moment it is up)
    listed = wait_listed(server, lambda replicas: len(replicas) == 2, timeout=10)
    samples = metrics(server)
    for replica in listed:
        assert samples[f'logitproc_generation_tokens_total{{replica="{replica}"}}'] == 0
        assert samples[f'logitproc_requests_running{{replica="{replica}"}}'] == 0
    # the HTTP responses are the ingress's own (a replica's empty family, its _created included, is not shown)
    assert not any(key.startswith("logitproc_http_responses") and "replica=" in key for key in samples)


def test_health_models_chat_and_the_page(server, client, model_id) -> None:
    assert health(server) == (200, {"status": "ok", "replicas": 2, "replicas_wanted": 2})
    assert len(replica_pids(server)) == 2
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=8)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    page = httpx.get(server.url + "/", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    props = raw(server, "/props").json()
    assert props["model"] == model_id and props["max_model_len"] == 4096


def test_stream_equals_non_stream(server, client, model_id) -> None:
    args = dict(model=model_id, max_tokens=20, temperature=1.0, seed=11)
    whole = client.chat.completions.create(messages=MESSAGES, **args)
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    text = client.completions.create(prompt="Once upon", **args)
    streamed = list(client.completions.create(prompt="Once upon", stream=True, **args))
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    wire = raw(server, "/v1/completions", {"prompt": "Once upon", "stream": True, **args})
    assert wire.headers["content-type"].startswith("text/event-stream")
    assert wire.text.endswith("data: [DONE]\n\n") and wire.text.count("data: [DONE]") == 1


def test_n_choices_seeds_and_a_json_schema(client, model_id) -> None:
    def ask(seed: int) -> list[str]:
        r = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=16, temperature=1.0,
                                           n=3, seed=seed)
        assert [c.index for c in r.choices] == [0, 1, 2]
        return [c.message.content for c in r.choices]

    first = ask(5)
    assert ask(5) == first and len(set(first)) > 1 and ask(6) != first
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_the_same_tokens_as_the_single_process_server(server, model_id) -> None:
    plain = ServerProcess("--model", "tiny", "--max-batch", "8", "--max-queue", "8")
    try:
        for seed in (1, 2, 3):
            body = {"prompt": f"Tell me {seed}", "max_tokens": 24, "temperature": 1.0, "seed": seed,
                    "logprobs": 1}
            ours, theirs = raw(server, "/v1/completions", body).json(), raw(plain, "/v1/completions", body).json()
            assert ours["choices"][0]["logprobs"]["tokens"] == theirs["choices"][0]["logprobs"]["tokens"]
            assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    finally:
        assert plain.stop() == 0


@pytest.mark.parametrize(("path", "body", "status", "param", "says"), BAD_REQUESTS,
                         ids=[f"{i}-{case[3]}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_its_status_and_openai_error_shape(server, path, body, status, param, says) -> None:
    r = raw(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert says in error["message"], error["message"]


def test_api_key_unknown_model_and_route(server, client, model_id) -> None:
    for key in (None, "wrong"):
        r = raw(server, "/v1/models", key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = raw(server, "/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_full_queues_answer_429(server, model_id) -> None:
    # each request fills a replica's batch (n = --max-batch), so the next 8 on a replica wait and any more is refused
    body = {"model": model_id, "prompt": "q", "n": 8, "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(24) as pool:  # 2 replicas x (1 running + 8 waiting) = 18 at most
        answers = list(pool.map(lambda _: raw(server, "/v1/completions", body, timeout=120), range(24)))
    codes = sorted(r.status_code for r in answers)
    assert codes.count(429) >= 6 and set(codes) == {200, 429}, codes
    assert next(r for r in answers if r.status_code == 429).json()["error"]["code"] == "queue_full"
    assert all(r.json()["usage"]["completion_tokens"] == 8 * 300 for r in answers if r.status_code == 200)


# ---------------------------------------------------------------------------------------------------- routing
def test_a_shared_prefix_is_served_from_one_replicas_cache(server, client, model_id) -> None:
    system = {"role": "system", "content": "You are a terse assistant for the shared-prefix test. " * 6}
    before = cached_by_replica(server)
    for i in range(6):
        client.chat.completions.create(model=model_id, max_tokens=4, temperature=0,
                                       messages=[system, {"role": "user", "content": f"question {i}"}])
    after = cached_by_replica(server)
    gained = {replica: after[replica] - before.get(replica, 0.0) for replica in after}
    hits = [replica for replica, tokens in gained.items() if tokens > 0]
    assert len(hits) == 1, gained  # every later request found the system prompt on the same replica
    assert gained[hits[0]] >= 5 * 60  # the 5 later requests each reused at least the system prompt's blocks
    # a different prompt may go to either replica: the load stays balanced (both have served by now)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.completions.create(model=model_id, prompt=f"{i} other", max_tokens=30,
                                                          temperature=0), range(8)))
    assert len(cached_by_replica(server)) == 2


def aborted_everywhere(server: ServerProcess) -> float:
    prefix = 'logitproc_sequences_finished_total{reason="abort",replica="'
    return sum(value for key, value in metrics(server).items() if key.startswith(prefix))


def both_replicas_report(client: openai.OpenAI, model_id: str) -> None:
    """Requests enough at once that both replicas serve some, each then sending its metrics."""
    with ThreadPoolExecutor(12) as pool:
        list(pool.map(lambda i: client.completions.create(model=model_id, prompt=f"{i} report", max_tokens=20,
                                                          temperature=0), range(12)))


def test_a_dropped_stream_is_aborted_on_its_replica(server, client, model_id) -> None:
    both_replicas_report(client, model_id)
    before = aborted_everywhere(server)
    stream = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4000, stream=True,
                                            extra_body={"ignore_eos": True})
    for got, _ in enumerate(stream):
        if got == 5:
            break
    stream.close()
    time.sleep(1.0)
    both_replicas_report(client, model_id)
    assert aborted_everywhere(server) == before + 1


# ---------------------------------------------------------------------------------------------------- faults
def test_a_killed_replica_during_16_streams(server, model_id) -> None:
    wait_healthy(server)
    victims = replica_pids(server)
    assert len(victims) == 2
    before = wait_listed(server, lambda replicas: len(replicas) == 2)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        text = ""
        try:
            stream = await client.completions.create(model=model_id, prompt=f"Story {i}:", max_tokens=300,
                                                     temperature=0.9, seed=i, stream=True,
                                                     extra_body={"ignore_eos": True})
            async for c in stream:
                text += c.choices[0].text if c.choices else ""
            return "complete", text
        except openai.APIError as err:  # the stream's error event, in OpenAI's shape
            return "error", str(err)

    async def run() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        tasks = [asyncio.ensure_future(one(client, i)) for i in range(16)]
        await asyncio.sleep(1.0)
        os.kill(victims[0], signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)  # no stream hangs

    results = asyncio.run(run())
    errors = [message for outcome, message in results if outcome == "error"]
    assert all("the replica serving the request went away" in message for message in errors), "\n".join(errors)
    assert len(errors) < 16
    status, body = health(server)
    assert status == 200 and body["status"] in ("degraded", "ok"), body
    wait_healthy(server)  # Ray started a replica in its place
    deadline = time.monotonic() + 30
    while len(replica_pids(server)) != 2 and time.monotonic() < deadline:  # (its process title comes a bit later)
        time.sleep(0.5)
    assert victims[0] not in replica_pids(server) and len(replica_pids(server)) == 2, replica_pids(server)
    # /metrics: the dead replica dropped (it stopped reporting), its replacement listed before it serves
    after = wait_listed(server, lambda replicas: len(replicas) == 2 and replicas != before)
    assert len(after & before) == 1, (before, after)
    with ThreadPoolExecutor(8) as pool:  # both replicas serve again
        answers = list(pool.map(lambda i: raw(server, "/v1/completions", {"prompt": f"again {i}", "max_tokens": 8}),
                                range(8)))
    assert [r.status_code for r in answers] == [200] * 8
