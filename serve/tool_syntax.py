"""How a model family writes tool calls, read from its chat template, and the grammar that makes its calls valid.

Families (``CallSyntax``), recognised by what their template writes for an assistant's ``tool_calls`` when it renders
a probe call (``detect_syntax``; a template that writes calls in another form, e.g. Qwen3-Coder's XML inside
``<tool_call>``, is none of them):

``hermes``        Hermes 2/3, Qwen2.5, Qwen3, QwQ: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
                  several calls one per block, separated by a newline.
``llama3_json``   Llama 3.1 / 3.2 / 3.3 with custom tools: the whole answer is ``{"name": ..., "parameters": {...}}``
                  (one call; the template refuses several).
``mistral_json``  Mistral v0.3 / Nemo: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. The template writes
                  each call's id into the list too (``, "id": "..."``: 9 alphanumerics, anything else it refuses);
                  the model writes calls without it, as Mistral's own outputs are, and the server gives the ids.
``mistral_args``  Mistral Small 3.2, Ministral 3, Devstral: ``[TOOL_CALLS]name[ARGS]{...}`` per call, the calls one
                  after another (Mistral Small 3.2's template also writes ``[CALL_ID]id`` before ``[ARGS]`` in the
                  history; the model writes the call without it).

``call_grammar`` writes a Lark grammar for llguidance in which each call is its envelope as the template writes it
(``{"name": "f", "arguments": `` ... ``}``, with ``", "`` and ``": "``; ``mistral_args``: ``f[ARGS]``) around the
arguments, ``%json`` of the function's parameter schema (its own root, so that its ``$ref``s resolve) laid out by the
request's whitespace policy (``ToolRequest.whitespace``: compact by default, no whitespace, as OpenAI returns
arguments; or flexible, any whitespace, at most 16 characters in a row; ``json_options``):

* ``required`` / a named function: the answer is one call, or with ``parallel_tool_calls`` several, from the first
  token;
* ``auto``: any text, or calls. For the marked syntaxes the text before the first marker (``<tool_call>``,
  ``[TOOL_CALLS]``) is a *lazy* lexeme (it ends at the first marker), so the text is free and everything from the
  marker on is constrained (as llguidance's structural tags do); for ``llama3_json`` an answer starting with ``{``
  is a call, any other is text.

A marker that is a control token of the vocabulary (``marker_tokens``: e.g. ``[TOOL_CALLS]``, or ``<tool_call>``
added as a special token) is matched as that token (``<[id]>`` in llguidance's Lark), never spelled out in text
pieces: free text cannot hold a control token, so it ends where the token comes and needs no lazy lexeme.

With ``reasoning`` (a thinking template), the grammar starts inside the think block (free text up to ``</think>``)
when the prompt opened it; under ``auto`` an answer may open one itself (``<think>`` ... ``</think>``) before its
text or calls. ``required`` and named calls open none themselves: the call comes first (a think block of unbounded
free text could not be closed in time at max_tokens; give ``thinking_token_budget`` to think first).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .chat_template import ChatTemplate
from .tool_definitions import FunctionTool, ToolChoice, ToolRequest

#: The characters of a Mistral tool call id (its templates refuse ids other than 9 of them).
ALPHANUMERIC = string.ascii_letters + string.digits


class CallSyntax(Enum):
    """A family's tool-call syntax."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL_JSON = "mistral_json"
    MISTRAL_ARGS = "mistral_args"

    @property
    def opener(self) -> str:
        """The marker (or, llama3_json, the character) a call, or the list of calls, starts with."""
        return {CallSyntax.HERMES: "<tool_call>", CallSyntax.LLAMA3_JSON: "{"}.get(self, "[TOOL_CALLS]")

    @property
    def marked(self) -> bool:
        """Calls start with a marker (text may come before them); llama3_json's call is the whole answer."""
        return self is not CallSyntax.LLAMA3_JSON

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker texts the syntax writes (a control token of the vocabulary is matched as the token)."""
        return {CallSyntax.HERMES: ("<tool_call>", "</tool_call>"), CallSyntax.LLAMA3_JSON: (),
                CallSyntax.MISTRAL_JSON: ("[TOOL_CALLS]",), CallSyntax.MISTRAL_ARGS: ("[TOOL_CALLS]", "[ARGS]")}[self]

    @property
    def arguments_key(self) -> str:
        """The key of the arguments in a call's JSON (mistral_args has none: its arguments follow ``[ARGS]``)."""
        return "parameters" if self is CallSyntax.LLAMA3_JSON else "arguments"

    def new_call_id(self) -> str:
        """A new call id: Mistral's 9 alphanumerics (its templates refuse others), else ``call_`` + 24 hex digits."""
        if self in (CallSyntax.MISTRAL_JSON, CallSyntax.MISTRAL_ARGS):
            return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))
        return "call_" + secrets.token_hex(12)


