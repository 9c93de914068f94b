"""RayEngineClient: the HTTP app's ``EngineClient`` over engine replicas behind a Ray Serve deployment handle.

It runs in the ingress replica, on the app's event loop. The model's facts come from a replica once
(``ModelFacts``): the ingress tokenizes prompts itself (``prompt_tokens.py``, the engine's own code), so a request
reaches the router as token ids (``ray_router.py`` routes on them). Each HTTP request is one streaming call to a
replica; its deltas go to the app's sink under ids of this client (so that a retry is invisible to the app).

Faults: a replica that dies (or cannot be reached) before anything of the request was delivered is asked again,
once, on whichever replica the router picks; after that, or once tokens were delivered, the request ends with a
503 in OpenAI's error shape (``RequestFailed(status=503)``, or ``EngineUnavailable`` before the ids). ``/health``
is 200 ``ok`` while the replicas asked for run, 200 ``degraded`` while fewer do (some still serve), 503 while
none does (or the model is still loading).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from logitproc.runtime.field_error import FieldValueError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle
from tokenizers import Tokenizer

from .chat_template import ChatTemplate
from .chat_tokens import ChatEncoder
from .engine_client import Sink
from .engine_loop import EngineLoop, EngineUnavailable, QueueFull, RequestFailed
from .prompt_tokens import prompt_token_ids
from .ray_messages import Accepted, EngineRequest, MetricsSnapshot, ModelFacts, Refusal, Rejected
from .ray_metrics import ReplicaMetrics

log = logging.getLogger("logitproc.serve")

#: Tries of a request whose replica went away before anything of it was delivered.
ATTEMPTS = 2


class RemoteModel:
    """The served model as the ingress knows it: name, tokenizer, chat template (no weights)."""

    def __init__(self, facts: ModelFacts) -> None:
        self.name = facts.name
        self.tokenizer = Tokenizer.from_str(facts.tokenizer_json)
        self.vocab_size = facts.vocab_size
        self.chat_template = ChatTemplate(*facts.chat_template)
        self._encoder = ChatEncoder(self.tokenizer, self.chat_template)

    def chat_token_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                       **kwargs: Any) -> list[int]:
        return self._encoder.encode(messages, add_generation_prompt, **kwargs)


class RemoteEngine:
    """The ``ServedEngine`` facts of the replicas' engines, and tokenizing as they would."""

    def __init__(self, facts: ModelFacts) -> None:
        self.model = RemoteModel(facts)
        self.context_length = facts.context_length
        self.max_total_tokens = facts.max_total_tokens
        self.vocab_size = facts.vocab_size
        self.jump_forward = facts.jump_forward
        self.speculative = facts.speculative
        self.max_batch = facts.max_batch

    def tokenize(self, prompt: Any, chat: bool | None = None) -> list[int]:
        return prompt_token_ids(self.model, prompt, chat)


@dataclass
class _Call:
    """One submitted HTTP request: the ids the app knows it by, and its stream while it runs."""

    ids: tuple[str, ...]
    sink: Sink
    future: Future
    names: dict[str, str] = field(default_factory=dict)  # the replica's request id -> ours
    delivered: bool = False
    stream: Any = None  # the DeploymentResponseGenerator of the current try
    task: asyncio.Task | None = None


def _refusal(rejected: Rejected) -> Exception:
    """The exception ``EngineLoop.submit`` raises for the same refusal (the app maps it to its status)."""
    if rejected.reason is Refusal.QUEUE_FULL:
        return QueueFull(rejected.message)
    if rejected.reason is Refusal.UNAVAILABLE:
        return EngineUnavailable(rejected.message)
    if rejected.param is not None:
        return FieldValueError(rejected.param, rejected.message)
    return ValueError(rejected.message)


