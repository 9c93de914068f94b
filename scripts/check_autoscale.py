"""Watch ``logitproc serve --autoscale`` scale up under load and back down when idle (issue 35; the ``ray`` extra).

Starts ``logitproc serve --model MODEL --autoscale 1:2 --target-ongoing-requests 2 --autoscale-delays UP:DOWN`` on
a free loopback port, sends ``--streams`` long streams at once until ``/health`` counts 2 replicas running (and
``--hold`` seconds more), stops them, then waits until it counts 1 again. Once a second it records the replicas
``/health`` counts and the replicas ``/metrics`` lists (``logitproc_kv_cache_capacity_tokens{replica=...}``);
it prints the timeline of changes and exits 0 when both scalings were seen (and ``/metrics`` followed each), 1
otherwise::

    python scripts/check_autoscale.py                       # the tiny model, delays 5:30 s
    python scripts/check_autoscale.py --delays 30:600       # Ray Serve's own delays (over ten minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def observe(url: str) -> tuple[int, int]:
    """(replicas ``/health`` counts running, replicas ``/metrics`` lists); -1 where the server did not answer."""
    try:
        running = httpx.get(url + "/health", timeout=10).json().get("replicas", -1)
        text = httpx.get(url + "/metrics", timeout=10).text
    except (httpx.HTTPError, ValueError):
        return -1, -1
    listed = {s.labels["replica"] for family in text_string_to_metric_families(text)
              if family.name == "logitproc_kv_cache_capacity_tokens" for s in family.samples}
    return running, len(listed)


class Timeline:
    """What ``observe`` saw, once a second, on a thread of its own; the changes with their times."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.start = time.monotonic()
        self.changes: list[tuple[float, str, tuple[int, int]]] = []
        self.marks: list[tuple[float, str]] = []
        self.state = (-1, -1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            seen = observe(self.url)
            if seen != self.state:
                self.changes.append((time.monotonic() - self.start, "", seen))
                self.state = seen

    def mark(self, what: str) -> None:
        self.marks.append((time.monotonic() - self.start, what))
        print(f"{time.monotonic() - self.start:6.1f} s  {what}", file=sys.stderr)

    def wait_for(self, running: int, timeout: float) -> float | None:
        """Seconds since the start when ``/health`` first counted ``running`` from now on, or None after timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state[0] == running:
                return time.monotonic() - self.start
            time.sleep(0.5)
        return None

    def wait_listed(self, listed: int, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state[1] == listed:
                return time.monotonic() - self.start
            time.sleep(0.5)
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def load(url: str, streams: int, stop: asyncio.Event) -> int:
    """``streams`` long streams at once, each started again when it ends, until ``stop``; the tokens streamed."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        while not stop.is_set():
            stream = await client.completions.create(model=model, prompt=f"Story {i}:", max_tokens=400,
                                                     temperature=0.9, seed=i, stream=True,
                                                     extra_body={"ignore_eos": True})
            async for _ in stream:
                tokens += 1
                if stop.is_set():
                    break
            await stream.close()

    await asyncio.gather(*(one(i) for i in range(streams)))
    await client.close()
    return tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--delays", default="5:30", help="--autoscale-delays UP:DOWN (default: %(default)s)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams (default: %(default)s)")
    parser.add_argument("--hold", type=float, default=10.0,
                        help="seconds of load after the second replica runs (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=900.0, help="for each scaling (default: %(default)s s)")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="check-autoscale-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "logitproc", "serve", "--model", args.model, "--port", str(port), "--autoscale",
           "1:2", "--target-ongoing-requests", "2", "--autoscale-delays", args.delays, "--max-batch", "8"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    print(f"{' '.join(cmd[1:])}\n(log {log.name})", file=sys.stderr)
    try:
        deadline = time.monotonic() + args.timeout
        while observe(url)[0] < 1:
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"the server did not come up; its log: {log.name}", file=sys.stderr)
                return 1
            time.sleep(1.0)
        timeline = Timeline(url)
        timeline.mark("up: 1 replica")

        async def loaded() -> tuple[float | None, int]:
            stop = asyncio.Event()
            task = asyncio.create_task(load(url, args.streams, stop))
            timeline.mark(f"load: {args.streams} streams")
            up = await asyncio.to_thread(timeline.wait_for, 2, args.timeout)
            if up is not None:
                timeline.mark("2 replicas running")
                await asyncio.to_thread(timeline.wait_listed, 2, 60)
                timeline.mark("/metrics lists 2")
                await asyncio.sleep(args.hold)
            stop.set()
            tokens = await task
            timeline.mark(f"load stopped ({tokens} tokens streamed)")
            return up, tokens

        up, _ = asyncio.run(loaded())
        idle = time.monotonic() - timeline.start
        down = timeline.wait_for(1, args.timeout) if up is not None else None
        if down is not None:
            timeline.mark("1 replica running")
            timeline.wait_listed(1, 60)
            timeline.mark("/metrics lists 1")
        timeline.stop()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()

    print(f"\n{args.model}, --autoscale 1:2 --target-ongoing-requests 2 --autoscale-delays {args.delays}, "
          f"{args.streams} streams; load average {os.getloadavg()[0]:.1f}\n")
    print("| time (s) | replicas running (/health) | replicas in /metrics |")
    print("| --- | --- | --- |")
    for at, _, (running, listed) in timeline.changes:
        print(f"| {at:.1f} | {running} | {listed} |")
    print()
    for at, what in timeline.marks:
        print(f"- {at:.1f} s: {what}")
    if up is None or down is None:
        print(f"\nnot seen: {'scaling up' if up is None else 'scaling down'}; the log: {log.name}")
        return 1
    print(f"\nscaled up {up - timeline.marks[1][0]:.1f} s after the load began; down {down - idle:.1f} s after it "
          "stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
