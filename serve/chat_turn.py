"""One assistant turn of a chat request: what the model's template can do (tool-call syntax, a think block), the
generation config that constrains its calls, and the parser that splits each answer into OpenAI's message parts.

``ChatTraits.of(template, tokenizer)`` reads a template once: its call syntax (``tool_syntax.detect_syntax``, from a
probe call rendered through it), whether it is a thinking template (its source writes ``<think>`` ... ``</think>``,
or Mistral's ``[THINK]`` ... ``[/THINK]``: those markers are the reasoning parser's and the think budget's), and
which of the markers these use are control tokens of the vocabulary (added tokens marked special or written like
tags, ``<...>``, as llguidance counts them): the grammar matches those as tokens, and when one of them is marked
special the answers are detokenized with control tokens kept (``skip_special_tokens=False``) so that the parser
sees it.
``TurnPlan.make`` decides per request:

* tools with ``tool_choice`` other than none need a known call syntax (a 400 naming ``tools`` otherwise: refused,
  never guessed); their grammar (``tool_syntax.call_grammar``) becomes the request's response format. A parameter
  schema that llguidance refuses strictly is compiled leniently (keywords that only validate are ignored while
  generating: ``relaxed``); every finished call is still validated against its function's whole schema.
* a thinking template gets reasoning parsing; the answer starts inside the think block when the prompt ends inside
  one (the template opened it, or a thinking budget made the engine open it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .answer_parser import AnswerParser
from .api_error import bad_request
from .chat_template import ChatTemplate
from .tool_definitions import ToolRequest
from .tool_syntax import CallSyntax, ReasoningMarkers, arguments_problem, call_grammar, detect_syntax

if TYPE_CHECKING:
    from logitproc.runtime.config import GenerationConfig
    from tokenizers import Tokenizer

THINK_BEGIN, THINK_END = "<think>", "</think>"
#: The think markers of the families whose templates write a think block (the first pair a template holds counts):
#: ``<think>`` (Qwen3, QwQ, DeepSeek-R1) and Mistral's ``[THINK]`` (Magistral, Ministral 3 Reasoning).
THINK_MARKERS = ((THINK_BEGIN, THINK_END), ("[THINK]", "[/THINK]"))


@dataclass(frozen=True)
class ChatTraits:
    """What a chat template supports: the tool-call syntax it writes (None: none known), and a think block; with
    the markers of these that are control tokens of the vocabulary (``marker_tokens``: text -> id), and whether one
    of them are marked special (``special_markers``: a turn whose parser reads one must keep control tokens in the
    text)."""

    syntax: CallSyntax | None
    thinking: bool
    marker_tokens: Mapping[str, int] = field(default_factory=dict)
    special_markers: frozenset[str] = frozenset()
    think: tuple[str, str] = (THINK_BEGIN, THINK_END)  # the think block's markers (when ``thinking``)

    @classmethod
    def of(cls, template: ChatTemplate, tokenizer: Tokenizer | None = None) -> ChatTraits:
        source = template.source
        syntax = detect_syntax(template)
        think = next(((b, e) for b, e in THINK_MARKERS if b in source and e in source), None)
        markers = (*(syntax.markers if syntax is not None else ()), *(think or ()))
        added = {} if tokenizer is None else {t.content: (i, t.special)
                                              for i, t in tokenizer.get_added_tokens_decoder().items()}
        controls = {m: added[m] for m in markers if m in added and (added[m][1] or (m[0] == "<" and m[-1] == ">"))}
        return cls(syntax, think is not None, {m: i for m, (i, _) in controls.items()},
                   frozenset(m for m, (_, special) in controls.items() if special), think or (THINK_BEGIN, THINK_END))


def ends_inside_think(prompt_tail: str, begin: str = THINK_BEGIN, end: str = THINK_END) -> bool:
    """Whether a prompt ending with ``prompt_tail`` leaves a think block (``begin`` ... ``end``) open."""
    return prompt_tail.rfind(begin) > prompt_tail.rfind(end)


def _grammar(syntax: CallSyntax, tools: ToolRequest, markers: ReasoningMarkers | None,
             marker_tokens: Mapping[str, int]) -> tuple[str, bool]:
    """The call grammar, and whether it had to be relaxed (llguidance refused a parameter schema strictly)."""
    import llguidance

    text = call_grammar(syntax, tools, markers, marker_tokens)
    problem = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(text))
    if not problem:
        return text, False
    relaxed = call_grammar(syntax, tools, markers, marker_tokens, relaxed=True)
    again = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(relaxed))
    if again:
        first = again.strip().splitlines()[0] if again.strip() else again
        raise bad_request(f"tools: the grammar engine cannot compile these function parameters: {first}", "tools")
    return relaxed, True


@dataclass(frozen=True)
class ChatAnswer:
    """A finished answer in OpenAI's shape: the message, the finish reason, our extension's choice fields."""

    message: dict[str, Any]
    finish_reason: str | None
    fields: dict[str, Any]


@dataclass(frozen=True)
class TurnPlan:
    """How one request's answers are generated and read."""

    config: GenerationConfig
    tools: ToolRequest | None
    syntax: CallSyntax | None  # set when calls are parsed
    markers: ReasoningMarkers | None  # set when reasoning is parsed
    relaxed: bool = False

    @classmethod
    def make(cls, traits: ChatTraits, config: GenerationConfig, tools: ToolRequest | None,
             prompt_tail: str) -> TurnPlan:
        markers = None
        if traits.thinking:
            begin, end = traits.think
            inside = config.max_thinking_tokens is not None or ends_inside_think(prompt_tail, begin, end)
            markers = ReasoningMarkers(begin, end, inside)
            if (config.think_begin, config.think_end) != traits.think:  # the think budget's markers: the template's
                config = replace(config, think_begin=begin, think_end=end)
        calls = tools is not None and tools.calls_expected
        read = {markers.begin, markers.end} if markers is not None else set()
        if calls and traits.syntax is not None:
            read.update(traits.syntax.markers)
        if read & traits.special_markers:  # a marker the parser reads is a control token: keep it in the text
            config = replace(config, skip_special_tokens=False)
        if not calls:
            return cls(config, tools, None, markers)
        if traits.syntax is None or tools is None:
            raise bad_request("tools: this model's chat template writes no tool-call syntax logitproc knows (Hermes "
                              "<tool_call>, Llama 3.1 JSON, Mistral [TOOL_CALLS]); give a template that does with "
                              "--chat-template, or tool_choice 'none'", "tools")
        if config.response_format is not None:
            raise bad_request("response_format cannot be combined with tools (the calls have their own grammar); "
                              "use tool_choice 'none' for a formatted answer", "response_format")
        # With a thinking budget the engine holds the grammar until thinking ends: the grammar starts after it.
        in_grammar = markers if config.max_thinking_tokens is None else None
        grammar, relaxed = _grammar(traits.syntax, tools, in_grammar, traits.marker_tokens)
        constrained = replace(config, response_format={"type": "grammar", "grammar": grammar, "syntax": "lark"})
        return cls(constrained, tools, traits.syntax, markers, relaxed)

    def parser(self) -> AnswerParser:
        return AnswerParser(self.syntax, self.markers)

    def call_errors(self, parser: AnswerParser) -> list[str]:
        """Why each finished call does not validate against its function's schema (none when all do)."""
        errors = []
        if self.tools is None:
            return errors
        for call in parser.tool_calls:
            function = self.tools.function(call.name)
            if function is None:
                errors.append(f"{call.id}: no function {call.name!r}")
                continue
            problem = arguments_problem(function, json.loads(call.arguments))
            if problem is not None:
                errors.append(f"{call.id}: {problem}")
        return errors

    def answer(self, parser: AnswerParser, engine_reason: str | None) -> ChatAnswer:
        """The finished answer's message, finish reason and extra choice fields."""
        calls = [c.body() for c in parser.tool_calls]
        message: dict[str, Any] = {"role": "assistant", "content": parser.content or (None if calls else ""),
                                   "refusal": None, "tool_calls": calls}
        if self.markers is not None:
            message["reasoning_content"] = parser.reasoning or None
        return ChatAnswer(message, parser.finish_reason(engine_reason), self.message_fields(parser))

    def message_fields(self, parser: AnswerParser) -> dict[str, Any]:
        """The choice fields our extension adds to an answer with calls: whether every call validated against its
        function's schema (and why not), and whether the grammar was relaxed."""
        if self.syntax is None:
            return {}
        errors = self.call_errors(parser)
        fields: dict[str, Any] = {"tool_calls_valid": not errors and not parser.incomplete}
        if errors:
            fields["tool_call_errors"] = errors
        if self.relaxed:
            fields["tool_calls_relaxed"] = True
        return fields
