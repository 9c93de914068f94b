"""Benchmark ``logitproc serve`` against llama.cpp's OpenAI server through the async openai client.

Each server gets the same streamed chat load at concurrency 1, 4 and 16 (``--requests`` requests per level, at most
``concurrency`` in flight; EOS banned with logit_bias so every answer is ``--max-tokens`` long; greedy). Figures per
server and level: generated tokens per second over the level's wall time, time to first token (TTFT) and
inter-token latency (ITL, gaps between streamed chunks) p50 / p99. Tokens are counted as streamed chunks with text
(one token each, but for a character split over tokens); answers with fewer are reported on stderr. Levels run
interleaved (logitproc, llama.cpp, logitproc, ...) for ``--rounds`` rounds; the table holds each figure's median
over the rounds.

    python scripts/bench_serve.py                          # SmolLM2 default GGUF; llama.cpp when it is installed
    python scripts/bench_serve.py --llama-cpp off --max-tokens 64

``--mixed`` measures instead how other arrivals disturb a running stream (issue 31): one greedy stream runs while a
1k-token prompt, then a 4k-token prompt, then ``--schemas`` requests with the largest JSON schemas of
``--schema-dir`` (maskbench-dev) arrive, each once the previous has its first token (the schema requests during the
4k prompt's prefill). It reports the running stream's median and largest gap between tokens while the arrivals come
in, and each arrival's time to first token, for logitproc with its default step budgets and with every prompt
prefilled whole in one step (``--max-num-batched-tokens 0 --max-prefill-tokens-with-decode 0``: the engine before
chunked prefill; ``--chunked-only`` skips that one)::

    python scripts/bench_serve.py --mixed

``--ray`` measures ``logitproc serve --replicas`` on Ray Serve (the ``ray`` extra; issue 35), in two parts.
``--ray-part overhead``: the ingress's overhead, one replica through Ray against the single-process server (both
running; streamed chat at concurrency 1 and 4, as above; ``--rounds`` rounds, the two servers interleaved and the
order alternating): each figure's median and range over the rounds, then Ray against the single-process server round
by round (the ratio of tok/s, the TTFT and ITL added: each round ran both back to back, so the pair shares the
machine's load), and where the CPU went: each server's process tree (the command, and for Ray its GCS, raylet,
controller, HTTP proxy, ingress and replica processes) in CPU milliseconds per generated token, from ``/proc``;
with py-spy installed (it names a process's Python threads) the engine replica's process split by thread into its
engine's (the engine-loop thread and the threads it started: TVM's pool) and the rest, its side of the streams.
``--ray-stream-interval MS [MS ...]`` runs one Ray server per value of that option, all beside the single-process
server in the same rounds (the CPU per token of each, from the same run).
``--ray-part prefix``: a shared-prefix load (``--groups`` system prompts of about ``--prefix-tokens`` tokens, 8
questions each, interleaved, at concurrency 4, answers of 32 tokens) on one engine of ``--threads`` threads (in
process and through Ray), and on ``--threads`` replicas of one thread each with the prefix-affinity router and with
Ray's power-of-two choices, ``--rounds`` rounds each with system prompts of their own: throughput, TTFT, and the
prefix-cache hit rate (cached / prompt tokens, from each answer's ``usage.prompt_tokens_details.cached_tokens``),
median and range. Without ``--ray-part`` both run::

    python scripts/bench_serve.py --ray --threads 2 --ray-part overhead --max-tokens 64 --rounds 7
    python scripts/bench_serve.py --ray --threads 2 --ray-part prefix --rounds 3
    python scripts/bench_serve.py --ray --threads 2 --ray-part overhead --rounds 3 --ray-stream-interval 0 20

llama.cpp runs as ``python -m llama_cpp.server`` (llama-cpp-python[server], the ``bench`` extra:
``pip install -e ".[bench]"``) on the same GGUF with ``--threads`` threads; logitproc with ``TVM_NUM_THREADS`` set to
the same number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import openai

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "Write a haiku about rain.", "How do bees make honey?", "What is a prime number?",
             "Describe a cat in one sentence.", "What is the tallest mountain?"]
#: SmolLM2's end tokens (<|endoftext|>, <|im_end|>): banned so that every answer runs to max_tokens.
EOS_BIAS = {"0": -100, "2": -100}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    """A server child process."""

    name: str
    url: str
    proc: subprocess.Popen
    log: object

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start(name: str, cmd: list[str], env: dict[str, str], timeout: float = 1800) -> Served:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-serve-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited; its log: {log.name}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                print(f"{name}: ready at {url} (log {log.name})", file=sys.stderr)
                return Served(name, url, proc, log)
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{name} did not start; its log: {log.name}")


@dataclass
class Level:
    """One load level's measurements."""

    tokens: int = 0
    seconds: float = 0.0
    short: int = 0  # answers with fewer streamed chunks than max_tokens
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds


