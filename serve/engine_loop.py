"""EngineLoop: the server's thread that loads the Engine and drives it; the app reaches it only through the engine's
one command queue.

The thread loads the model (``load()``), then drives the engine for its whole life (``Engine.driving``: one owner
of the engine's command queue, the ``CoreLoop``; no queue of its own): it runs the queued commands (add requests,
abort, any call on the engine, the server's own bookkeeping), and ``engine.step()`` while anything is runnable,
handing each delta to its request's sink (a callable, e.g. one that moves it onto an asyncio queue with
``call_soon_threadsafe``); with nothing to step it waits for a command. Commands run between steps, so requests join
and leave the running batch there. A request's grammar compiles on the engine's grammar thread (``Engine.submit``)
while the steps go on; the compile's end is a command too, and the request is answered (its ids) once it compiled.
The server's bookkeeping (which request's deltas go to which sink, the metrics, the queue limit) is state of the
driving thread like the engine's: only commands and the loop touch it. A request refused by the engine (its
ValueError / TypeError, a grammar that cannot compile included) is refused to its caller only; a step that raises
ends the requests then running with a ``RequestFailed`` item, and the loop goes on; so does a request that the
engine forgot without its final delta (never expected), so none waits forever. Before the engine has loaded, and
once it stopped, a call is answered at once with ``EngineUnavailable``.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from .outputs import Delta, FinishReason
from .server_metrics import ServerMetrics

if TYPE_CHECKING:
    from .engine import PendingRequest

log = logging.getLogger("logitproc.serve")

Sink = Callable[[Any], None]


class LoopState(StrEnum):
    """Where an EngineLoop stands (str-valued: ``/health`` reports it as it is)."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests already."""


class EngineUnavailable(Exception):
    """The engine is loading, failed to load, or has stopped."""


@dataclass
class RequestFailed:
    """Put in a sink when the engine failed while the request ran; the request is over. ``status`` is the HTTP
    status it ends with: 500 (the engine failed), 503 (the replica serving it went away: ``ray_client.py``)."""

    request_id: str
    message: str
    status: int = 500


@dataclass
class _Live:
    """Server-side bookkeeping of one engine request."""

    sink: Sink
    n: int
    arrival: float
    grammar: bool
    started: bool = False
    finished: int = 0
    last_token: dict[int, float] = field(default_factory=dict)


