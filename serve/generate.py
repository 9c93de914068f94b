"""``logitproc generate``: one answer on stdout; fetch/compile progress and statistics on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .cli_options import (
    add_model_arguments,
    add_sampling_arguments,
    config_from_options,
    cut_note,
    log,
    open_engine,
    options_from_args,
)
from .outputs import FinishReason


def run(args: argparse.Namespace) -> int:
    """``logitproc generate``."""
    options = options_from_args(args, stdin=True)  # bad options fail before the model loads
    engine, defaults = open_engine(args)
    config = config_from_options(options, defaults.values)
    if args.no_chat_template:
        if args.system:
            raise ValueError("--system needs the chat template (drop --no-chat-template)")
        prompt: Any = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    output = None
    try:
        for delta in engine.stream(prompt, config):  # leaving the loop early (Ctrl-C, closed pipe) aborts it
            if delta.text:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            if delta.output is not None:
                output = delta.output
    finally:
        sys.stdout.write("\n")  # end the (maybe partial) answer's line
        sys.stdout.flush()
    if output is not None:
        cut = cut_note(output, config) if output.closing_note is None else None
        if output.closing_note is not None:
            log(f"note: {output.closing_note}")
        if cut:
            log(f"note: the answer was {cut}; raise --max-tokens for a longer one")
        st = output.stats
        log(f"finish: {output.finish_reason}; {st.prompt_tokens} prompt tokens at {st.prefill_tokens_per_s:.1f} tok/s, "
            f"{st.completion_tokens} tokens at {st.decode_tokens_per_s:.1f} tok/s, logit processing + sampling "
            f"{100 * st.processing_share:.1f}% of step time" + (f"; {st.draft_summary()}" if st.drafts else ""))
        if output.schema_valid is not None or output.schema_error is not None:
            relaxed = f" (not enforced while generating: {', '.join(output.relaxed_keywords)})" \
                if output.relaxed_keywords else ""
            verdict = {True: "valid", False: "INVALID", None: "not checked"}[output.schema_valid]
            log(f"schema: the answer is {verdict}{relaxed}"
                + (f": {output.schema_error}" if output.schema_error else ""))
        if output.finish_reason == FinishReason.ERROR:
            log(f"error: {output.error}")
            return 1
    return 0


def add_parser(commands: Any) -> None:
    """Register ``generate`` on the ``logitproc`` subcommand parsers."""
    parser = commands.add_parser("generate", help="answer one prompt: the answer on stdout, diagnostics on stderr",
                                 description="Answer one prompt: the answer on stdout, progress and statistics on "
                                             "stderr.")
    parser.add_argument("--prompt", required=True, help="the prompt (a user message unless --no-chat-template)")
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    parser.add_argument("--system", help="system prompt (default: the model's own, if its template has one)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="feed the prompt as raw text (default: the model's chat template)")
    parser.set_defaults(run=run)
