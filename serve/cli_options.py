"""Options shared by ``logitproc chat`` and ``logitproc generate``: the model, the target, sampling parameters.

Only argparse and the standard library are imported at module level, so ``logitproc --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .model_defaults import ModelDefaults
from .outputs import FinishReason

#: ``--model tiny`` opens the small random test model (compile/tiny_model.py): fast, meaningless answers.
TINY_MODEL = "tiny"
#: Its context: long enough that an answer takes a few seconds (time to press Ctrl-C in the REPL tests).
TINY_CONTEXT = 4096
#: ``logitproc.compile.TARGET_KINDS`` (a test checks they agree): importing it here would load TVM for ``--help``.
TARGET_CHOICES = ("cpu", "cuda", "rocm", "vulkan", "metal")

# option name -> (GenerationConfig field, type, help with the value that leaves the model's distribution alone)
SAMPLING_OPTIONS: dict[str, tuple[str, type, str]] = {
    "--temperature": ("temperature", float, ">= 0; 0 = greedy (default: the model's, as said above)"),
    "--top-p": ("top_p", float, "nucleus sampling mass, (0, 1]; 1 = off (default: the model's, else 1)"),
    "--top-k": ("top_k", int, "keep the k most likely tokens, < 2**31; 0 = off (default: the model's, else 0)"),
    "--min-p": ("min_p", float, "keep tokens with prob >= min_p * max prob; 0 = off (default: the model's, else 0)"),
    "--presence-penalty": ("presence_penalty", float, "[-2, 2] (default: 0)"),
    "--frequency-penalty": ("frequency_penalty", float, "[-2, 2] (default: 0)"),
    "--repetition-penalty": ("repetition_penalty", float, "[0.001, 1000]; 1 = off (default: the model's, as above)"),
    "--seed": ("seed", int, "seed of the sampling stream (default: none, a fresh stream)"),
    "--max-tokens": ("max_tokens", int, "at most this many tokens per answer (default: the model's, else 512)"),
    "--min-tokens": ("min_tokens", int, "no EOS, stop token or stop string before this many tokens (default: 0)"),
}


def add_kv_dtype_argument(parser: argparse.ArgumentParser) -> None:
    from logitproc.compile.kv_layout import KV_DTYPES

    parser.add_argument("--kv-dtype", default="float32", choices=KV_DTYPES,
                        help="the KV cache's element type: float16 as llama.cpp's default, q8_0 as its -ctk q8_0 "
                             "-ctv q8_0 (8-bit blocks: a third of float32's bytes per token with SmolLM2's heads) "
                             "(default: %(default)s)")


def add_activation_bits_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--activation-bits", type=int, default=16, choices=(16, 8),
                        help="codes of the activations in the quantised matmuls: 16 keeps a small model's logits "
                             "within about 1e-2 of float; 8, as llama.cpp's, is up to 1.5x faster where a prefill is "
                             "compute-bound (larger models) and moves a small model's logits by up to 1 "
                             "(docs/model.md) (default: %(default)s)")


def add_context_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=None, metavar="TOKENS",
                        help="tokens per sequence to compile the model for, up to its max_position_embeddings; "
                             "beyond a LongRoPE model's original context (Phi-3.5/4-mini: 4096) its long factors "
                             "apply (default: the model's; LongRoPE: the original context)")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="'default' (SmolLM2-135M-Instruct, fetched and compiled on first use), a GGUF file or "
                             "a Hugging Face model folder (default: %(default)s)")
    parser.add_argument("--target", default="cpu", help="compilation target (default: %(default)s)")
    add_kv_dtype_argument(parser)
    add_activation_bits_argument(parser)
    add_context_argument(parser)
    parser.add_argument("--jump-forward", action="store_true",
                        help="append tokens a grammar forces without a decode step each (default: off)")
    parser.add_argument("--grammar-backend", default="llguidance", choices=("llguidance", "xgrammar"),
                        help="engine for JSON schemas, regexes and grammars (xgrammar: the optional extra) "
                             "(default: %(default)s)")
    parser.add_argument("--speculative", metavar="ngram[:K]", type=speculative_option, default=None,
                        help="speculative decoding: prompt-lookup drafts of up to K tokens (default K 5), checked in "
                             "one forward and kept only where they pay; faster on answers that repeat the prompt "
                             "(edits, quotes, JSON rewrites) (default: off)")
    parser.add_argument("--chat-template", metavar="FILE", default=None,
                        help="a jinja chat template to render chats with instead of the model's own (default: the "
                             "model's, else ChatML)")
    parser.add_argument("--tree-decode-config", metavar="FILE", default=None,
                        help="Tree Decode map (JSON, docs/constrained_decoding.md) constraining every answer: a path "
                             "as given (absolute or relative to the working directory) (default: "
                             "$TREE_DECODE_CONFIG, relative to the model's directory and confined to it)")


def speculative_option(text: str) -> Any:
    """``--speculative ngram[:K]`` as a SpeculativeConfig (argparse reports the ValueError's message)."""
    from logitproc.serve.speculation import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


#: Integer options bounded where the kernels hold them in int32 (the shell reports a larger value as a usage error).
INT32_OPTIONS = ("--top-k",)


def int32(text: str) -> int:
    """An int that fits the kernels' int32 arguments (argparse reports the ValueError's message, one line)."""
    value = int(text)
    if not -(2**31) <= value < 2**31:
        raise argparse.ArgumentTypeError(f"{text} is too large (at most {2**31 - 1})")
    return value


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    from .model_defaults import help_text

    group = parser.add_argument_group("sampling", help_text())
    for option, (_, kind, text) in SAMPLING_OPTIONS.items():
        group.add_argument(option, type=int32 if option in INT32_OPTIONS else kind, default=None, help=text)
    group.add_argument("--json-schema", metavar="FILE_OR_JSON",
                       help="constrain the answer to this JSON schema (default: none)")
    add_json_whitespace_argument(group)
    group.add_argument("--regex", help="constrain the answer to match this regular expression (default: none)")
    group.add_argument("--stop", action="append", help="a stop string (may be repeated) (default: none)")
    group.add_argument("--bad-word", action="append", help="a word never to write (may be repeated) (default: none)")


#: ``--json-whitespace`` choices (``runtime.response_format.WHITESPACE_POLICIES``, written here so that ``--help``
#: does not load the runtime).
JSON_WHITESPACE = ("compact", "indented", "flexible")


def add_json_whitespace_argument(parser: Any) -> None:
    parser.add_argument("--json-whitespace", choices=JSON_WHITESPACE, default=None,
                        help="layout of a JSON answer: compact (no whitespace, as OpenAI returns JSON), indented "
                             "(json.dumps indent=2) or flexible (any whitespace between tokens) (default: compact)")


def read_schema(spec: str, stdin: bool = False) -> Any:
    """A JSON schema from inline JSON text or from a file (a pipe such as ``<(...)`` works too; with ``stdin``,
    ``-`` reads standard input); ValueError saying what is wrong. A pipe or standard input can be read only once:
    call this once per command (``options_from_args`` does)."""
    text = spec.strip()
    if text == "-" and not stdin:
        raise ValueError("--json-schema - reads standard input, which the chat needs for your messages: give the "
                         "schema inline or as a file")
    if text == "-":
        text = sys.stdin.read()
    elif not text.startswith(("{", "[")) and text not in ("true", "false"):
        path = Path(text).expanduser()
        if not path.exists() or path.is_dir():
            raise ValueError(f"{spec!r} is neither inline JSON nor a file")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read the schema file {spec!r}: {err}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"the schema is not valid JSON: {err}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema is an object (or true/false), got {type(schema).__name__} {text[:40]!r}")
    return schema


