"""EngineReplica: the Ray Serve deployment that owns one Engine (its own model load, KV cache and CPU threads).

Each replica runs an ``EngineLoop`` (the single-process server's engine thread) and answers the ingress's calls:
``facts()`` (what the ingress needs to tokenize and describe the model), and ``generate()``, a stream of
``Accepted`` / ``Rejected``, the engine's deltas, then a ``MetricsSnapshot`` (``ray_messages.py``). A stream that
the caller cancels (its client left) aborts its engine requests. From the moment its model has loaded, a replica
also sends its ``MetricsSnapshot`` to the ingress deployment every ``REPORT_PERIOD_S`` seconds (its ``report``
method), and ``ReplicaLeft`` when Ray stops it (``ray_metrics.py``). ``check_health`` (called by Ray Serve) fails
once the engine has stopped, so Ray replaces the replica; a killed replica process is replaced by Ray as well.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from logitproc.runtime.field_error import FieldError
from prometheus_client import generate_latest
from ray import serve

from .engine_loop import EngineLoop, EngineUnavailable, QueueFull, RequestFailed
from .ray_logging import log_to_stderr
from .ray_messages import Accepted, EngineRequest, MetricsSnapshot, ModelFacts, Refusal, Rejected, ReplicaLeft
from .ray_metrics import REPORT_PERIOD_S
from .ray_stream import StreamCoalescer
from .server_metrics import ServerMetrics

log = logging.getLogger("logitproc.serve")

#: How often the constructor looks whether the model has loaded (seconds).
LOAD_POLL_SECONDS = 0.1
#: How long a report to the ingress may take before the next one is due instead (seconds), and the report that
#: this replica leaves (at shutdown, when the ingress may be going too).
REPORT_TIMEOUT_S = 10.0
LEFT_TIMEOUT_S = 1.0


class EngineReplica:
    """One engine behind Ray Serve. ``args`` are ``logitproc serve``'s options (the model, the engine's limits);
    ``threads`` sizes TVM's CPU pool (Ray reserves as many CPUs for the replica); ``ingress``: the deployment (of
    the same application) whose ``report`` method takes this replica's metrics; ``stream_interval_s``: a request's
    stream sends its deltas at most this often (``ray_stream.py``)."""

    async def __init__(self, args: argparse.Namespace, threads: int, ingress: str, stream_interval_s: float) -> None:
        from .server_cli import load_engine

        log_to_stderr()
        self.loop: EngineLoop | None = None
        self._reporting: asyncio.Task | None = None
        os.environ["TVM_NUM_THREADS"] = str(threads)  # read when the model's first parallel kernel runs
        self._args = args
        self._stream_interval = stream_interval_s
        context = serve.get_replica_context()
        self._replica = context.replica_id.unique_id
        self._ingress = serve.get_deployment_handle(ingress, context.app_name)
        self.metrics = ServerMetrics()
        loop = EngineLoop(lambda: load_engine(args), self.metrics, args.max_queue)
        loop.start()
        while loop.state == EngineLoop.LOADING:
            await asyncio.sleep(LOAD_POLL_SECONDS)
        if loop.state != EngineLoop.READY:
            raise RuntimeError(f"the model did not load: {loop.error}")
        self.loop = loop
        self._reporting = asyncio.get_running_loop().create_task(self._report_periodically())

    async def _report_periodically(self) -> None:
        """Send this replica's metrics to the ingress now, then every ``REPORT_PERIOD_S`` seconds."""
        while True:
            await self._report(MetricsSnapshot(self._replica, generate_latest(self.metrics.registry)))
            await asyncio.sleep(REPORT_PERIOD_S)

    async def _report(self, message: MetricsSnapshot | ReplicaLeft, timeout: float = REPORT_TIMEOUT_S) -> None:
        try:
            await asyncio.wait_for(self._ingress.report.remote(message), timeout)
        except Exception as err:  # the ingress is not up yet, or is being replaced: the next report goes again
            log.debug("metrics report to the ingress failed: %s: %s", type(err).__name__, err)

    def facts(self) -> ModelFacts:
        """The model's facts for the ingress."""
        from .server_cli import request_defaults

        engine = self.loop.engine
        template = engine.model.chat_template
        defaults, described = request_defaults(self._args, engine)
        return ModelFacts(
            name=engine.model.name, tokenizer_json=engine.model.tokenizer.to_str(),
            chat_template=(template.source, template.bos_token, template.eos_token, template.origin),
            vocab_size=engine.vocab_size, context_length=engine.context_length,
            max_total_tokens=engine.max_total_tokens,
            jump_forward=bool(engine.jump_forward), speculative=engine.speculative, sampling_defaults=defaults,
            defaults_described=described, max_batch=engine.max_batch)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        """The request's stream: ``Accepted`` or ``Rejected``, then lists of deltas (or a ``RequestFailed``), each
        list what arrived since the last (at most every stream interval; the end of a sequence at once), until each
        of its sequences has finished, then this replica's ``MetricsSnapshot``."""
        stream = StreamCoalescer(asyncio.get_running_loop(), self._stream_interval)
        submitted = self.loop.submit([list(p) for p in request.prompts], request.config, request.chat, stream.put,
                                     request.jump_forward)
        try:
            ids = await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:
            submitted.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() is not None else self.loop.abort(f.result()))
            raise
        except QueueFull as err:
            yield Rejected(Refusal.QUEUE_FULL, str(err))
            return
        except EngineUnavailable as err:
            yield Rejected(Refusal.UNAVAILABLE, str(err))
            return
        except (ValueError, TypeError) as err:
            param = err.param if isinstance(err, FieldError) else None
            yield Rejected(Refusal.INVALID, " ".join(str(err).split()), param)
            return
        yield Accepted(tuple(ids))
        left = len(ids) * request.config.n
        try:
            while left:
                batch = await stream.get()  # what came since the last, at most every stream interval
                yield batch
                if any(isinstance(item, RequestFailed) for item in batch):
                    break
                left -= sum(item.finish_reason is not None for item in batch)
        finally:
            if left:  # cancelled (the client left), or failed: free the engine's slots now
                self.loop.abort(ids)
        yield await self._snapshot()

    async def _snapshot(self) -> MetricsSnapshot:
        """The metrics, read on the engine's thread between steps (after the finished request was counted)."""
        text = await asyncio.wrap_future(self.loop.call(lambda engine: generate_latest(self.metrics.registry)))
        return MetricsSnapshot(self._replica, text)

    def check_health(self) -> None:
        """Ray Serve's health check: an engine that is not READY (stopped, failed) gets the replica replaced."""
        if self.loop.state != EngineLoop.READY:
            raise RuntimeError(f"the engine is {self.loop.state}: {self.loop.error}")

    async def __del__(self) -> None:
        """Ray Serve's graceful shutdown (after the running requests drained): the ingress drops this replica's
        metrics, and the engine stops."""
        if self._reporting is not None:
            self._reporting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reporting
            await self._report(ReplicaLeft(self._replica), LEFT_TIMEOUT_S)
        if self.loop is not None and self.loop.state == EngineLoop.READY:
            self.loop.stop(timeout=5.0)