class RayEngineClient:
    """``EngineClient`` over the ``replicas`` handle (a deployment of ``EngineReplica``) of ``app_name``;
    ``wanted``: how many replicas ``/health`` expects; ``on_ready`` gets the model's facts once known."""

    def __init__(self, replicas: DeploymentHandle, app_name: str, deployment: str, wanted: int,
                 metrics: ReplicaMetrics, on_ready: Callable[[ModelFacts], None]) -> None:
        # Ray Serve's gRPC transport for the calls to the replicas, not its actor calls (each streamed item of which
        # goes through a thread pool and the object store's bookkeeping in both processes). Said here: the handle was
        # made by the `logitproc serve` command, whose environment does not set RAY_SERVE_USE_GRPC_BY_DEFAULT (the
        # replicas' does, ray_app.SERVE_ENV), and a handle keeps the transport of the process that made it.
        self._handle = replicas.options(_by_reference=False)
        self._app_name, self._deployment, self._wanted = app_name, deployment, wanted
        self._metrics = metrics
        self._on_ready = on_ready
        self.state = EngineLoop.LOADING
        self.error: str | None = None
        self._engine: RemoteEngine | None = None
        self._calls: dict[str, _Call] = {}
        self._counter = itertools.count()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Task | None = None

    @property
    def engine(self) -> RemoteEngine:
        if self._engine is None:
            raise EngineUnavailable(f"the model is {self.state}")
        return self._engine

    # ---------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self._connecting = self._aloop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            facts: ModelFacts = await self._handle.facts.remote()
        except Exception as err:  # no replica could load the model
            self.state, self.error = EngineLoop.FAILED, f"{type(err).__name__}: {str(err)[:500]}"
            log.error("the replicas did not answer: %s", self.error)
            return
        self._engine = RemoteEngine(facts)
        self._on_ready(facts)
        self.state = EngineLoop.READY

    def stop(self) -> None:
        self.state = EngineLoop.STOPPED
        if self._aloop is not None and not self._aloop.is_closed():
            self._aloop.call_soon_threadsafe(self._cancel_all)

    def _cancel_all(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        for call in list(self._calls.values()):
            self._cancel(call)

    # ---------------------------------------------------------------------------------------------- health
    def running_replicas(self) -> int:
        """Replicas of the engine deployment that Ray Serve reports RUNNING (blocking: a call to the controller)."""
        app = serve.status().applications.get(self._app_name)
        if app is None or self._deployment not in app.deployments:
            return 0
        return int(app.deployments[self._deployment].replica_states.get("RUNNING", 0))

    async def health(self) -> tuple[int, dict[str, Any]]:
        if self.state != EngineLoop.READY:
            return 503, {"status": self.state, "error": self.error}
        running = await asyncio.to_thread(self.running_replicas)
        body = {"replicas": running, "replicas_wanted": self._wanted}
        if running == 0:
            return 503, {"status": "unavailable", **body}
        return 200, {"status": "ok" if running >= self._wanted else "degraded", **body}

    # ---------------------------------------------------------------------------------------------- requests
    def submit(self, prompts: Sequence[Any], config: Any, chat: bool, sink: Sink,
               jump_forward: bool | None = None) -> Future:
        future: Future = Future()
        if self.state != EngineLoop.READY:
            future.set_exception(EngineUnavailable(f"the model is {self.state}"))
            return future
        number = next(self._counter)
        call = _Call(tuple(f"ray-{number}-{i}" for i in range(len(prompts))), sink, future)
        request = EngineRequest(tuple(tuple(int(t) for t in p) for p in prompts), config, chat, jump_forward)
        for rid in call.ids:
            self._calls[rid] = call
        call.task = asyncio.get_running_loop().create_task(self._run(call, request))
        return future

    def abort(self, request_ids: Sequence[str]) -> None:
        calls = {id(call): call for rid in request_ids if (call := self._calls.get(rid)) is not None}
        if not calls:
            return
        if self._aloop is not None:
            for call in calls.values():
                self._aloop.call_soon_threadsafe(self._cancel, call)

    def _cancel(self, call: _Call) -> None:
        if call.stream is not None:
            call.stream.cancel()  # the replica's generator is cancelled: it aborts its engine requests
        if call.task is not None:
            call.task.cancel()

    async def _run(self, call: _Call, request: EngineRequest) -> None:
        try:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    await self._try(call, request)
                    return
                except RayActorError as err:  # the replica died, or cannot be reached
                    reason = f"the replica serving the request went away ({type(err).__name__})"
                    if call.delivered or attempt == ATTEMPTS:
                        self._fail(call, reason)
                        return
                    log.warning("%s before anything was streamed: trying again", reason)
        except (asyncio.CancelledError, RequestCancelledError):
            # aborted, or Ray Serve cancelled the HTTP request's call (its client left), and this call with it
            if call.stream is not None:
                call.stream.cancel()
            if not call.future.done():
                call.future.cancel()
        except Exception as err:  # not the client's fault, nor a replica's death: a bug, reported as a 500
            log.exception("a replica call failed")
            message = f"internal error: {type(err).__name__}: {str(err)[:500]}"
            if not call.future.done():
                call.future.set_exception(RuntimeError(message))
            else:
                for rid in call.ids:
                    call.sink(RequestFailed(rid, message))
        finally:
            for rid in call.ids:
                self._calls.pop(rid, None)

    async def _try(self, call: _Call, request: EngineRequest) -> None:
        call.stream = self._handle.options(stream=True).generate.remote(request)
        async for item in call.stream:
            if isinstance(item, Accepted):
                call.names = dict(zip(item.request_ids, call.ids, strict=True))
                if not call.future.done():
                    call.future.set_result(list(call.ids))
            elif isinstance(item, Rejected):
                if not call.future.done():
                    call.future.set_exception(_refusal(item))
                else:  # a second try refused (its queue was full): the request ends with that status
                    for rid in call.ids:
                        call.sink(RequestFailed(rid, item.message, item.reason.value))
                return
            elif isinstance(item, MetricsSnapshot):
                self._metrics.update(item)
            else:  # a list of the engine's Deltas (or a RequestFailed)
                call.delivered = True
                for delta in item:
                    call.sink(replace(delta, request_id=call.names[delta.request_id]))

    def _fail(self, call: _Call, reason: str) -> None:
        log.warning("%s: the request ends with a 503", reason)
        if not call.future.done():
            call.future.set_exception(EngineUnavailable(reason))
            return
        for rid in call.ids:
            call.sink(RequestFailed(rid, reason, 503))