async def one_request(client: openai.AsyncOpenAI, model: str, question: str, max_tokens: int, level: Level) -> None:
    started = time.perf_counter()
    last = None
    count = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
        logit_bias=EOS_BIAS, stream=True)
    async for chunk in stream:
        if not chunk.choices or not chunk.choices[0].delta.content:
            continue
        now = time.perf_counter()
        if last is None:
            level.ttft.append(now - started)
        else:
            level.itl.append(now - last)
        last = now
        level.tokens += 1
        count += 1
    level.short += count < max_tokens


async def run_level(url: str, concurrency: int, requests: int, max_tokens: int) -> Level:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    level = Level()
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> None:
        async with gate:
            await one_request(client, model, QUESTIONS[i % len(QUESTIONS)], max_tokens, level)

    started = time.perf_counter()
    await asyncio.gather(*(limited(i) for i in range(requests)))
    level.seconds = time.perf_counter() - started
    await client.close()
    return level


FILLER = ("The keeper climbed the {n} steps of the lighthouse, trimmed the wick, wrote the weather in the log and "
          "watched ship number {n} pass the rocks. ")
STORY = "Tell me a long story about a lighthouse keeper and the ships she watches."


async def long_prompt(url: str, tokens: int) -> str:
    """A user message of about ``tokens`` tokens (filler sentences, counted by the server's /tokenize)."""
    async with httpx.AsyncClient(timeout=60) as http:
        async def count(text: str) -> int:
            reply = await http.post(url + "/tokenize", json={"messages": [{"role": "user", "content": text}]})
            return reply.json()["count"]

        unit = await count(FILLER.format(n=1) * 10) / 10
        sentences = max(int(tokens / unit), 1)
        text = "".join(FILLER.format(n=i) for i in range(sentences)) + "Summarise the log in one sentence."
        while await count(text) > tokens:
            sentences -= 1
            text = "".join(FILLER.format(n=i) for i in range(sentences)) + "Summarise the log in one sentence."
        return text


@dataclass
class Mixed:
    """The running stream's token times and each arrival's time to first token."""

    times: list[float] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)  # from the first arrival to the end of the last one
    ttft: dict[str, float] = field(default_factory=dict)
    events: list[tuple[float, str]] = field(default_factory=list)  # (when, what): each arrival sent, its first token

    def largest(self, count: int = 3) -> list[str]:
        """The ``count`` largest gaps, each with when it ended (from the first arrival) and the last event before
        it."""
        start = self.window[0]
        ends = sorted(zip(self.gaps, self.times[1:], strict=True), reverse=True)[:count]
        out = []
        for gap, end in ends:
            before = [(t, what) for t, what in self.events if t <= end]
            last = f"{before[-1][1]} at {before[-1][0] - start:+.2f} s" if before else "no arrival yet"
            out.append(f"{gap * 1e3:.0f} ms ending at {end - start:+.2f} s (last event: {last})")
        return out

    @property
    def gaps(self) -> list[float]:
        """Every gap between two of the running stream's tokens."""
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

    @property
    def quiet_gaps(self) -> list[float]:
        """The gaps before the first arrival (decode steps alone)."""
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False) if b <= self.window[0]]

    @property
    def busy_gaps(self) -> list[float]:
        """The gaps while the arrivals came in and were prefilled."""
        start, end = self.window
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False) if b > start and a < end]


