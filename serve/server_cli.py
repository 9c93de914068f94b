"""``logitproc serve``: the OpenAI-compatible HTTP server's command line (options, model loading, uvicorn, SIGTERM).

The socket is bound first, so ``/health`` answers 503 while the model is fetched and compiled (first use) and
loaded; progress goes to stderr, then the URL. SIGTERM stops accepting connections, lets running requests finish
for up to ``--drain-timeout`` seconds, then exits 0; Ctrl-C does the same, then exits 130 (``cli.main``: the shell's
convention). ``--allowed-hosts`` and ``--allowed-origins`` widen the request policy (``request_policy.py``).
FastAPI and uvicorn load only when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .cli_options import TINY_MODEL, add_json_whitespace_argument, add_model_arguments, log
from .ray_options import add_ray_arguments, check_ray_arguments, uses_ray


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                                 description="Serve the model over an OpenAI-compatible HTTP API (docs/server.md).")
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=16,
                        help="sequences generated at once (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="tokens one step feeds the model at most: decode rows first, then prefill chunks of "
                             "the prompts going in (0: no bound; default: %(default)s)")
    parser.add_argument("--max-prefill-tokens-with-decode", type=int, default=16,
                        help="prefill tokens of a step that also decodes, which bounds how long a long prompt holds "
                             "the running streams up (0: no bound; default: %(default)s; docs/serving.md)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests waiting to start before new ones get 429 (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("LOGITPROC_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize "
                             "(default: $LOGITPROC_API_KEY, else none)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the model's own name)")
    add_json_whitespace_argument(parser)  # the default of requests that do not set json_whitespace
    parser.add_argument("--logprobs-mode", choices=("auto", "raw_logprobs", "processed_logprobs"), default=None,
                        help="what logprobs report when a request does not say (its logprobs_mode): the model's own "
                             "distribution (raw_logprobs), the one sampled from (processed_logprobs), or auto: raw "
                             "for greedy requests, processed when sampling (default: auto)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish after SIGTERM (default: %(default)s)")
    parser.add_argument("--allowed-hosts", action="append", default=[], metavar="NAMES",
                        help="Host names accepted besides IP addresses, localhost and --host, against DNS "
                             "rebinding (comma-separated or repeated; '*': any) (default: none)")
    parser.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGINS",
                        help="web origins (scheme://host:port) whose pages may call the server, besides its own "
                             "chat page (comma-separated or repeated; '*': any) (default: none)")
    add_ray_arguments(parser)
    parser.set_defaults(run=run)


def _listed(values: list[str]) -> tuple[str, ...]:
    """The names of a repeated, comma-separated option."""
    return tuple(name.strip() for value in values for name in value.split(",") if name.strip())


def _check(args: argparse.Namespace) -> None:
    for name, low in (("max_batch", 1), ("max_queue", 1), ("port", 0), ("max_num_batched_tokens", 0),
                      ("max_prefill_tokens_with_decode", 0)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.port > 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    check_ray_arguments(args)
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    for origin in _listed(args.allowed_origins):
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+/?", origin):
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin like http://example.com:8080 (or '*')")
    for host in _listed(args.allowed_hosts):
        if host != "*" and not re.fullmatch(r"[^/\s:@]+|\[[0-9a-fA-F:.]+\]", host):
            raise ValueError(f"--allowed-hosts: {host!r} is not a host name like example.com (or '*')")


def server_options(args: argparse.Namespace) -> Any:
    """The app's ServerOptions from the command line (the sampling defaults are set once the model is loaded)."""
    from .http_server import ServerOptions
    from .request_policy import RequestPolicy

    policy = RequestPolicy(args.host, _listed(args.allowed_hosts), _listed(args.allowed_origins))
    return ServerOptions(served_model_name=args.served_model_name, aliases=(args.model,), api_key=args.api_key,
                         max_queue=args.max_queue, policy=policy)


