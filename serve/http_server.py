"""The OpenAI-compatible HTTP app (FastAPI): routes, API key, errors in OpenAI's shape, streaming, disconnects.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /health`` (503 while the
model loads), ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``GET /props`` (the model, its defaults and
the server's features, for the page), and the chat page: ``GET /``, its ``/static/`` files and ``/favicon.ico``.
Every request passes the request policy first (``request_policy.py``: Host, Origin, JSON-only POSTs); bodies are read
by one parser within the model's limits (``request_body.py``, ``request_limits.py``). Handlers never touch the
engine's state: they tokenize on a worker thread, submit to the ``EngineLoop`` and read deltas from a per-request
asyncio queue. A client that disconnects, streaming or not, has its requests aborted at once (their batch slots and
KV cache are freed at the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .answer_parser import AnswerParser
from .chat_turn import ChatTraits, TurnPlan
from .engine_client import EngineClient
from .engine_loop import EngineLoop, EngineUnavailable, QueueFull, RequestFailed
from .openai_protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    APIError,
    ChatOptions,
    ParsedRequest,
    bad_request,
    chat_options,
    parse_chat_request,
    parse_completion_request,
    parse_messages,
    request_param,
)
from .openai_responses import (
    ResponseHead,
    chunk,
    delta_choice,
    full_response,
    role_choice,
    usage_chunk,
)
from .outputs import Output, RequestStats
from .request_body import BodyError, parse_json
from .request_limits import RequestLimits, text_bytes
from .request_policy import PolicyMiddleware, RequestPolicy
from .server_metrics import ServerMetrics
from .web_page import FAVICON, FILES, read

#: The page runs only its own script and style: nothing an answer contains can run even if it reached the DOM.
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

log = logging.getLogger("logitproc.serve")
#: How long a response cut short at shutdown may take to send its end (a client that never reads never takes it).
SHUTDOWN_SEND_SECONDS = 0.5
#: What of an unread request body is read before a response starts (StatusCounter), at most.
DRAIN_BYTES = 1 << 20
DRAIN_SECONDS = 2.0
#: The prompt's last tokens read to know whether it leaves a think block open.
PROMPT_TAIL_TOKENS = 32


@dataclass
class ServerOptions:
    """How the app serves: the names the model answers to, the API key, the waiting-queue bound, the Host names and
    web origins it accepts (``RequestPolicy``)."""

    served_model_name: str | None = None  # default: the model's own name
    aliases: tuple[str, ...] = ()  # other names accepted in requests (e.g. the --model value)
    api_key: str | None = None
    max_queue: int = 256
    policy: RequestPolicy = field(default_factory=RequestPolicy)
    #: GenerationConfig values for the fields a request leaves unset (the model's defaults; set by the loader).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))


class AsgiHost(Enum):
    """What calls the app (``StatusCounter``), and what its cancelling a call or ``receive`` failing means."""

    #: uvicorn (the single-process server): it cancels a call only when ``--drain-timeout`` expired at shutdown (a
    #: client that disconnects is told to the app by ``http.disconnect``); its ``receive`` does not fail.
    UVICORN = "uvicorn"
    #: Ray Serve's ingress replica: it cancels the call when its HTTP proxy saw the client disconnect (or the
    #: client's own ``x-request-timeout-seconds`` pass), and ``receive`` (a call back into the proxy) fails when the
    #: proxy has gone (Serve shutting down, its node lost): either way the client is gone.
    RAY_SERVE = "Ray Serve"


class StatusCounter:
    """The outermost ASGI middleware: counts responses by endpoint and status (it watches ``send``), 500s included.

    Starlette's error middleware answers an unexpected exception with a 500 (``server_error`` logs it once, with its
    traceback), then re-raises it for the ASGI server, which would log it again: it stops here. One that escapes
    before any response started is answered with a 500 here. A response that uvicorn cancels because
    ``--drain-timeout`` expired (a client that does not read its stream) ends with one log line, not a traceback;
    under Ray Serve (``AsgiHost.RAY_SERVE``) a cancelled call is a client that left: counted as a 499 (nginx's
    "client closed request", as the app answers a client that left) if no status was sent yet, not logged; and a
    failing ``receive`` is that client's ``http.disconnect``.

    A response that starts before the request's body was read (a refusal, a GET with a body) first reads what is left
    of it (up to ``DRAIN_BYTES`` within ``DRAIN_SECONDS``): broken framing that arrived after a response had started
    would make uvicorn answer 400 on a connection already answering, and log a traceback."""

    def __init__(self, app: Any, metrics: ServerMetrics, host: AsgiHost = AsgiHost.UVICORN) -> None:
        self.app = app
        self.metrics = metrics
        self.host = host

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        started = complete = received = False

        async def tracked() -> Any:
            nonlocal received
            try:
                message = await receive()
            except Exception:
                if self.host is not AsgiHost.RAY_SERVE:
                    raise
                message = {"type": "http.disconnect"}
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                received = True
            return message

        async def drain() -> None:
            size = 0
            while not received and size <= DRAIN_BYTES:
                size += len((await tracked()).get("body", b""))

        async def counted(message: Any) -> None:
            nonlocal started, complete
            if message["type"] == "http.response.start":
                if not received:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(drain(), DRAIN_SECONDS)
                started = True
                self.metrics.response(scope["path"], message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, tracked, counted)
        except Exception as err:
            if not started:
                log.error("unexpected error in %s: %s", ascii(scope["path"][:200]), _described(err))
                error = APIError(500, f"internal error: {_described(err)}", kind="server_error")
                await _ErrorResponse(error.body(), status_code=500)(scope, receive, counted)
        except asyncio.CancelledError:
            if self.host is AsgiHost.RAY_SERVE:
                if not started:
                    self.metrics.response(scope["path"], 499)
                raise
            # the drain timeout expired: end what can be ended, without waiting long
            log.warning("%s: cut short at shutdown (--drain-timeout expired)", ascii(scope["path"][:200]))
            error = APIError(503, "the server is stopping", kind="server_error", code="model_not_ready")
            end = (_ErrorResponse(error.body(), status_code=503)(scope, receive, counted) if not started else
                   counted({"type": "http.response.body", "body": b"", "more_body": False}) if not complete else None)
            if end is not None:
                with contextlib.suppress(Exception, asyncio.TimeoutError):
                    await asyncio.wait_for(end, SHUTDOWN_SEND_SECONDS)


class _ErrorResponse(JSONResponse):
    """An error body written in ASCII (``\\uXXXX`` escapes): whatever text it holds, it can be encoded."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _described(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:500]}"