async def arrival(client: openai.AsyncOpenAI, model: str, name: str, messages: list[dict[str, str]],
                  result: Mixed, **extra: object) -> None:
    started = time.perf_counter()
    result.events.append((started, f"{name} sent"))
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                  stream=True, **extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and name not in result.ttft:
            now = time.perf_counter()
            result.ttft[name] = now - started
            result.events.append((now, f"{name}'s first token"))


async def run_mixed(url: str, schemas: list[tuple[str, dict]]) -> Mixed:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1200)
    model = (await client.models.list()).data[0].id
    prompts = {n: await long_prompt(url, n) for n in (1000, 4000)}
    result = Mixed()
    done = asyncio.Event()

    async def running() -> None:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": STORY}], max_tokens=2000, temperature=0,
            logit_bias=EOS_BIAS, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                result.times.append(time.perf_counter())
            if done.is_set():
                break
        await stream.close()

    async def tokens_seen(n: int) -> None:
        target = len(result.times) + n
        while len(result.times) < target:
            await asyncio.sleep(0.005)

    async def arrivals() -> None:
        await tokens_seen(30)
        start = time.perf_counter()
        await arrival(client, model, "1k-token prompt", [{"role": "user", "content": prompts[1000]}], result)
        await tokens_seen(10)
        long = asyncio.create_task(arrival(client, model, "4k-token prompt",
                                           [{"role": "user", "content": prompts[4000]}], result))
        await tokens_seen(10)
        await asyncio.gather(*(arrival(client, model, name, [
            {"role": "user", "content": "Write a JSON document for this schema."}], result,
            response_format={"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}})
            for name, schema in schemas))
        await long
        result.window = (start, time.perf_counter())
        await tokens_seen(10)
        done.set()

    await asyncio.gather(running(), arrivals())
    await client.close()
    return result


def largest_schemas(directory: str, count: int) -> list[tuple[str, dict]]:
    files = sorted((os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".json")),
                   key=os.path.getsize, reverse=True)[:count]
    schemas = []
    for path in files:
        with open(path) as f:
            schemas.append((f"schema {len(schemas) + 1}", json.load(f)["schema"]))
    print("schemas: " + ", ".join(f"{name} = {os.path.basename(path)} ({os.path.getsize(path) // 1024} KiB)"
                                  for (name, _), path in zip(schemas, files, strict=True)), file=sys.stderr)
    return schemas


def mixed(args: argparse.Namespace) -> int:
    schemas = largest_schemas(args.schema_dir, args.schemas)
    settings = {"chunked (defaults)": [], "whole prompts in one step": ["--max-num-batched-tokens", "0",
                                                                       "--max-prefill-tokens-with-decode", "0"]}
    if args.chunked_only:
        del settings["whole prompts in one step"]
    results: dict[str, Mixed] = {}
    for label, extra in settings.items():
        server = start("logitproc", [sys.executable, "-m", "logitproc", "serve", "--model", args.model,
                                     "--max-batch", str(args.max_batch), *extra], dict(os.environ))
        try:
            results[label] = asyncio.run(run_mixed(server.url, schemas))
        finally:
            server.stop()
        gaps = results[label].gaps
        print(f"{label}: median gap {statistics.median(gaps) * 1e3:.0f} ms, largest {max(gaps) * 1e3:.0f} ms; "
              "largest gaps: " + "; ".join(results[label].largest()), file=sys.stderr)
        time.sleep(args.pause)  # the machine settles between the two servers

    from bench_common import machine_line

    print(f"{machine_line()}; load average {os.getloadavg()[0]:.1f}; greedy; {len(schemas)} schemas from "
          f"{args.schema_dir}\n")
    names = list(next(iter(results.values())).ttft)
    print("| engine | running stream: median gap (ms) | before arrivals / while they arrive (ms) | "
          "largest gap (ms) | largest / median | " + " | ".join(f"TTFT {n} (s)" for n in names) + " |")
    print("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " |")
    for label, result in results.items():
        gaps = result.gaps
        median, largest = statistics.median(gaps), max(gaps)
        print(f"| {label} | {median * 1e3:.0f} | {statistics.median(result.quiet_gaps) * 1e3:.0f} / "
              f"{statistics.median(result.busy_gaps) * 1e3:.0f} | {largest * 1e3:.0f} | {largest / median:.1f}x | "
              + " | ".join(f"{result.ttft.get(n, float('nan')):.1f}" for n in names) + " |")
    return 0


PREFIX_SENTENCE = "Rule {n} of team {g}: answer briefly, cite the handbook section, and stay polite. "


def system_prompt(group: int, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens (about 16 tokens a sentence), different for each group."""
    return f"You are assistant {group}. " + "".join(PREFIX_SENTENCE.format(n=n, g=group)
                                                    for n in range(max(1, tokens // 16)))


@dataclass
class PrefixRun:
    """A shared-prefix run's figures."""

    level: Level
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


async def run_prefix(url: str, groups: int, prefix_tokens: int, concurrency: int = 4,
                     max_tokens: int = 32, first_group: int = 0) -> PrefixRun:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    run = PrefixRun(Level())
    gate = asyncio.Semaphore(concurrency)
    order = [(q, first_group + g) for q in range(8) for g in range(groups)]  # the groups interleaved

    async def one(question: int, group: int) -> None:
        async with gate:
            started, first, count = time.perf_counter(), None, 0
            stream = await client.chat.completions.create(
                model=model, max_tokens=max_tokens, temperature=0, logit_bias=EOS_BIAS, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "system", "content": system_prompt(group, prefix_tokens)},
                          {"role": "user", "content": QUESTIONS[question % len(QUESTIONS)]}])
            async for chunk in stream:
                if chunk.usage is not None:
                    run.prompt_tokens += chunk.usage.prompt_tokens
                    run.cached_tokens += chunk.usage.prompt_tokens_details.cached_tokens
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    count += 1
            run.level.ttft.append((first or time.perf_counter()) - started)
            run.level.tokens += count

    started = time.perf_counter()
    await asyncio.gather(*(one(q, g) for q, g in order))
    run.level.seconds = time.perf_counter() - started
    await client.close()
    return run


#: Process groups of a server's tree, by a piece of their command line (Ray's workers name themselves ray::...).
PROCESS_GROUPS = (("EngineReplica", "engine replica"), ("ServeReplica:logitproc:Ingress", "ingress"),
                  ("ProxyActor", "HTTP proxy"), ("ServeController", "Serve controller"), ("raylet", "raylet"),
                  ("gcs_server", "GCS"))


#: The engine replica's CPU split by thread (``--ray-part overhead`` with py-spy installed): its engine's threads
#: (the engine-loop thread, and the threads it started, TVM's pool, which carry its name) and the rest, its stream side.
ENGINE_THREADS, STREAM_SIDE = "replica: engine threads", "replica: stream side"


def _thread_cpu(pid: int, tick: int) -> dict[int, tuple[str, float]]:
    """Each thread of ``pid``: its name (``comm``) and CPU seconds so far."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        name = raw[raw.index(b"(") + 1:raw.rindex(b")")].decode(errors="replace")
        fields = raw.rsplit(b")", 1)[1].split()
        threads[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return threads


def python_threads(pid: int) -> dict[int, str]:
    """The Python threads of ``pid`` (native id -> Python name) from ``py-spy dump``; empty without py-spy."""
    if shutil.which("py-spy") is None:
        return {}
    dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60).stdout
    return {int(m[1]): m[2] for m in re.finditer(r'Thread (\d+) \(\w+\): "([^"]*)"', dump)}


def replica_threads(root: int) -> dict[int, dict[int, str]]:
    """The Python threads (``python_threads``) of each engine replica process under ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    children.setdefault(int(f.read().rsplit(b")", 1)[1].split()[1]), []).append(int(entry))
            except OSError:
                continue
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"EngineReplica" in f.read():
                    found[pid] = python_threads(pid)
        except OSError:
            continue
    return found


def process_tree_cpu(root: int, named: dict[int, dict[int, str]] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``root`` ("command") and its live descendants, summed by group; an engine
    replica whose Python threads ``named`` holds (``python_threads``) split into its engine's threads and the rest."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[bytes]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if pid not in stats:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        group = "command" if pid == root else next((g for key, g in PROCESS_GROUPS if key in cmdline), "other")
        if group == "engine replica" and "engine-loop" in (named or {}).get(pid, {}).values():
            threads = _thread_cpu(pid, tick)
            engine = next((tid for tid, name in named[pid].items() if name == "engine-loop"), None)
            engine_name = threads.get(engine, ("", 0.0))[0]
            for tid, (name, seconds) in threads.items():
                mine = tid == engine or (tid not in named[pid] and name == engine_name)
                key = ENGINE_THREADS if mine else STREAM_SIDE
                totals[key] = totals.get(key, 0.0) + seconds
            continue
        fields = stats[pid]
        totals[group] = totals.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return totals


def wait_all_replicas(server: Served, timeout: float = 1800) -> None:
    """Until ``/health`` says ok (every replica asked for runs)."""
    deadline = time.monotonic() + timeout
    while httpx.get(server.url + "/health", timeout=30).json().get("status") != "ok":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.name}: not every replica came up")
        time.sleep(1)


def ray_bench(args: argparse.Namespace) -> int:
    if args.ray_part in ("all", "overhead"):
        ray_overhead(args)
    if args.ray_part == "all":
        time.sleep(args.pause)
    if args.ray_part in ("all", "prefix"):
        ray_prefix(args)
    return 0


def _serve_command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "logitproc", "serve", "--model", args.model, "--max-batch", str(args.max_batch)]