def json_schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}


def options_from_args(args: argparse.Namespace, stdin: bool = False) -> dict[str, Any]:
    """The GenerationConfig fields the command line sets, checked (ValueError naming the option, before any model
    loads); ``--json-schema`` is read here, once, since a pipe or (with ``stdin``) ``-`` can be read only once."""
    values: dict[str, Any] = {}
    for _, (name, _, _) in SAMPLING_OPTIONS.items():
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    if args.json_schema is not None and args.regex is not None:
        raise ValueError("give either --json-schema or --regex, not both")
    if args.json_schema is not None:
        values["response_format"] = json_schema_format(read_schema(args.json_schema, stdin=stdin))
    elif args.regex is not None:  # '' too: the answer must then be empty
        values["response_format"] = {"type": "regex", "regex": args.regex}
    if args.json_whitespace is not None:
        if args.json_schema is None:
            raise ValueError("--json-whitespace lays out the answer of --json-schema: give a schema too")
        values["response_format"]["whitespace"] = args.json_whitespace
    if args.stop:
        values["stop"] = tuple(args.stop)
    if args.bad_word:
        values["bad_words"] = tuple(args.bad_word)
    config_from_options(values)  # bad values fail now
    return values


def config_from_options(options: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> Any:
    """The GenerationConfig of ``options`` (from ``options_from_args``) over the model's ``defaults``."""
    from logitproc.runtime import GenerationConfig

    return GenerationConfig(**{**(defaults or {}), **options})


def log(message: str) -> None:
    """Diagnostics go to stderr, so that stdout holds only the answer."""
    print(message, file=sys.stderr, flush=True)


def open_model(spec: str, target: str, kv_dtype: str = "float32", context: int | None = None,
               activation_bits: int = 16) -> Any:
    """Open (fetching and compiling on first use, with visible progress on stderr) the model named by ``spec``,
    with a KV cache of ``kv_dtype``, serving ``context`` tokens per sequence (None: the model's), its quantised
    matmuls on ``activation_bits`` codes."""
    from logitproc.serve.compiled_model import CompiledModel

    from .progress_line import ProgressLine

    model: Any = tiny_model() if spec == TINY_MODEL else spec
    with ProgressLine(sys.stderr) as progress:
        return CompiledModel.open(model, target=target, progress=progress, kv_dtype=kv_dtype, context=context,
                                  activation_bits=activation_bits)


def read_chat_template(args: argparse.Namespace) -> Any:
    """``--chat-template FILE`` as a ChatTemplate (read and compiled before the model opens), or None."""
    if args.chat_template is None:
        return None
    from logitproc.serve.chat_template import ChatTemplate

    return ChatTemplate.from_file(args.chat_template)


def use_chat_template(model: Any, template: Any) -> None:
    """Render the model's chats with ``template`` (from ``read_chat_template``; None: keep the model's own)."""
    if template is not None:
        model.use_chat_template(model.chat_template.with_source(template))
        log(f"chat template: {template.origin}")


def tiny_model() -> Any:
    """The model ``--model tiny`` names (a GGUFModel in memory; compiled once into the cache)."""
    from logitproc.compile.tiny_model import make_tiny_model

    return make_tiny_model(seed=0, context=TINY_CONTEXT)


def open_engine(args: argparse.Namespace) -> tuple[Any, ModelDefaults]:
    """The engine over ``--model`` (one request at a time) and the model's default sampling settings."""
    import os

    from logitproc.runtime.tree_decode import load_tree_decode_config
    from logitproc.serve.engine import Engine

    from .model_defaults import model_defaults

    template = read_chat_template(args)
    model = open_model(args.model, args.target, args.kv_dtype, args.context, args.activation_bits)
    use_chat_template(model, template)
    source = Path(args.model)
    model_dir = (source if source.is_dir() else source.parent) if source.exists() else model.directory
    tree = load_tree_decode_config(args.tree_decode_config, model.vocab_size, os.environ, model_dir)
    if tree is not None:
        log("tree decode: map loaded; it constrains every answer")
    engine = Engine(model, max_batch=1, jump_forward=args.jump_forward, grammar_backend=args.grammar_backend,
                    tree_decode=tree, speculative=args.speculative)
    folders = [source] if source.is_dir() else []
    return engine, model_defaults(model.name, [*folders, Path(model.directory)])


def cut_note(output: Any, config: Any) -> str | None:
    """Why an answer ended early, when it was cut (finish ``length``); None for a complete answer."""
    if output.finish_reason != FinishReason.LENGTH:
        return None
    if config.max_tokens is not None and len(output.token_ids) >= config.max_tokens:
        return f"cut at max_tokens = {config.max_tokens}"
    return "cut: the context is full"