def load_engine(args: argparse.Namespace) -> Any:
    """The Engine over ``--model`` with ``--max-batch`` sequences (compiling the model on first use), its grammar
    backend made (``Engine.prepare_constraints``)."""
    from logitproc.runtime.tree_decode import load_tree_decode_config
    from logitproc.serve.compiled_model import CompiledModel
    from logitproc.serve.engine import Engine

    from .cli_options import read_chat_template, tiny_model, use_chat_template
    from .progress_line import ProgressLine

    template = read_chat_template(args)
    source: Any = tiny_model() if args.model == TINY_MODEL else args.model
    with ProgressLine(sys.stderr) as progress:
        model = CompiledModel.open(source, target=args.target, progress=progress, max_num_sequences=args.max_batch,
                                   kv_dtype=args.kv_dtype, context=args.context,
                                   activation_bits=args.activation_bits)
    use_chat_template(model, template)
    path = Path(args.model)
    model_dir = (path if path.is_dir() else path.parent) if path.exists() else model.directory
    tree = load_tree_decode_config(args.tree_decode_config, model.vocab_size, os.environ, model_dir)
    if tree is not None:
        log("tree decode: map loaded; it constrains every answer")
    engine = Engine(model, max_batch=args.max_batch, jump_forward=args.jump_forward,
                    grammar_backend=args.grammar_backend, tree_decode=tree, speculative=args.speculative,
                    max_num_batched_tokens=args.max_num_batched_tokens or None,
                    max_prefill_tokens_with_decode=args.max_prefill_tokens_with_decode or None)
    # made now, not by the first request with a response format (it would hold up the steps for about a second)
    started = time.perf_counter()
    try:
        engine.prepare_constraints()
    except ValueError as err:  # requests with a response format get the same error (400); the others are served
        log(f"response formats are not available for this model: {err}")
    else:
        log(f"grammar backend {args.grammar_backend} ready in {time.perf_counter() - started:.1f}s")
    return engine


def sampling_defaults(args: argparse.Namespace, model: Any) -> Any:
    """The model's default sampling settings (ModelDefaults), as ``chat`` and ``generate`` use them."""
    from .model_defaults import model_defaults

    source = Path(args.model)
    return model_defaults(model.name, [*([source] if source.is_dir() else []), Path(model.directory)])


def request_defaults(args: argparse.Namespace, engine: Any) -> tuple[dict[str, Any], str]:
    """The GenerationConfig values of the fields a request leaves unset (the model's defaults, ``--logprobs-mode``,
    ``--json-whitespace``), and the model's defaults described for the log."""
    from .openai_protocol import parse_logprobs_mode

    defaults = sampling_defaults(args, engine.model)
    values = dict(defaults.values)
    if args.logprobs_mode is not None:
        values["logprobs_mode"] = parse_logprobs_mode(args.logprobs_mode, "--logprobs-mode")
    if args.json_whitespace is not None:
        values["json_whitespace"] = args.json_whitespace
    return values, defaults.describe()


def run(args: argparse.Namespace) -> int:
    """``logitproc serve``; with ``--replicas`` (or ``--autoscale``), on Ray Serve (``ray_command.py``)."""
    _check(args)
    if uses_ray(args):
        from .ray_command import serve_on_ray  # Ray loads only on this path

        return serve_on_ray(args)
    import uvicorn

    from .http_server import Server
    from .uvicorn_protocol import QuietH11Protocol

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    url = f"http://{args.host}:{args.port}"
    failure: list[BaseException] = []
    holder: dict[str, Any] = {}

    def load() -> Any:
        log(f"listening on {url} (/health answers 503 until the model is loaded)")
        engine = load_engine(args)
        options.sampling_defaults, described = request_defaults(args, engine)
        name = args.served_model_name or engine.model.name
        log(f"unset request fields take: {described}")
        log(f"ready: serving {name!r} at {url}/v1 (max batch {engine.max_batch}, context {engine.context_length})")
        return engine

    def on_failure(err: BaseException) -> None:
        failure.append(err)
        holder["uvicorn"].should_exit = True

    options = server_options(args)
    server = Server(load, options, on_failure)
    config = uvicorn.Config(server.app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=args.drain_timeout, lifespan="on", http=QuietH11Protocol)
    holder["uvicorn"] = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has drained; this handler makes SIGTERM end with 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: log("stopped (SIGTERM)"))
    try:
        holder["uvicorn"].run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failure:
        raise RuntimeError(f"the model did not load: {failure[0]}")
    return 0
