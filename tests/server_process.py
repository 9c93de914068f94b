"""A ``logitproc serve`` child process on a free loopback port for tests, readers of its /metrics, and the signal
setting of every child a test sends Ctrl-C to."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sigint_at_default() -> None:
    """``preexec_fn`` of a child a test sends Ctrl-C (SIGINT) to: SIGINT at its default in the child, whatever this
    run's is. A run started with SIGINT ignored (``nohup pytest ... &``, as CI runners may start it) would pass the
    ignoring on: an ignored signal stays ignored through ``exec``, and the child's Python then never raises
    ``KeyboardInterrupt`` (a handler, as pytest's, is reset by ``exec`` instead)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_folder_path(name: str) -> str:
    """``name`` in the run's private folder (``$LOGITPROC_TEST_RUN_FOLDER``: kept when a test fails, never the build
    cache, which ``$LOGITPROC_TEST_CACHE`` may keep between runs)."""
    return os.path.join(os.environ["LOGITPROC_TEST_RUN_FOLDER"], name)


class ServerProcess:
    """A ``logitproc serve`` child process and its URL; its output in ``log_path`` (in the run's folder)."""

    def __init__(self, *args: str, api_key: str | None = KEY, timeout: float = 900) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "logitproc", "serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = run_folder_path(f"serve-{self.port}.log")
        self.log = open(self.log_path, "w")  # noqa: SIM115 (the child's, closed by stop)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                     preexec_fn=sigint_at_default)
        self.health_seen: list[tuple[int, dict]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited early:\n{self.output()}"
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                self.health_seen.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return
            except (httpx.TransportError, json.JSONDecodeError):  # (Ray's proxy answers text before the app runs)
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server did not become ready:\n{self.output()}")

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


def metrics(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. ``logitproc_sequences_finished_total{reason="abort"}``."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_idle(server: ServerProcess, timeout: float = 10) -> dict[str, float]:
    """/metrics once no sequence runs and the KV cache is empty (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["logitproc_batch_sequences"] == 0 and m["logitproc_kv_cache_tokens"] == 0:
            return m
        assert time.monotonic() < deadline, f"still busy: {m['logitproc_batch_sequences']} sequences"
        time.sleep(0.05)


def aborted(m: dict[str, float]) -> float:
    return m.get('logitproc_sequences_finished_total{reason="abort"}', 0.0)