class EngineLoop:
    """Loads the engine on its own thread and drives it; ``submit``/``abort``/``call`` are safe from any thread."""

    LOADING, READY, FAILED, STOPPED = LoopState.LOADING, LoopState.READY, LoopState.FAILED, LoopState.STOPPED

    def __init__(self, load: Callable[[], Any], metrics: ServerMetrics, max_queue: int = 256,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self._load = load
        self.metrics = metrics
        self.max_queue = max_queue
        self._on_failure = on_failure
        self.engine: Any = None
        self.state: LoopState = LoopState.LOADING
        self.error: str | None = None
        self._stopping = threading.Event()
        self._settled = threading.Event()  # the load ended: READY or FAILED
        self._live: dict[str, _Live] = {}
        self._last_engine_stats: tuple[int, ...] = (0, 0, 0, 0, 0)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -------------------------------------------------------------------------------------------- any thread
    def start(self) -> None:
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> LoopState:
        """Wait until the model has loaded or failed to (at most ``timeout`` seconds); the state then."""
        self._settled.wait(timeout)
        return self.state

    async def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``: 200 ``{"status": "ok"}`` once loaded, else 503 with the state and the load's error."""
        if self.state == self.READY:
            return 200, {"status": "ok"}
        return 503, {"status": self.state, "error": self.error}

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop stepping and join the thread (one still loading stops once loaded)."""
        self._stopping.set()
        self._post(lambda: None)  # the loop wakes, sees it and stops
        self._thread.join(timeout)

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run ``fn(engine)`` on the loop thread between steps; its result or exception in the Future."""
        future: Future = Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            if self.state != self.READY:
                future.set_exception(EngineUnavailable(f"the engine is {self.state}"))
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as err:  # handed to the caller, who decides what it means
                future.set_exception(err)

        self._post(command)
        return future

    def _post(self, command: Callable[[], None]) -> None:
        """Queue ``command`` on the engine's command queue (it runs on the loop thread between steps); before the
        engine exists (loading, or it failed to load), run it now: it answers ``EngineUnavailable``."""
        engine = self.engine
        if engine is None:
            command()
        else:
            engine.post(command)

    def submit(self, prompts: Sequence[Any], config: Any, chat: bool, sink: Sink,
               jump_forward: bool | None = None) -> Future:
        """Add one engine request per prompt (all or none), all delivering into ``sink``; the Future holds their
        ids once their grammars are compiled, or QueueFull, or the engine's ValueError / TypeError for a bad
        request (a grammar that cannot compile included). Grammars compile off the loop thread
        (``Engine.submit``): the running requests go on stepping meanwhile."""
        result: Future = Future()

        def add(engine: Any) -> None:
            waiting = sum(1 for live in self._live.values() if not live.started)
            if waiting + len(prompts) > self.max_queue:
                raise QueueFull(f"the waiting queue is full ({waiting} of {self.max_queue} requests)")
            pending: list[PendingRequest] = []
            try:
                for prompt in prompts:
                    pending.append(engine.submit(prompt, config, chat=chat, jump_forward=jump_forward))
            except BaseException:
                for p in pending:
                    engine.abort(p.request_id)
                raise
            now = time.perf_counter()
            for p in pending:
                self._live[p.request_id] = _Live(sink, config.n, now, config.response_format is not None)
                if config.response_format is not None:
                    self.metrics.grammar_requests.inc()
            self._update_gauges()
            left = [len(pending)]

            def compiled(_: Future) -> None:
                # a request's ready is settled by a command of the core (EngineCore.compiled), or at once: on the
                # thread driving the engine, as this is
                left[0] -= 1
                if left[0] == 0:
                    self._settle(pending, result)

            for p in pending:
                p.ready.add_done_callback(compiled)

        def refused(future: Future) -> None:
            if future.exception() is not None:
                result.set_exception(future.exception())

        self.call(add).add_done_callback(refused)
        return result

    def _settle(self, pending: list[PendingRequest], result: Future) -> None:
        """On the loop thread, once every request of a submit has compiled (or failed to): its ids, or the first
        error, the others then aborted and the failed ones forgotten (they never ran)."""
        errors = [p.ready.exception() for p in pending if p.ready.exception() is not None]
        if not errors:
            result.set_result([p.request_id for p in pending])
            return
        for p in pending:
            if p.ready.exception() is not None:
                self._live.pop(p.request_id, None)
            elif self.engine is not None:
                self.engine.abort(p.request_id)
        self._update_gauges()
        result.set_exception(errors[0])

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (finished ones are ignored); they leave the batch at the next step."""
        def abort(engine: Any) -> None:
            for rid in request_ids:
                if rid in self._live:
                    engine.abort(rid)

        self.call(abort)

    # -------------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            engine = self._load()
        except BaseException as err:  # a model that cannot load: the server reports it and exits
            self.state, self.error = self.FAILED, f"{type(err).__name__}: {err}"
            self._settled.set()
            log.error("loading the model failed: %s", self.error)
            if self._on_failure is not None:
                self._on_failure(err)
            return
        self.metrics.kv_capacity.set(getattr(engine, "max_total_tokens", 0))
        with engine.driving():  # from here on, every command queued for the engine runs on this thread
            self.engine = engine
            self.state = self.READY
            self._settled.set()
            while not self._stopping.is_set():  # (a grammar compiled, or stop(), is a command: it wakes the wait)
                engine.run_commands(wait=not engine.has_runnable())
                if engine.has_runnable() and not self._stopping.is_set():
                    self._step()
            self._shutdown()
        # the commands left ran as the drive was given up, answered EngineUnavailable (STOPPED)

    def _shutdown(self) -> None:
        for rid in list(self._live):
            self.engine.abort(rid)
        while self.engine.has_unfinished():
            self._step()
        self.state = self.STOPPED

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as err:  # not one request's fault that we can tell: end the running ones, go on
            log.error("engine step failed:\n%s", traceback.format_exc())
            for rid, live in list(self._live.items()):
                self.engine.abort(rid)
                live.sink(RequestFailed(rid, f"the engine failed: {type(err).__name__}: {err}"))
                del self._live[rid]
            self._update_gauges()
            return
        now = time.perf_counter()
        for delta in deltas:
            self._deliver(delta, now)
        self._end_unreported()
        self._account_engine()
        self._update_gauges()

    def _deliver(self, delta: Delta, now: float) -> None:
        live = self._live.get(delta.request_id)
        if live is None:
            return
        m = self.metrics
        if not live.started:
            live.started = True
            if delta.output is None or delta.token_ids:
                m.ttft.observe(now - live.arrival)
        if delta.token_ids:
            m.generation_tokens.inc(len(delta.token_ids))
            previous = live.last_token.get(delta.index)
            if previous is not None:
                m.itl.observe((now - previous) / len(delta.token_ids))
            live.last_token[delta.index] = now
        live.sink(delta)
        if delta.finish_reason is not None:
            m.finished.labels(delta.finish_reason).inc()
            if live.grammar and delta.finish_reason in (FinishReason.GRAMMAR_DEAD_END, FinishReason.ERROR):
                m.grammar_failures.inc()
            live.finished += 1
            if live.finished == live.n:
                if delta.output is not None:
                    m.prompt_tokens.inc(delta.output.stats.prompt_tokens)
                    m.cached_prompt_tokens.inc(delta.output.stats.cached_tokens)
                del self._live[delta.request_id]

    def _end_unreported(self) -> None:
        """A request the engine has forgotten without handing over all its final deltas (never expected: a sequence
        always ends with one) still ends for its client, with a RequestFailed, rather than waiting forever."""
        for rid, live in list(self._live.items()):
            if live.started and self.engine.is_done(rid):  # (one not started yet has had no step)
                log.error("request %s ended without its final answer", rid)
                live.sink(RequestFailed(rid, "the request ended without its final answer"))
                del self._live[rid]

    def _account_engine(self) -> None:
        stats, m = self.engine.stats, self.metrics
        now = (stats.preemptions, stats.jump_forward_tokens, stats.drafts, stats.draft_tokens,
               stats.accepted_draft_tokens)
        counters = (m.preemptions, m.jump_forward_tokens, m.spec_drafts, m.spec_draft_tokens, m.spec_accepted_tokens)
        for counter, value, last in zip(counters, now, self._last_engine_stats, strict=True):
            counter.inc(max(value - last, 0))
        self._last_engine_stats = now

    def _update_gauges(self) -> None:
        m = self.metrics
        started = sum(1 for live in self._live.values() if live.started)
        m.waiting.set(len(self._live) - started)
        m.running.set(started)
        m.batch.set(self.engine.num_running)
        m.kv_tokens.set(self.engine.kv_tokens)
        m.prefix_cache_tokens.set(self.engine.prefix_cache_tokens)
