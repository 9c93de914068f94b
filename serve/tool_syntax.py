"""How a model family writes tool calls, read from its chat template, and the grammar that makes its calls valid.

Families (``CallSyntax``), recognised by what their template writes for an assistant's ``tool_calls`` when it renders
a probe call (``detect_syntax``; a template that writes calls in another form, e.g. Qwen3-Coder's XML inside
``<tool_call>``, is none of them):

``hermes``       Hermes 2/3, Qwen2.5, Qwen3, QwQ: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
                 several calls one per block, separated by a newline.
``llama3_json``  Llama 3.1 / 3.2 / 3.3 with custom tools: the whole answer is ``{"name": ..., "parameters": {...}}``
                 (one call; the template refuses several).

``call_grammar`` writes a Lark grammar for llguidance in which each call's JSON is ``%json`` of a schema fixing the
name (``const``) and the arguments (the function's parameter schema), written as the template writes it
(``", "`` and ``": "`` separators, no other whitespace):

* ``required`` / a named function: the answer is one call, or with ``parallel_tool_calls`` several, from the first
  token;
* ``auto``: any text, or calls. For ``hermes`` the text before the first ``<tool_call>`` is a *lazy* lexeme (it
  ends at the first ``<tool_call>``), so the text is free and everything from the marker on is constrained (as
  llguidance's structural tags do); for ``llama3_json`` an answer starting with ``{`` is a call, any other is text.

With ``reasoning`` (a thinking template), the grammar starts inside the think block (free text up to ``</think>``)
when the prompt opened it; under ``auto`` an answer may open one itself (``<think>`` ... ``</think>``) before its
text or calls. ``required`` and named calls open none themselves: the call comes first (a think block of unbounded
free text could not be closed in time at max_tokens; give ``thinking_token_budget`` to think first).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .chat_template import ChatTemplate
from .tool_definitions import FunctionTool, ToolChoice, ToolRequest

#: llguidance's JSON options inside ``%json``: the separators templates write with ``tojson``, no other whitespace.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class CallSyntax(Enum):
    """A family's tool-call syntax."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"

    @property
    def opener(self) -> str:
        """The text a call starts with."""
        return "<tool_call>" if self is CallSyntax.HERMES else "{"

    @property
    def arguments_key(self) -> str:
        """The key of the arguments in a call's JSON."""
        return "arguments" if self is CallSyntax.HERMES else "parameters"


#: The probe conversation a template renders to show its call syntax: a call of ``probe_fn`` with {"x": 1}, answered.
PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_fn", "description": "a probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
PROBE_MESSAGES = (
    {"role": "user", "content": "probe question"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_probe", "type": "function", "function": {"name": "probe_fn", "arguments": {"x": 1}}}]},
    {"role": "tool", "tool_call_id": "call_probe", "name": "probe_fn", "content": "probe result"},
)
#: What each family's template writes for the probe call.
PROBE_CALLS = ((CallSyntax.HERMES, '<tool_call>\n{"name": "probe_fn", "arguments": {"x": 1}}\n</tool_call>'),
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


def _call_schema(syntax: CallSyntax, function: FunctionTool) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": function.name},
                                             syntax.arguments_key: dict(function.parameters)},
            "required": ["name", syntax.arguments_key], "additionalProperties": False}


def calls_schema(syntax: CallSyntax, functions: tuple[FunctionTool, ...]) -> dict[str, Any]:
    """The JSON Schema of one call of any of ``functions`` (with llguidance's layout options)."""
    schemas = [_call_schema(syntax, f) for f in functions]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {**schema, "x-guidance": JSON_LAYOUT}


def _lark_string(text: str) -> str:
    return json.dumps(text)


def call_grammar(syntax: CallSyntax, tools: ToolRequest, reasoning: ReasoningMarkers | None = None) -> str:
    """The Lark grammar (llguidance) of an answer to ``tools`` (see the module doc); ``tools.calls_expected``."""
    body = "%json " + json.dumps(calls_schema(syntax, tools.callable), separators=(",", ":"))
    free = tools.choice is ToolChoice.AUTO
    lines = ["%llguidance {}"]
    if syntax is CallSyntax.HERMES:
        more = ' ("\\n" call)*' if tools.parallel else ""
        lines += ['call: "<tool_call>\\n" body "\\n</tool_call>"',
                  f'calls: call{more}']
        if free:
            lines += ['answer: TEXT | first' + (' ("\\n" call)*' if tools.parallel else ""),
                      'first: opener "\\n" body "\\n</tool_call>"',
                      'opener[lazy]: TEXT "<tool_call>"']
        else:
            lines += ["answer: calls"]
    else:
        lines += ["call: body"]
        lines += ["answer: TEXT_NOT_CALL | call" if free else "answer: call"]
        lines += ["TEXT_NOT_CALL: /([^{\\s]|\\s+[^{\\s])(?s:.*)/ | /\\s*/"]
    lines += [f"body: {body}", "TEXT: /(?s:.*)/"]
    if reasoning is None:
        lines.insert(1, "start: answer")
    else:
        end = _lark_string(reasoning.end)
        lines += [f"thought[lazy]: TEXT {end}", "AFTER_THOUGHT: /\\s*/"]
        if reasoning.starts_inside:
            lines.insert(1, "start: thought AFTER_THOUGHT answer")
        elif not free:  # a call from the first token: no think block opened by the answer itself
            lines.insert(1, "start: answer")
        else:
            lines.insert(1, f"start: ({_lark_string(reasoning.begin)} thought AFTER_THOUGHT)? answer")
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