def _prompt_usage(stats: dict[str, RequestStats]) -> tuple[int, int]:
    """Prompt tokens of the requests, and how many of them came from the prefix cache."""
    return sum(st.prompt_tokens for st in stats.values()), sum(st.cached_tokens for st in stats.values())


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (after the body was read, the ASGI server's next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json_body(request: Request, max_bytes: int) -> Any:
    """The request's JSON body (``request_body.parse_json``), read while it stays within ``max_bytes``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > len(str(max_bytes)) or int(declared) > max_bytes):
        shown = declared if len(declared) <= 20 else f"{declared[:20]}... ({len(declared)} digits)"
        raise APIError(413, f"the request body has {shown} bytes; this server accepts at most {max_bytes}",
                       code="body_too_large")
    chunks, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > max_bytes:
                raise APIError(413, f"the request body has over {max_bytes} bytes; this server accepts at most "
                                    f"{max_bytes}", code="body_too_large")
            chunks.append(part)
    except ClientDisconnect:  # half a body, then gone (or framing the ASGI server gave up on): nobody reads an answer
        raise APIError(499, "the client closed the request before its body was complete",
                       code="client_closed_request") from None
    try:
        return parse_json(b"".join(chunks), max_bytes)
    except BodyError as err:
        raise APIError(err.status, err.message, code="body_too_large" if err.status == 413 else None) from None


class Server:
    """The app's state: options, metrics, the engine client; ``app`` is the FastAPI application.

    The engine client is an ``EngineLoop`` over ``load()`` (the engine in this process), unless ``client`` gives
    another ``EngineClient`` (Ray replicas: ``ray_client.py``; ``load`` and ``on_failure`` are then unused)."""

    def __init__(self, load: Callable[[], Any] | None, options: ServerOptions,
                 on_failure: Callable[[BaseException], None] | None = None, *, client: EngineClient | None = None,
                 metrics: ServerMetrics | None = None, host: AsgiHost = AsgiHost.UVICORN) -> None:
        self.options = options
        self.metrics = metrics if metrics is not None else ServerMetrics()
        if client is None:
            if load is None:
                raise ValueError("Server needs a load function or an engine client")
            client = EngineLoop(load, self.metrics, options.max_queue, on_failure)
        self.loop: EngineClient = client
        self._token_texts: dict[int, str] = {}
        self._limits: RequestLimits | None = None
        self._traits: ChatTraits | None = None
        #: The ASGI application: the FastAPI app inside the request policy, inside the status counter.
        self.app = StatusCounter(PolicyMiddleware(self._make_app(), options.policy), self.metrics, host)

    # ---------------------------------------------------------------------------------------------- helpers
    @property
    def model_name(self) -> str:
        return self.options.served_model_name or self.loop.engine.model.name

    def _ready(self) -> Any:
        if self.loop.state != EngineLoop.READY:
            detail = f": {self.loop.error}" if self.loop.error else ""
            raise APIError(503, f"the model is {self.loop.state}{detail}", kind="server_error",
                           code="model_not_ready")
        return self.loop.engine

    @property
    def limits(self) -> RequestLimits:
        """The served model's input limits (read from its tokenizer once it is loaded)."""
        if self._limits is None:
            engine = self._ready()
            self._limits = RequestLimits.of(engine.model.tokenizer, engine.context_length, self.options.max_queue)
        return self._limits

    async def body(self, request: Request) -> Any:
        """The request's JSON body within the model's limits (503 while the model loads)."""
        return await _json_body(request, self.limits.body_bytes)

    def _check_model(self, name: str | None) -> str:
        served = self.model_name
        if name is not None and name not in (served, *self.options.aliases):
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{served}'", param="model",
                           code="model_not_found")
        return served

    def token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self.loop.engine.model.tokenizer.decode([token], skip_special_tokens=False)
            self._token_texts[token] = text
        return text

    async def _tokenized(self, parsed: ParsedRequest, fields: tuple[str, ...]) -> list[Any]:
        """The prompts as token ids, tokenized on a worker thread (not the engine's stepping thread)."""
        engine = self.loop.engine
        prompts = []
        for prompt in parsed.prompts:
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                prompts.append(prompt)  # token ids already (the engine checks them)
                continue
            try:
                if parsed.chat:  # rendered with the request's tools and template keywords
                    prompts.append(await asyncio.to_thread(self._chat_ids, prompt, parsed.chat_options))
                else:
                    prompts.append(await asyncio.to_thread(engine.tokenize, prompt, parsed.chat))
            except (ValueError, TypeError) as err:  # a template's refusal, or the prompt's
                param = request_param(err, fields) or ("messages" if parsed.chat else "prompt")
                raise bad_request(" ".join(str(err).split()), param) from None
        return prompts

    def _chat_ids(self, messages: list[dict[str, Any]], options: ChatOptions) -> list[int]:
        """Prompt ids of a chat: its messages, tools and template keywords through the model's template (the
        messages' text never becomes control tokens), ending with the generation prompt or the final message."""
        model = self.loop.engine.model
        kwargs = options.render_kwargs()
        if options.continue_final_message:
            kwargs["continue_final_message"] = True
        return model.chat_token_ids(messages, options.add_generation_prompt, **kwargs)

    @property
    def chat_traits(self) -> ChatTraits:
        """What the served model's chat template supports (tool-call syntax, a think block), read once."""
        if self._traits is None:
            model = self.loop.engine.model
            self._traits = ChatTraits.of(model.chat_template, model.tokenizer)
        return self._traits

    def _turn_plan(self, parsed: ParsedRequest, prompt: list[int]) -> TurnPlan:
        """The request's turn (its tool grammar, its answers' parsing); its config replaces the request's."""
        tail = self.loop.engine.model.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        plan = TurnPlan.make(self.chat_traits, parsed.config, parsed.chat_options.tools, tail)
        parsed.config = plan.config
        return plan

    async def _submit(self, parsed: ParsedRequest, prompts: list[Any],
                      fields: tuple[str, ...]) -> tuple[list[str], asyncio.Queue]:
        items: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def sink(item: Any) -> None:
            aloop.call_soon_threadsafe(items.put_nowait, item)

        submitted = self.loop.submit(prompts, parsed.config, parsed.chat, sink, parsed.jump_forward)
        try:
            ids = await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:  # the client left while the request was being added: abort it once added
            submitted.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() is not None else self.loop.abort(f.result()))
            raise
        except QueueFull as err:
            raise APIError(429, str(err), kind="rate_limit_error", code="queue_full") from None
        except EngineUnavailable as err:
            raise APIError(503, str(err), kind="server_error", code="model_not_ready") from None
        except (ValueError, TypeError) as err:  # the engine refused the request: the client's input
            raise bad_request(" ".join(str(err).split()), self._param_for(err, parsed, fields)) from None
        return ids, items

    @staticmethod
    def _param_for(err: Exception, parsed: ParsedRequest, fields: tuple[str, ...]) -> str | None:
        """The field an engine refusal is about: the one its ``FieldError`` names; otherwise the constraint (its
        schema, regex or grammar did not compile) where the request has one."""
        param = request_param(err, fields)
        if param is None and parsed.config.response_format is not None:
            return "response_format"
        return param

    # ---------------------------------------------------------------------------------------------- generation
    async def generate(self, request: Request, chat: bool) -> Response:
        self._ready()
        body = await self.body(request)
        defaults = self.options.sampling_defaults
        parsed = parse_chat_request(body, defaults) if chat else parse_completion_request(body, defaults)
        model = self._check_model(parsed.model)
        self.limits.check(parsed)
        fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
        echo = [self._prompt_text(p) for p in parsed.prompts for _ in range(parsed.n)] if parsed.echo else []
        prompts = await self._tokenized(parsed, fields)
        plan = self._turn_plan(parsed, prompts[0]) if chat else None
        ids, items = await self._submit(parsed, prompts, fields)
        head = ResponseHead(chat, model)
        choice_of = {rid: p * parsed.n for p, rid in enumerate(ids)}
        if parsed.stream:
            return StreamingResponse(self._stream(head, parsed, ids, items, choice_of, echo, plan),
                                     media_type="text/event-stream; charset=utf-8")
        collect = asyncio.ensure_future(self._collect(ids, parsed.n, items, choice_of))
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left (or the server is stopping): free the engine's slots now
                collect.cancel()
                self.loop.abort(ids)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        outputs, prompt_tokens, cached_tokens = collect.result()
        answers = None
        if plan is not None:
            answers = {}
            for index, out in outputs:
                parser = plan.parser()
                parser.feed(out.text)
                parser.finish()
                answers[index] = plan.answer(parser, out.finish_reason)
        return JSONResponse(full_response(head, outputs, self.token_text, prompt_tokens, echo, cached_tokens,
                                          answers))

    def _prompt_text(self, prompt: Any) -> str:
        return prompt if isinstance(prompt, str) else self.loop.engine.model.tokenizer.decode(prompt)

    async def _collect(self, ids: list[str], n: int, items: asyncio.Queue,
                       choice_of: dict[str, int]) -> tuple[list[tuple[int, Output]], int, int]:
        """Every sequence's Output (with its choice index), and the prompt tokens of all the requests and how many
        of them came from the prefix cache."""
        outputs: list[tuple[int, Output]] = []
        prompt_stats: dict[str, RequestStats] = {}
        while len(outputs) < len(ids) * n:
            item = await items.get()
            if isinstance(item, RequestFailed):
                self.loop.abort(ids)
                raise APIError(item.status, item.message, kind="server_error")
            if item.output is not None:
                outputs.append((choice_of[item.request_id] + item.index, item.output))
                prompt_stats[item.request_id] = item.output.stats
        return outputs, *_prompt_usage(prompt_stats)

    async def _stream(self, head: ResponseHead, parsed: ParsedRequest, ids: list[str], items: asyncio.Queue,
                      choice_of: dict[str, int], echo: list[str], plan: TurnPlan | None) -> AsyncIterator[str]:
        total = len(ids) * parsed.n
        finished = completion_tokens = 0
        prompt_stats: dict[str, RequestStats] = {}
        offsets: dict[int, int] = {}
        parsers: dict[int, AnswerParser] = {}
        complete = False
        events: list[str] = []  # written as one body chunk once no item is waiting (or at the end)
        try:
            if head.chat:
                events.append(_sse(chunk(head, [role_choice(i) for i in range(total)], parsed.include_usage)))
            while finished < total:
                if events and items.empty():
                    yield "".join(events)
                    events.clear()
                item = await items.get()
                if isinstance(item, RequestFailed):
                    events.append(_sse(APIError(item.status, item.message, kind="server_error").body()))
                    break
                index = choice_of[item.request_id] + item.index
                text = item.text
                if echo and index not in offsets:
                    text = echo[index] + text
                offset = offsets.get(index, 0)
                offsets[index] = offset + len(text)
                piece = answer = None
                if plan is not None:  # the text split into reasoning, content and tool-call pieces
                    parser = parsers.setdefault(index, plan.parser())
                    piece = parser.feed(text)
                    if item.finish_reason is not None:
                        rest = parser.finish()
                        piece.reasoning += rest.reasoning
                        piece.content += rest.content
                        answer = plan.answer(parser, item.finish_reason)
                if item.finish_reason is not None:
                    finished += 1
                    if item.output is not None:
                        completion_tokens += len(item.output.token_ids)
                        prompt_stats[item.request_id] = item.output.stats
                elif not (piece if piece is not None else text) and not item.logprobs:
                    continue
                choice = delta_choice(head, index, item, self.token_text, text, offset, piece, answer)
                events.append(_sse(chunk(head, [choice], parsed.include_usage)))
            if parsed.include_usage:
                prompt_tokens, cached_tokens = _prompt_usage(prompt_stats)
                events.append(_sse(usage_chunk(head, prompt_tokens, completion_tokens, cached_tokens)))
            events.append("data: [DONE]\n\n")
            yield "".join(events)
            complete = True
        finally:
            if not complete:  # the client went away (the response task was cancelled): abort now
                self.loop.abort(ids)

    # ---------------------------------------------------------------------------------------------- the app
    def _make_app(self) -> FastAPI:
        server = self

        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            server.loop.start()
            yield
            await asyncio.to_thread(server.loop.stop)

        app = FastAPI(title="logitproc", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        def authorized(request: Request) -> None:
            key = server.options.api_key
            if key is None:
                return
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
                raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")

        guarded = [Depends(authorized)]

        @app.exception_handler(APIError)
        async def api_error(request: Request, err: APIError) -> JSONResponse:
            return _ErrorResponse(err.body(), status_code=err.status)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
            error = APIError(err.status_code, str(err.detail), kind="invalid_request_error")
            return _ErrorResponse(error.body(), status_code=err.status_code)

        @app.exception_handler(ClientDisconnect)
        async def client_gone(request: Request, err: ClientDisconnect) -> Response:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")

        @app.exception_handler(Exception)
        async def server_error(request: Request, err: Exception) -> JSONResponse:
            log.exception("unexpected error in %s", ascii(request.url.path[:200]))
            error = APIError(500, f"internal error: {_described(err)}", kind="server_error")
            return _ErrorResponse(error.body(), status_code=500)

        @app.get("/health")
        async def health() -> Response:
            status, body = await server.loop.health()
            return JSONResponse(body, status_code=status)

        def page_file(name: str) -> Response:
            if name not in FILES:
                raise APIError(404, f"no such file: /static/{name}", code="not_found")
            return Response(read(name), media_type=FILES[name],
                            headers={"Cache-Control": "no-cache", "Content-Security-Policy": PAGE_POLICY,
                                     "X-Content-Type-Options": "nosniff"})

        # The page holds no secret (its API calls carry the key the user types): served without the key.
        @app.api_route("/", methods=["GET", "HEAD"])
        async def page() -> Response:
            return page_file("index.html")

        @app.get("/static/{name}")
        async def static(name: str) -> Response:
            return page_file(name)

        @app.get("/favicon.ico")
        async def favicon() -> Response:
            return page_file(FAVICON)

        @app.get("/props", dependencies=guarded)
        async def props() -> JSONResponse:
            engine = server._ready()
            from logitproc.runtime.config import MAX_TOP_LOGPROBS

            traits = server.chat_traits
            return JSONResponse({
                "model": server.model_name, "max_model_len": engine.context_length,
                "default_generation_settings": dict(server.options.sampling_defaults),
                "max_top_logprobs": MAX_TOP_LOGPROBS,
                "features": {"jump_forward": bool(engine.jump_forward),
                             "speculative": None if engine.speculative is None else asdict(engine.speculative),
                             "tools": None if traits.syntax is None else traits.syntax.value,
                             "reasoning": traits.thinking}})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(server.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models", dependencies=guarded)
        async def models() -> JSONResponse:
            engine = server._ready()
            name = server.model_name
            return JSONResponse({"object": "list", "data": [
                {"id": name, "object": "model", "created": server.options.created, "owned_by": "logitproc",
                 "root": name, "max_model_len": engine.context_length}]})

        @app.post("/v1/chat/completions", dependencies=guarded)
        async def chat_completions(request: Request) -> Response:
            return await server.generate(request, chat=True)

        @app.post("/v1/completions", dependencies=guarded)
        async def completions(request: Request) -> Response:
            return await server.generate(request, chat=False)

        @app.post("/tokenize", dependencies=guarded)
        async def tokenize(request: Request) -> JSONResponse:
            engine = server._ready()
            body = await server.body(request)
            if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
                raise bad_request("give either prompt (text or token ids) or messages")
            server._check_model(body.get("model"))
            chat = "messages" in body
            prompt = parse_messages(body["messages"]) if chat else body["prompt"]
            if not isinstance(prompt, (str, list)):
                raise bad_request("prompt must be a string or a list of token ids", "prompt")
            server.limits.check_text(text_bytes(prompt), "messages" if chat else "prompt")
            try:
                if chat:  # rendered as a chat request's prompt (tools, template keywords, prefill)
                    tokens = await asyncio.to_thread(server._chat_ids, prompt, chat_options(body, prompt))
                else:
                    tokens = await asyncio.to_thread(engine.tokenize, prompt, chat)
            except (ValueError, TypeError) as err:
                raise bad_request(str(err), "messages" if chat else "prompt") from None
            return JSONResponse({"count": len(tokens), "max_model_len": engine.context_length, "tokens": tokens})

        @app.post("/detokenize", dependencies=guarded)
        async def detokenize(request: Request) -> JSONResponse:
            engine = server._ready()
            body = await server.body(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.vocab_size for t in tokens):
                raise bad_request(f"tokens must be a list of token ids in [0, {engine.vocab_size})", "tokens")
            server._check_model(body.get("model"))
            text = await asyncio.to_thread(engine.model.tokenizer.decode, tokens)  # off the stepping thread
            return JSONResponse({"prompt": text})

        return app