def _served(args: argparse.Namespace, name: str, extra: list[str], tvm_threads: str) -> Served:
    server = start(name, [*_serve_command(args), *extra], {**os.environ, "TVM_NUM_THREADS": tvm_threads})
    if extra:
        wait_all_replicas(server)
    return server


def ray_overhead(args: argparse.Namespace) -> None:
    """The ingress's overhead: the single-process server and one replica through Ray, both up, rounds interleaved
    (the order alternating from round to round), at concurrency 1 and 4."""
    threads = str(args.threads)
    overhead: dict[tuple[str, int], list[Level]] = {}
    cpu: dict[tuple[str, int], dict[str, float]] = {}  # CPU seconds by process group, over every round
    tokens: dict[tuple[str, int], int] = {}
    loads: list[float] = []
    servers = []
    try:  # both up at once, levels interleaved: the machine's load drifts less between the two
        ray = ["--replicas", "1", "--replica-threads", threads]
        configurations = [(f"single process, {threads} threads", [])]
        if args.ray_stream_interval is None:  # the server's default
            configurations.append((f"Ray, 1 replica x {threads} threads", ray))
        for ms in args.ray_stream_interval or ():
            configurations.append((f"Ray, 1 replica x {threads} threads, stream interval {ms:g} ms",
                                   [*ray, "--ray-stream-interval", f"{ms:g}"]))
        for name, extra in configurations:
            servers.append(_served(args, name, extra, threads))
        named: dict[str, dict[int, dict[int, str]]] = {}
        for concurrency in (1, 4):
            for server in servers:
                asyncio.run(run_level(server.url, concurrency, concurrency, 8))  # warm-up
                named[server.name] = replica_threads(server.proc.pid)  # (TVM's pool has started by now)
            for round_ in range(args.rounds):
                loads.append(os.getloadavg()[0])
                for server in servers if round_ % 2 == 0 else servers[::-1]:
                    before = process_tree_cpu(server.proc.pid, named[server.name])
                    level = asyncio.run(run_level(server.url, concurrency, args.requests or 4 * concurrency,
                                                  args.max_tokens))
                    spent = cpu.setdefault((server.name, concurrency), {})
                    for group, seconds in process_tree_cpu(server.proc.pid, named[server.name]).items():
                        spent[group] = spent.get(group, 0.0) + seconds - before.get(group, 0.0)
                    tokens[(server.name, concurrency)] = tokens.get((server.name, concurrency), 0) + level.tokens
                    overhead.setdefault((server.name, concurrency), []).append(level)
                    print(f"round {round_ + 1}: {server.name} c={concurrency}: {level.tok_per_s:.1f} tok/s, TTFT p50 "
                          f"{pct(level.ttft, 0.5) * 1e3:.0f} ms", file=sys.stderr)
    finally:
        for server in servers:
            server.stop()
    print_overhead(args, [server.name for server in servers], overhead, cpu, tokens, loads)


