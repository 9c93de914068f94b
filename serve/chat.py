"""``logitproc chat``: an interactive chat with history, streaming answers and slash commands.

Ctrl-C during an answer stops that answer (the REPL stays); Ctrl-C at the prompt asks for a second one (or /exit)
to quit; Ctrl-D quits. A bad command or value prints one line saying what is wrong, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import signal
import sys
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any, TextIO

from .cli_options import (
    add_model_arguments,
    add_sampling_arguments,
    config_from_options,
    cut_note,
    json_schema_format,
    open_engine,
    options_from_args,
    read_schema,
)
from .model_defaults import ModelDefaults
from .outputs import FinishReason
from .progress_line import ProgressLine

PROMPT = ">>> "
#: A prompt this long shows its prefill's progress on a terminal.
LONG_PROMPT_TOKENS = 512

# command -> (GenerationConfig field, parser of the value; "off"/"none" sets None where the field allows it)
NUMERIC_COMMANDS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "repetition_penalty": ("repetition_penalty", float),
    "seed": ("seed", int),
    "max_tokens": ("max_tokens", int),
    "min_tokens": ("min_tokens", int),
}
NULLABLE = {"seed", "max_tokens", "max_thinking_tokens"}

HELP = """\
Type a message to chat. Commands (a command without a value shows the current one):
  /temperature X  /top_p X  /top_k N  /min_p X    sampling (temperature 0 = greedy)
  /presence_penalty X  /frequency_penalty X  /repetition_penalty X
  /logit_bias TOKEN_OR_ID=BIAS ...  (or: /logit_bias clear)   bias tokens, e.g. /logit_bias Paris=5 42=-100
  /seed N|off   /max_tokens N|off   /min_tokens N (no EOS or stop before N tokens)
  /stop TEXT ...                stop strings, quoted when they hold spaces; \\n is a newline (/stop clear)
  /bad_words WORD ...           never write these words (/bad_words clear)
  /system TEXT                  the system prompt (/system off)
  /json FILE_OR_INLINE_SCHEMA   constrain answers to a JSON schema (/json object: any JSON object; /json off)
  /regex PATTERN                constrain answers to a regular expression (/regex off)
  /think N|off                  thinking budget between <think> and </think>
  /stats      prefill and decode tokens/s, share of step time in logit processing, speculation's acceptance
  /settings   show the current settings        /reset   clear the history
  /help       this text                        /exit    quit (also Ctrl-D)
Ctrl-C stops the answer being written; at the prompt, press it twice (or /exit) to quit."""


def unescape(text: str) -> str:
    """``\\n``, ``\\t`` and ``\\\\`` in a typed value as the characters they name."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), "\\"), text)


def describe(field: str, value: Any) -> str:
    """A setting as the user would type it: response formats as their JSON, mappings as dicts."""
    if field == "response_format" and value is not None:
        if value.kind == "json_schema":
            return f"JSON schema {json.dumps(value.schema, separators=(',', ':'))}"
        if value.kind == "json_object":
            return "any JSON object"
        return f"{value.kind} {value.text!r}"
    if field == "logit_bias":
        return str(dict(value))
    return "off" if value is None and field in NULLABLE else repr(value) if isinstance(value, str) else str(value)


class CommandError(ValueError):
    """A bad slash command or value; its text is shown to the user as one line."""