#: The probe conversation a template renders to show its call syntax: a call of ``probe_fn`` with {"x": 1}, answered.
PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_fn", "description": "a probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
#: Its id satisfies every template's rule (Mistral's: 9 alphanumerics).
PROBE_MESSAGES = (
    {"role": "user", "content": "probe question"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "probe0001", "type": "function", "function": {"name": "probe_fn", "arguments": {"x": 1}}}]},
    {"role": "tool", "tool_call_id": "probe0001", "name": "probe_fn", "content": "probe result"},
)
#: What each family's template writes for the probe call (the first found counts; Mistral's with its id).
PROBE_CALLS = ((CallSyntax.HERMES, '<tool_call>\n{"name": "probe_fn", "arguments": {"x": 1}}\n</tool_call>'),
               (CallSyntax.MISTRAL_JSON,
                '[TOOL_CALLS][{"name": "probe_fn", "arguments": {"x": 1}, "id": "probe0001"}]'),
               (CallSyntax.MISTRAL_ARGS, '[TOOL_CALLS]probe_fn[ARGS]{"x": 1}'),
               (CallSyntax.MISTRAL_ARGS, '[TOOL_CALLS]probe_fn[CALL_ID]probe0001[ARGS]{"x": 1}'),
               (CallSyntax.LLAMA3_JSON, '{"name": "probe_fn", "parameters": {"x": 1}}'))


def detect_syntax(template: ChatTemplate) -> CallSyntax | None:
    """The call syntax a chat template writes an assistant's ``tool_calls`` in, seen by rendering a probe call
    through it; None when it writes none of the known ones (or cannot render the probe)."""
    try:
        text = template.render(list(PROBE_MESSAGES), add_generation_prompt=False, tools=[PROBE_TOOL])
    except ValueError:
        return None
    return next((syntax for syntax, call in PROBE_CALLS if call in text), None)


@dataclass(frozen=True)
class ReasoningMarkers:
    """The think block's markers, and whether the answer starts inside the block (the prompt opened it)."""

    begin: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False


def arguments_options(whitespace: str, relaxed: bool = False) -> dict[str, Any]:
    """llguidance's JSON options (``x-guidance``) for a call's arguments under the whitespace policy ``whitespace``
    (``tool_definitions.ARGUMENT_WHITESPACE``), those of a JSON answer; ``relaxed``: keywords llguidance does not
    implement ignored, ``oneOf`` as ``anyOf``."""
    from logitproc.runtime.grammar.llguidance_backend import json_options  # the runtime loads with the model

    return json_options(relaxed, whitespace)


def _lark_string(text: str) -> str:
    return json.dumps(text)


class _Lark:
    """Lark pieces for markers: a control token of the vocabulary as ``<[id]>``, other text as a string."""

    def __init__(self, marker_tokens: Mapping[str, int]) -> None:
        self.tokens = marker_tokens

    def marker(self, text: str) -> str:
        token = self.tokens.get(text)
        return _lark_string(text) if token is None else f"<[{token}]>"

    def text_then(self, name: str, marker: str) -> list[str]:
        """Rule ``name``: free text up to and including ``marker`` (a lazy lexeme when the marker is text)."""
        if marker in self.tokens:  # free text never holds a control token: it ends where the token comes
            return [f"{name}: TEXT {self.marker(marker)}"]
        return [f"{name}[lazy]: TEXT {_lark_string(marker)}"]