def ray_prefix(args: argparse.Namespace) -> None:
    """The shared-prefix load on one engine of ``--threads`` threads (in process, through Ray) and on ``--threads``
    replicas of one thread (prefix affinity, power of two): each configuration's server up in turn, ``--rounds``
    rounds each, every round with system prompts of its own (nothing cached by an earlier round)."""
    threads = str(args.threads)
    prefix: dict[str, list[PrefixRun]] = {}
    loads: list[float] = []
    one_thread = ["--replica-threads", "1"]
    for name, extra, tvm_threads in (
            (f"single process, 1 engine x {threads} threads", [], threads),
            (f"Ray, 1 replica x {threads} threads", ["--replicas", "1", "--replica-threads", threads], threads),
            (f"Ray, {threads} replicas x 1 thread, prefix affinity", ["--replicas", threads, *one_thread], "1"),
            (f"Ray, {threads} replicas x 1 thread, power of two", ["--replicas", threads, *one_thread,
                                                                  "--routing", "pow2"], "1")):
        server = _served(args, name, extra, tvm_threads)
        try:
            # warm-up: the same load with a system prompt of its own (a fresh single-process server's first run of
            # long prompts was several times slower than the next, 2026-11-28)
            asyncio.run(run_prefix(server.url, 1, args.prefix_tokens, first_group=10_000))
            for round_ in range(args.rounds):
                loads.append(os.getloadavg()[0])
                run = asyncio.run(run_prefix(server.url, args.groups, args.prefix_tokens, first_group=round_ * 100))
                prefix.setdefault(name, []).append(run)
                print(f"round {round_ + 1}: {name}: {run.level.tok_per_s:.1f} tok/s, hit rate {run.hit_rate:.2f}",
                      file=sys.stderr)
        finally:
            server.stop()
        time.sleep(args.pause)

    from bench_common import machine_line

    print(f"\n{machine_line()}; load average {min(loads):.1f}-{max(loads):.1f} during the rounds")
    print(f"Shared prefixes: {args.groups} system prompts of about {args.prefix_tokens} tokens, 8 questions each "
          f"(the groups interleaved), concurrency 4, 32-token answers, greedy; {args.rounds} rounds per "
          "configuration, each with system prompts of its own: median [lowest, highest] over the rounds. The hit "
          "rate is cached / prompt tokens (usage.prompt_tokens_details.cached_tokens); one engine's ideal: each "
          "group's first request misses.\n")
    print("| configuration | generated tok/s | TTFT p50 (ms) | TTFT p99 (ms) | prefix-cache hit rate |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in prefix.items():
        print(f"| {name} | {spread([r.level.tok_per_s for r in runs])} | "
              f"{spread([pct(r.level.ttft, 0.5) * 1e3 for r in runs], 0)} | "
              f"{spread([pct(r.level.ttft, 0.99) * 1e3 for r in runs], 0)} | "
              f"{spread([r.hit_rate for r in runs], 2)} |")
    sys.stdout.flush()


def spread(values: list[float], digits: int = 1) -> str:
    """``median [lowest, highest]`` of ``values`` (the median alone for one value)."""
    median = f"{statistics.median(values):.{digits}f}"
    return median if len(values) == 1 else f"{median} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def print_overhead(args: argparse.Namespace, names: list[str], overhead: dict[tuple[str, int], list[Level]],
                   cpu: dict[tuple[str, int], dict[str, float]], tokens: dict[tuple[str, int], int],
                   loads: list[float]) -> None:
    """The ingress-overhead tables: speed per server and level (median and range over the rounds), Ray against the
    single-process server round by round (the rounds' ratios and differences: each round ran both, back to back),
    and the CPU each process group spent per token."""
    from bench_common import machine_line

    print(f"\n{machine_line()}; load average {min(loads):.1f}-{max(loads):.1f} during the rounds; "
          f"{args.max_tokens} tokens per answer, greedy; {args.rounds} rounds, the two servers interleaved: "
          "median [lowest, highest] over the rounds\n")
    print("| server | concurrency | generated tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (name, concurrency), levels in overhead.items():
        print(f"| {name} | {concurrency} | {spread([lv.tok_per_s for lv in levels])} | "
              f"{spread([pct(lv.ttft, 0.5) * 1e3 for lv in levels], 0)} | "
              f"{spread([pct(lv.ttft, 0.99) * 1e3 for lv in levels], 0)} | "
              f"{spread([pct(lv.itl, 0.5) * 1e3 for lv in levels])} | "
              f"{spread([pct(lv.itl, 0.99) * 1e3 for lv in levels])} |")
    plain, *rays = names
    print("\nRay against the single-process server, round by round (aims at concurrency 1: throughput >= 0.90x, "
          "TTFT p50 <= +20 ms)\n")
    print("| server | concurrency | tok/s ratio | TTFT p50 added (ms) | ITL p50 added (ms) | rounds within both aims |")
    print("| --- | --- | --- | --- | --- | --- |")
    for ray in rays:
        for concurrency in sorted({c for _, c in overhead}):
            pairs = list(zip(overhead[(plain, concurrency)], overhead[(ray, concurrency)], strict=True))
            ratios = [r.tok_per_s / p.tok_per_s for p, r in pairs]
            ttft = [(pct(r.ttft, 0.5) - pct(p.ttft, 0.5)) * 1e3 for p, r in pairs]
            itl = [(pct(r.itl, 0.5) - pct(p.itl, 0.5)) * 1e3 for p, r in pairs]
            within = sum(ratio >= 0.9 and added <= 20 for ratio, added in zip(ratios, ttft, strict=True))
            print(f"| {ray} | {concurrency} | {spread(ratios, 2)} | {spread(ttft, 0)} | {spread(itl)} | "
                  f"{within} of {len(pairs)} |")
    groups = ["command", *(g for _, g in PROCESS_GROUPS), ENGINE_THREADS, STREAM_SIDE, "other"]
    print("\nCPU per generated token (ms), every round, by process (command: the `logitproc serve` process itself)\n")
    print("| server | concurrency | total | " + " | ".join(groups) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in groups) + " |")
    for key, spent in cpu.items():
        per_token = {g: seconds * 1e3 / max(tokens[key], 1) for g, seconds in spent.items()}
        print(f"| {key[0]} | {key[1]} | {sum(per_token.values()):.2f} | "
              + " | ".join(f"{per_token[g]:.2f}" if g in per_token else "-" for g in groups) + " |")
    sys.stdout.flush()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="logitproc's --model (default: SmolLM2 default)")
    parser.add_argument("--gguf", default=None, help="the GGUF file for llama.cpp (default: the default model's)")
    parser.add_argument("--llama-cpp", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 x concurrency, "
                                                                "at least 4)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--server-args", default="", help="more options for logitproc serve, e.g. "
                                                          "'--max-prefill-tokens-with-decode 0'")
    parser.add_argument("--mixed", action="store_true", help="the mixed-load run (see the module doc)")
    parser.add_argument("--pause", type=float, default=10.0, help="--mixed: seconds between the two servers")
    parser.add_argument("--schemas", type=int, default=6, help="--mixed: schema requests (default: %(default)s)")
    parser.add_argument("--chunked-only", action="store_true",
                        help="--mixed: the default step budgets only (not the engine with whole prefills)")
    parser.add_argument("--schema-dir", default="/work/shared/data/maskbench-dev",
                        help="--mixed: a folder of maskbench JSON files ({'schema': ...}) (default: %(default)s)")
    parser.add_argument("--ray", action="store_true", help="the Ray Serve runs (see the module doc)")
    parser.add_argument("--groups", type=int, default=4, help="--ray: system prompts (default: %(default)s)")
    parser.add_argument("--prefix-tokens", type=int, default=400,
                        help="--ray: tokens of each system prompt, about (default: %(default)s)")
    parser.add_argument("--ray-stream-interval", type=float, nargs="+", default=None, metavar="MS",
                        help="--ray-part overhead: one Ray server per value of its --ray-stream-interval, all beside "
                             "the single-process server (default: one, with the server's default)")
    parser.add_argument("--ray-part", choices=("all", "overhead", "prefix"), default="all",
                        help="--ray: both parts, the ingress's overhead only, or the shared-prefix load only "
                             "(default: %(default)s)")
    args = parser.parse_args()

    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # the servers' (and the machine line's) thread count
    if args.mixed:
        return mixed(args)
    if args.ray:
        return ray_bench(args)
    env = dict(os.environ)
    servers = [start("logitproc", [sys.executable, "-m", "logitproc", "serve", "--model", args.model,
                                   "--max-batch", str(args.max_batch), *args.server_args.split()], env)]
    try:
        if args.llama_cpp != "off":
            try:
                import llama_cpp.server  # noqa: F401
            except ImportError:
                if args.llama_cpp == "on":
                    raise
                print("llama.cpp: llama-cpp-python[server] is not installed; skipped", file=sys.stderr)
            else:
                gguf = args.gguf
                if gguf is None:
                    from logitproc.compile.model_fetch import fetch_default_model

                    gguf = str(fetch_default_model())
                servers.append(start("llama.cpp", [
                    sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", str(args.threads),
                    "--n_threads_batch", str(args.threads), "--n_ctx", "8192", "--host", "127.0.0.1",
                    "--interrupt_requests", "False"], env))  # queue concurrent requests instead of cutting them
        results: dict[tuple[str, int], list[Level]] = {}
        for concurrency in args.concurrency:
            requests = args.requests or max(4, 2 * concurrency)
            for server in servers:  # warm-up
                asyncio.run(run_level(server.url, concurrency, concurrency, 8))
            for _ in range(args.rounds):
                for server in servers:
                    level = asyncio.run(run_level(server.url, concurrency, requests, args.max_tokens))
                    results.setdefault((server.name, concurrency), []).append(level)
                    print(f"{server.name} c={concurrency}: {level.tok_per_s:.1f} tok/s"
                          + (f", {level.short} answers cut short" if level.short else ""), file=sys.stderr)
    finally:
        for server in servers:
            server.stop()

    from bench_common import machine_line

    print(f"{machine_line()}; load average {os.getloadavg()[0]:.1f}; {args.max_tokens} tokens per answer, "
          f"greedy, {args.rounds} rounds (median)\n")
    print("| server | concurrency | generated tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for (name, concurrency), levels in results.items():
        rate = statistics.median(lv.tok_per_s for lv in levels)
        ttft = [statistics.median(pct(lv.ttft, q) for lv in levels) * 1e3 for q in (0.5, 0.99)]
        itl = [statistics.median(pct(lv.itl, q) for lv in levels) * 1e3 for q in (0.5, 0.99)]
        print(f"| {name} | {concurrency} | {rate:.1f} | {ttft[0]:.0f} / {ttft[1]:.0f} | "
              f"{itl[0]:.1f} / {itl[1]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
