"""An assistant's answer text split, as it streams, into reasoning, content and tool calls (OpenAI's message parts).

``AnswerParser.feed(text)`` takes the next piece of the answer and returns what became certain (:class:`AnswerDelta`:
reasoning text, content text, tool-call pieces); ``finish()`` releases what was held back. A non-streamed answer is
the same parser fed the whole text at once, so streamed deltas, accumulated as the openai client does, give the same
message as the non-streamed response.

* Reasoning (``ReasoningMarkers``): the text inside the think block, which the answer either starts inside (the
  prompt opened it) or opens first (leading whitespace, then the begin marker). Text that may be the start of a
  marker is held back until it is known; whitespace around the reasoning and right after the end marker is
  dropped (templates strip it when they render the turn again).
* Calls (``CallSyntax``; only when calls are expected, i.e. the grammar of ``tool_syntax.call_grammar`` made them):
  a call's first piece carries its index, a new id (``CallSyntax.new_call_id``: ``call_`` + 24 hex digits, or
  Mistral's 9 alphanumerics) and the function's name, as soon as the name is complete; then the arguments' JSON
  text comes in fragments, exactly as generated (the grammar wrote it valid). A call counts as complete when its
  JSON closed and parsed; one cut short (max_tokens too small to close it) is ``incomplete`` and is not part of the
  message's ``tool_calls``. The markers are read as text: a marker that is a control token reaches the parser only
  when the detokenizer keeps control tokens (``skip_special_tokens=False``, which the turn asks for then).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum

from .tool_syntax import CallSyntax, ReasoningMarkers

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
#: mistral_args: the function's name, then ``[ARGS]`` (the template may write ``[CALL_ID]id`` between them).
_ARGS_NAME = re.compile(r"\s*([^\[\s]*)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")


@dataclass
class CallPiece:
    """A piece of the call at ``index``: its id and name in its first piece, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class AnswerDelta:
    """What a piece of answer text added to each part of the message."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class ToolCall:
    """A call as the message gives it; ``complete`` once its JSON closed and parsed."""

    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def body(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _Phase(Enum):
    START = "start"  # nothing certain yet (a think block or a call may open)
    REASONING = "reasoning"
    AFTER_REASONING = "after_reasoning"  # whitespace after the end marker is dropped
    CONTENT = "content"
    CALL = "call"
    BETWEEN_CALLS = "between_calls"
    LIST = "list"  # mistral_json: after [TOOL_CALLS], before the list's "["
    AFTER_CALLS = "after_calls"  # mistral_json: the list closed; what follows is content


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker`` (and so are held back)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class _ValueEnd:
    """Where a JSON value ends, found incrementally (strings, escapes and nesting followed byte by byte)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def feed(self, text: str) -> int | None:
        """The index in ``text`` just past the value's end, or None if it has not ended yet."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if ch.isspace() and not self.started:
                continue
            self.started = True
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.depth == 0 and ch in ",}":
                return i
        return None


class AnswerParser:
    """Splits one answer (see the module doc). ``syntax`` None: no calls are parsed (the text is content)."""

    def __init__(self, syntax: CallSyntax | None = None, reasoning: ReasoningMarkers | None = None) -> None:
        self.syntax = syntax
        self.markers = reasoning
        self.reasoning = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self._buffer = ""  # text not yet given out
        self._reset_call()
        self._phase = _Phase.START  # a think block or (llama3_json) a call may open
        if reasoning is not None and reasoning.starts_inside:
            self._phase = _Phase.REASONING
        elif reasoning is None and syntax is not CallSyntax.LLAMA3_JSON:
            self._phase = _Phase.CONTENT

    # ------------------------------------------------------------------------------------------ the message
    @property
    def incomplete(self) -> bool:
        """A call was started and not completed (its answer was cut)."""
        return any(not c.complete for c in self.calls)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if c.complete]

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's finish reason: "tool_calls" when the answer is complete calls, else the engine's."""
        if self.tool_calls and not self.incomplete and engine_reason in ("stop", "length"):
            return "tool_calls"
        return engine_reason

    # ------------------------------------------------------------------------------------------ parsing
    def feed(self, text: str) -> AnswerDelta:
        delta = AnswerDelta()
        self._buffer += text
        while self._step(delta):
            pass
        return delta

    def finish(self) -> AnswerDelta:
        """The end of the answer: what was held back is given out as what it was inside of."""
        delta = AnswerDelta()
        rest, self._buffer = self._buffer, ""
        if self._phase is _Phase.REASONING:
            self._add_reasoning(delta, rest)
        elif self._phase in (_Phase.START, _Phase.CONTENT):
            self._add_content(delta, rest)
        return delta

    def _add_reasoning(self, delta: AnswerDelta, text: str) -> None:
        self.reasoning += text
        delta.reasoning += text

    def _add_content(self, delta: AnswerDelta, text: str) -> None:
        self.content += text
        delta.content += text

    def _step(self, delta: AnswerDelta) -> bool:
        """Handle what the buffer holds in the current phase; True if the phase changed (go on)."""
        phase, buf = self._phase, self._buffer
        if phase is _Phase.START:
            return self._start(delta)
        if phase is _Phase.REASONING:
            assert self.markers is not None
            if not self.reasoning:  # whitespace right after the begin marker is dropped
                buf = self._buffer = buf.lstrip()
            end = buf.find(self.markers.end)
            if end < 0:  # held back: what may start the end marker, and the whitespace before it
                body = buf[: len(buf) - _held(buf, self.markers.end)]
                body = body.rstrip()
                self._add_reasoning(delta, body)
                self._buffer = buf[len(body):]
                return False
            self._add_reasoning(delta, buf[:end].rstrip())
            self._buffer = buf[end + len(self.markers.end):]
            self._phase = _Phase.AFTER_REASONING
            return True
        if phase is _Phase.AFTER_REASONING:
            self._buffer = buf.lstrip()
            if not self._buffer:
                return False
            self._phase = _Phase.START if self.syntax is CallSyntax.LLAMA3_JSON else _Phase.CONTENT
            return True
        if phase is _Phase.CONTENT:
            return self._content(delta)
        if phase is _Phase.CALL:
            return self._in_call(delta)
        if phase is _Phase.LIST:
            stripped = buf.lstrip()
            if not stripped:
                return False
            if stripped.startswith("["):
                self._buffer = stripped[1:]
                self._open_call()
            else:  # not a list (never under the call grammar): the rest is content
                self._phase = _Phase.AFTER_CALLS
            return True
        if phase is _Phase.AFTER_CALLS:
            self._add_content(delta, buf)
            self._buffer = ""
            return False
        return self._between_calls(delta)

    def _start(self, delta: AnswerDelta) -> bool:
        """The answer's first characters: a think block opening, a call opening (llama3_json), or content."""
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if self.markers is not None and not self.reasoning and not self.content:
            begin = self.markers.begin
            if stripped.startswith(begin):
                self._buffer = stripped[len(begin):]
                self._phase = _Phase.REASONING
                return True
            if begin.startswith(stripped):
                return False  # may still be the begin marker
        if self.syntax is CallSyntax.LLAMA3_JSON and not self.content and stripped.startswith("{"):
            self._buffer = stripped
            self._open_call()
            return True
        self._phase = _Phase.CONTENT
        return True

    def _content(self, delta: AnswerDelta) -> bool:
        buf = self._buffer
        if self.syntax is None or not self.syntax.marked:
            self._add_content(delta, buf)
            self._buffer = ""
            return False
        opener = self.syntax.opener
        at = buf.find(opener)
        if at < 0:
            keep = _held(buf, opener)
            self._add_content(delta, buf[: len(buf) - keep])
            self._buffer = buf[len(buf) - keep:]
            return False
        self._add_content(delta, buf[:at])
        self._buffer = buf[at + len(opener):]
        self._open_calls()
        return True

    def _open_calls(self) -> None:
        """After the first opener: mistral_json's list opens ("[" is held until it comes), else the first call."""
        if self.syntax is CallSyntax.MISTRAL_JSON:
            self._phase = _Phase.LIST
        else:
            self._open_call()

    def _open_call(self) -> None:
        self._phase = _Phase.CALL
        self._reset_call()

    def _reset_call(self) -> None:
        self._call = ""
        self._named_end: int | None = None  # where the name ends in _call (its piece was given out)
        self._arguments_at: int | None = None
        self._arguments_end: int | None = None
        self._value = _ValueEnd()

    def _in_call(self, delta: AnswerDelta) -> bool:
        assert self.syntax is not None
        self._call += self._buffer
        self._buffer = ""
        call = self._call
        if self._named_end is None:
            bare = self.syntax is CallSyntax.MISTRAL_ARGS
            named = (_ARGS_NAME if bare else _NAME).match(call)
            if named is None:
                return False
            name = named.group(1) if bare else json.loads(f'"{named.group(1)}"')
            self.calls.append(ToolCall(self.syntax.new_call_id(), name))
            delta.calls.append(CallPiece(len(self.calls) - 1, self.calls[-1].id, name))
            self._named_end = named.end()
            if bare:
                self._arguments_at = named.end()
        if self._arguments_at is None:
            key = re.compile(rf'\s*,\s*"{self.syntax.arguments_key}"\s*:\s*').match(call, self._named_end)
            if key is None or key.end() == len(call):
                return False
            self._arguments_at = key.end()
        current = self.calls[-1]
        if self._arguments_end is None:
            start = self._arguments_at + len(current.arguments)
            end = self._value.feed(call[start:])
            piece = call[start:] if end is None else call[start:start + end]
            if piece:
                current.arguments += piece
                if delta.calls and delta.calls[-1].index == len(self.calls) - 1:
                    delta.calls[-1].arguments += piece
                else:
                    delta.calls.append(CallPiece(len(self.calls) - 1, arguments=piece))
            if end is None:
                return False
            self._arguments_end = self._arguments_at + len(current.arguments)
        return self._close_call(call[self._arguments_end:])

    def _close_call(self, tail: str) -> bool:
        """After the arguments: the rest of the call's JSON (none for mistral_args), then (hermes) the closing
        marker."""
        stripped = tail.lstrip()
        if self.syntax is CallSyntax.MISTRAL_ARGS:
            rest = tail
        elif not stripped.startswith("}"):
            return False
        else:
            rest = stripped[1:]
        if self.syntax is CallSyntax.HERMES:
            rest = rest.lstrip()
            if not rest.startswith("</tool_call>"):
                return False
            rest = rest[len("</tool_call>"):]
        current = self.calls[-1]
        try:
            current.complete = isinstance(json.loads(current.arguments), dict)
        except ValueError:
            current.complete = False
        self._buffer = rest
        self._call = ""
        self._phase = _Phase.BETWEEN_CALLS
        return True

    def _between_calls(self, delta: AnswerDelta) -> bool:
        stripped = self._buffer.lstrip()
        if not stripped:
            self._buffer = ""
            return False
        assert self.syntax is not None
        if self.syntax is CallSyntax.MISTRAL_JSON:  # ", " and the next call, or the list's end
            if stripped.startswith(","):
                self._buffer = stripped[1:]
                self._open_call()
            elif stripped.startswith("]"):
                self._buffer = stripped[1:]
                self._phase = _Phase.AFTER_CALLS
            else:
                self._buffer = stripped
                self._phase = _Phase.AFTER_CALLS
            return True
        opener = self.syntax.opener
        if stripped.startswith(opener):
            self._buffer = stripped[len(opener):]
            self._open_call()
            return True
        if opener.startswith(stripped):
            return False
        # text after the calls (not written under the call grammar): it and everything after it is content, as the
        # whole answer parsed at once would give (a later piece's leading whitespace is kept)
        self._add_content(delta, stripped)
        self._buffer = ""
        self._phase = _Phase.AFTER_CALLS
        return False