def _calls(syntax: CallSyntax, tools: ToolRequest, lark: _Lark, relaxed: bool) -> list[str]:
    """Rule ``call`` (one call of any callable function) and its helpers: each function's envelope, as the template
    writes it, around ``arguments{i}``, the arguments' JSON."""
    options = arguments_options(tools.whitespace, relaxed)
    lines = ["call: " + " | ".join(f"call{i}" for i in range(len(tools.callable)))]
    for i, function in enumerate(tools.callable):
        if syntax is CallSyntax.MISTRAL_ARGS:
            lines.append(f"call{i}: {_lark_string(function.name)} {lark.marker('[ARGS]')} arguments{i}")
        else:
            head = f'{{"name": {json.dumps(function.name)}, "{syntax.arguments_key}": '
            lines.append(f'call{i}: {_lark_string(head)} arguments{i} "}}"')
        schema = json.dumps({**dict(function.parameters), "x-guidance": options}, separators=(",", ":"))
        lines.append(f"arguments{i}: %json {schema}")
    return lines


def _marked_calls(syntax: CallSyntax, tools: ToolRequest, lark: _Lark) -> list[str]:
    """Rule ``after_opener`` of a marked syntax: all the calls, less the first opener."""
    opener = lark.marker(syntax.opener)
    if syntax is CallSyntax.HERMES:
        close = lark.marker("</tool_call>")
        more = f' ("\\n" {opener} "\\n" call "\\n" {close})*' if tools.parallel else ""
        return [f'after_opener: "\\n" call "\\n" {close}{more}']
    if syntax is CallSyntax.MISTRAL_JSON:
        more = ' (", " call)*' if tools.parallel else ""
        return [f'after_opener: "[" call{more} "]"']
    more = f" ({opener} call)*" if tools.parallel else ""
    return [f"after_opener: call{more}"]


def call_grammar(syntax: CallSyntax, tools: ToolRequest, reasoning: ReasoningMarkers | None = None,
                 marker_tokens: Mapping[str, int] | None = None, relaxed: bool = False) -> str:
    """The Lark grammar (llguidance) of an answer to ``tools`` (see the module doc); ``tools.calls_expected``.
    ``marker_tokens``: the markers that are control tokens of the vocabulary, by text, with their ids;
    ``relaxed``: the arguments' schemas compiled leniently (``arguments_options``)."""
    lark = _Lark(marker_tokens or {})
    free = tools.choice is ToolChoice.AUTO
    lines = ["%llguidance {}", *_calls(syntax, tools, lark, relaxed)]
    if syntax.marked:
        lines += _marked_calls(syntax, tools, lark)
        if free:
            lines += ["answer: TEXT | first", "first: opener after_opener", *lark.text_then("opener", syntax.opener)]
        else:
            lines += [f"answer: {lark.marker(syntax.opener)} after_opener"]
    else:
        lines += ["answer: TEXT_NOT_CALL | call" if free else "answer: call"]
        lines += ["TEXT_NOT_CALL: /([^{\\s]|\\s+[^{\\s])(?s:.*)/ | /\\s*/"]
    lines += ["TEXT: /(?s:.*)/"]
    if reasoning is None:
        lines.insert(1, "start: answer")
    else:
        lines += [*lark.text_then("thought", reasoning.end), "AFTER_THOUGHT: /\\s*/"]
        if reasoning.starts_inside:
            lines.insert(1, "start: thought AFTER_THOUGHT answer")
        elif not free:  # a call from the first token: no think block opened by the answer itself
            lines.insert(1, "start: answer")
        else:
            lines.insert(1, f"start: ({lark.marker(reasoning.begin)} thought AFTER_THOUGHT)? answer")
    return "\n".join(lines) + "\n"


def arguments_problem(function: FunctionTool, arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not validate against the function's parameters (None: they do), checked with
    ``jsonschema`` as a JSON answer is (``runtime.answer_check``)."""
    from logitproc.runtime.answer_check import check_answer
    from logitproc.runtime.response_format import ResponseFormat

    check = check_answer(ResponseFormat.json_schema(dict(function.parameters)), json.dumps(arguments))
    if check is None or check.valid:
        return None
    return check.error or "not checked"