class ChatSession:
    """The REPL's state: engine, current GenerationConfig, history; ``handle(line)`` runs one input line."""

    def __init__(self, engine: Any, config: Any, system: str | None = None, out: TextIO = sys.stdout,
                 defaults: ModelDefaults | None = None) -> None:
        self.engine = engine
        self.config = config
        self.system = system
        self.out = out
        self.defaults = defaults
        self.history: list[dict[str, str]] = []
        self.last_output: Any = None
        self.running = True
        self._interrupted = False
        self._commands: dict[str, Callable[[str], None]] = {
            "logit_bias": self._logit_bias, "bad_words": self._bad_words, "stop": self._stop,
            "system": self._system, "json": self._json, "regex": self._regex, "think": self._think,
            "stats": self._stats, "settings": self._settings, "reset": self._reset, "help": self._help,
            "exit": self._exit, "quit": self._exit,
        }  # fmt: skip

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    # --------------------------------------------------------------------------------------------- input lines
    def handle(self, line: str) -> None:
        """One line of input: a slash command, or a message to answer."""
        line = line.strip()
        if not line:
            return
        try:
            if line.startswith("/"):
                name, _, arg = line[1:].partition(" ")
                self.command(name.strip(), arg.strip())
            else:
                self.answer(line)
        except (ValueError, TypeError) as err:  # a bad value, or a request the engine refused: one line
            self.say(f"error: {' '.join(str(err).split())}")

    def command(self, name: str, arg: str) -> None:
        if name in NUMERIC_COMMANDS:
            field, kind = NUMERIC_COMMANDS[name]
            if not arg:
                self._show(field)
            else:
                self._set(field, self._value(name, arg, kind, nullable=field in NULLABLE))
        elif name in self._commands:
            self._commands[name](arg)
        else:
            raise CommandError(f"unknown command /{name}; /help lists the commands")

    @staticmethod
    def _value(name: str, arg: str, kind: type, nullable: bool) -> Any:
        if nullable and arg.lower() in ("off", "none"):
            return None
        try:
            return kind(arg)
        except ValueError:
            raise CommandError(f"/{name}: {arg!r} is not {'a number' if kind is float else 'an integer'}") from None

    def _show(self, field: str) -> None:
        self.say(f"{field} = {describe(field, getattr(self.config, field))}")

    def _set(self, field: str, value: Any) -> None:
        self.config = replace(self.config, **{field: value})  # GenerationConfig validates: ValueError naming it
        self._show(field)

    def _logit_bias(self, arg: str) -> None:
        if not arg:
            self._show("logit_bias")
            return
        if arg.lower() in ("clear", "off", "none"):
            self._set("logit_bias", {})
            return
        bias = dict(self.config.logit_bias)
        for item in arg.split():
            token, sep, value = item.rpartition("=")
            if not sep or not token:
                raise CommandError(f"/logit_bias: {item!r} is not TOKEN_OR_ID=BIAS")
            try:
                bias[self._token_id(token)] = float(value)
            except ValueError:
                raise CommandError(f"/logit_bias: {value!r} is not a number") from None
        self._set("logit_bias", bias)

    def _bad_words(self, arg: str) -> None:
        if not arg:
            self._show("bad_words")
        else:
            self._set("bad_words", () if arg.lower() == "clear" else tuple(arg.split()))

    def _stop(self, arg: str) -> None:
        if not arg:
            self._show("stop")
        elif arg.lower() in ("clear", "off", "none"):
            self._set("stop", ())
        else:
            lexer = shlex.shlex(arg, posix=True)
            lexer.whitespace_split, lexer.escape = True, ""  # quotes group words; backslashes stay for unescape
            try:
                words = list(lexer)
            except ValueError as err:
                raise CommandError(f"/stop: {err}") from None
            self._set("stop", tuple(unescape(word) for word in words))

    def _system(self, arg: str) -> None:
        if arg.lower() in ("off", "none"):
            self.system = None
        elif arg:
            self.system = arg
        self.say(f"system = {self.system!r}" if self.system else "system = none (the model's default)")

    def _token_id(self, token: str) -> int:
        if token.isdigit():
            return int(token)
        tokenizer = self.engine.model.tokenizer
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
        ids = tokenizer.encode(token, add_special_tokens=False).ids
        if len(ids) != 1:
            raise CommandError(f"/logit_bias: {token!r} is {len(ids)} tokens {ids}; give one token or its id")
        return int(ids[0])

    def _json(self, arg: str) -> None:
        if not arg:
            self._show("response_format")
        elif arg.lower() == "off":
            self._set("response_format", None)
        elif arg.lower() == "object":
            self._set("response_format", {"type": "json_object"})
        else:
            self._set("response_format", json_schema_format(read_schema(arg)))

    def _regex(self, arg: str) -> None:
        if not arg:
            self._show("response_format")
        else:
            self._set("response_format", None if arg == "off" else {"type": "regex", "regex": arg})

    def _think(self, arg: str) -> None:
        if not arg:
            self._show("max_thinking_tokens")
        else:
            self._set("max_thinking_tokens", self._value("think", arg, int, nullable=True))

    def _stats(self, arg: str) -> None:
        self.say(f"engine: {self.engine.stats.summary()}")
        if self.last_output is not None:
            st = self.last_output.stats
            self.say(f"last answer: {st.prompt_tokens} prompt tok ({st.cached_tokens} from the prefix cache) at "
                     f"{st.prefill_tokens_per_s:.1f} tok/s, "
                     f"{st.completion_tokens} tok at {st.decode_tokens_per_s:.1f} tok/s, "
                     f"logit processing + sampling {100 * st.processing_share:.1f}% of step time, "
                     + (f"{st.draft_summary()}, " if st.drafts else "")
                     + f"finish: {self.last_output.finish_reason}")
            out = self.last_output
            if out.schema_valid is not None or out.schema_error is not None:
                self.say(f"schema: {({True: 'valid', False: 'INVALID', None: 'not checked'})[out.schema_valid]}"
                         + (f" (relaxed: {', '.join(out.relaxed_keywords)})" if out.relaxed_keywords else "")
                         + (f": {out.schema_error}" if out.schema_error else ""))
            if out.closing_note is not None:
                self.say(f"document: {out.closing_note}")

    def _settings(self, arg: str) -> None:
        from logitproc.runtime import GenerationConfig

        default = GenerationConfig()
        changed = [f.name for f in fields(self.config) if getattr(self.config, f.name) != getattr(default, f.name)]
        for name in changed or ["temperature"]:
            self._show(name)
        if self.defaults is not None:
            self.say(f"model defaults: {self.defaults.describe()}")
        self.say(f"system: {self.system!r}" if self.system else "system: none (the model's default)")
        self.say(f"history: {len(self.history)} messages; model: {self.engine.model.name}")

    def _reset(self, arg: str) -> None:
        self.history.clear()
        self.say("history cleared")

    def _help(self, arg: str) -> None:
        self.say(HELP)

    def _exit(self, arg: str) -> None:
        self.running = False

    # --------------------------------------------------------------------------------------------- answers
    def _messages(self, text: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history + [{"role": "user", "content": text}]

    def _fitting_messages(self, text: str) -> list[dict[str, str]]:
        """The conversation, dropping the oldest exchanges while the prompt does not fit in the context."""
        while True:
            messages = self._messages(text)
            room = self.engine.context_length - len(self.engine.tokenize(messages))
            if room > min(self.config.max_tokens or 64, 64) or not self.history:
                return messages
            del self.history[:2]

    def interrupt(self, signum: int = 0, frame: Any = None) -> None:
        """SIGINT during an answer: stop it after the current step."""
        self._interrupted = True

    def answer(self, text: str) -> None:
        """Stream the model's answer to ``text``; Ctrl-C stops it (the partial answer stays in the history)."""
        engine = self.engine
        rid = engine.add_request(self._fitting_messages(text), self.config)  # ValueError -> one line (handle)
        self._interrupted = False
        previous = signal.signal(signal.SIGINT, self.interrupt)
        parts: list[str] = []
        output = None
        terminal = answer_terminal(sys.stdin)  # Ctrl-C must not echo into the answer, nor drop what it wrote
        reading: ProgressLine | None = None  # a long prompt's progress, on a terminal, until the answer begins
        try:
            while output is None:
                if self._interrupted:
                    engine.abort(rid)
                for delta in engine.step():  # a long prompt goes in by chunks: Ctrl-C acts between them
                    if delta.request_id != rid:
                        continue
                    if delta.text:
                        if reading is not None:  # the answer begins: the progress line goes
                            reading.close()
                            reading = None
                        parts.append(delta.text)
                        write_whole(self.out, delta.text)
                    if delta.output is not None:
                        output = delta.output
                going_in = engine.prompt_progress(rid) if output is None and not parts else None
                if going_in is not None and going_in[1] >= LONG_PROMPT_TOKENS:
                    reading = reading or ProgressLine(self.out)
                    reading.status(f"reading the prompt: {going_in[0]:,} of {going_in[1]:,} tokens")
        except BaseException:
            engine.abort(rid)  # never leave it running: the next step frees its slot
            raise
        finally:
            signal.signal(signal.SIGINT, previous)
            if self._interrupted:
                terminal.discard_typed()
            terminal.close()
            if reading is not None:
                reading.close()
        cut = "closed to fit max_tokens" if output.closed_at_max_tokens and output.grammar_complete else cut_note(
            output, self.config)
        self.say(" [stopped]" if output.finish_reason == FinishReason.ABORT else f" [{cut}]" if cut else "")
        if output.finish_reason == FinishReason.GRAMMAR_DEAD_END:
            self.say("(the constraint allowed no further token)")
        elif output.finish_reason == FinishReason.ERROR:
            self.say(f"(the constraint failed: {output.error})")
        self.last_output = output
        self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": "".join(parts)}]


def write_whole(out: TextIO, text: str) -> None:
    """Write ``text`` to ``out`` and flush it, Ctrl-C (SIGINT) held back meanwhile (delivered right after).

    A write to a terminal that a signal interrupts part-way returns short, and an unbuffered stdout (``python -u``,
    ``PYTHONUNBUFFERED=1``: a TextIOWrapper straight over the raw file) drops the rest of it: measured through a
    pseudo-terminal with a Ctrl-C every 20 ms, a chunk of an answer lost its last 184 bytes (a character cut in two)
    in about one run in three. With the signal held back the write is never interrupted."""
    if sys.platform == "win32":  # no signal masks; no such partial writes to a console either
        out.write(text)
        out.flush()
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        out.write(text)
        out.flush()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class answer_terminal(contextlib.AbstractContextManager):  # noqa: N801 (used like a function)
    """While an answer is written to a terminal ``stream``, Ctrl-C neither echoes into it nor discards any of it.

    A terminal's defaults damage the answer at Ctrl-C (measured on Linux through a pseudo-terminal, a writer of
    multi-byte text and a ^C every 20 ms): the echo of ^C (two characters ``^C``, or the raw byte 0x03 with
    ``ECHOCTL`` off) is inserted into the output wherever the writer is, between the bytes of a character too; and
    the interrupt flushes the terminal's queues, dropping output already written (hundreds of kilobytes there, and
    a character's first bytes without its last). Deferring the signal in the program cannot help: both happen in the
    terminal when the key is pressed. So while open: no echo (``ECHO`` off: keys typed during the answer are not
    echoed into it either; ``input()`` shows them at the next prompt) and no flush at an interrupt (``NOFLSH``);
    ``discard_typed()`` drops what was typed meanwhile, as the interrupt's flush used to. Nothing for a pipe."""

    def __init__(self, stream: TextIO) -> None:
        self._fd: int | None = None
        if sys.platform == "win32" or not stream.isatty():
            return  # a pipe, a file, a test's StringIO: nothing is echoed
        import termios

        self._fd = stream.fileno()
        self._saved = termios.tcgetattr(self._fd)
        quiet = list(self._saved)
        quiet[3] = (quiet[3] & ~termios.ECHO) | termios.NOFLSH
        termios.tcsetattr(self._fd, termios.TCSANOW, quiet)

    def discard_typed(self) -> None:
        """Drop the input typed since the answer began (after a Ctrl-C, as the terminal's own flush would)."""
        if self._fd is not None:
            import termios

            termios.tcflush(self._fd, termios.TCIFLUSH)

    def close(self) -> None:
        """The terminal's own settings back, once the answer's output has gone to it (``TCSADRAIN``)."""
        if self._fd is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
            self._fd = None

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_repl(session: ChatSession) -> int:
    """Read lines until /exit, Ctrl-D or two Ctrl-C in a row at the prompt."""
    interrupts = 0
    while session.running:
        try:
            line = input(PROMPT)
        except EOFError:
            session.say("")
            break
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts >= 2:
                session.say("")
                break
            session.say("\n(Ctrl-C again or /exit to quit)")
            continue
        interrupts = 0
        try:
            session.handle(line)
        except KeyboardInterrupt:  # outside an answer (e.g. while a grammar compiles)
            session.say("\n[interrupted]")
    return 0


def run(args: argparse.Namespace) -> int:
    """``logitproc chat``."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    options = options_from_args(args)  # bad options fail before the model loads
    engine, defaults = open_engine(args)
    config = config_from_options(options, defaults.values)
    if args.think is not None:
        config = replace(config, max_thinking_tokens=args.think)
    session = ChatSession(engine, config, system=args.system, defaults=defaults)
    session.say(f"logitproc chat: {engine.model.name} on {args.target}; model defaults: {defaults.describe()}. "
                "/help lists the commands, /settings shows them, /exit quits.")
    return run_repl(session)


def add_parser(commands: Any) -> None:
    """Register ``chat`` on the ``logitproc`` subcommand parsers."""
    parser = commands.add_parser("chat", help="chat with a model in the terminal (streaming, slash commands)",
                                 description="Chat with a model in the terminal: streaming answers, slash commands "
                                             "(/help lists them), the history kept between turns.")
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    parser.add_argument("--system", help="system prompt (default: the model's own, if its template has one)")
    parser.add_argument("--think", type=int, default=None, help="thinking budget in tokens (default: none)")
    parser.set_defaults(run=run)


__all__ = ["ChatSession", "add_parser", "run", "run_repl"]
