"""OpenAI-compatible request parsing: a chat or completions request body becomes prompts and a GenerationConfig.

Fields follow the OpenAI API (messages / prompt, max_tokens and max_completion_tokens, temperature, top_p, n, seed,
stop, presence/frequency penalties, logit_bias, logprobs + top_logprobs for chat, logprobs as an int for completions,
stream, stream_options.include_usage, response_format, user) plus vLLM's extensions under their vLLM names (top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, bad_words, allowed_token_ids, skip_special_tokens,
structured_outputs with one of json / regex / choice / grammar / json_object), ``jump_forward`` (a boolean: this
request with or without the server's ``--jump-forward``) and ``json_whitespace`` (compact / indented / flexible: the
layout of a JSON answer, and of tool calls' arguments (compact / flexible), default the server's
``--json-whitespace``, else compact). Unknown fields are ignored with a
log line, as vLLM does.
Everything wrong with a request is an ``APIError`` (status 400) whose message names the field and what is allowed;
the ranges are GenerationConfig's. Fields a request leaves unset take the model's sampling defaults (as vLLM applies
a model's generation config), else GenerationConfig's.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .api_error import APIError as APIError  # re-exported: the server's modules import it from here
from .api_error import bad_request, shown
from .tool_definitions import ToolRequest, parse_tools

if TYPE_CHECKING:  # the runtime (and TVM) load with the model, not before the server listens
    from logitproc.runtime.config import GenerationConfig

log = logging.getLogger("logitproc.serve")

#: Request fields passed to GenerationConfig under the same name (OpenAI's and vLLM's).
CONFIG_FIELDS = ("temperature", "top_p", "n", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
                 "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "bad_words",
                 "allowed_token_ids", "skip_special_tokens")
#: Fields read elsewhere, or accepted and without effect here (``user`` is for the client's own tracking).
COMMON_FIELDS = CONFIG_FIELDS + ("model", "max_tokens", "stream", "stream_options", "response_format",
                                 "structured_outputs", "user", "logprobs", "jump_forward", "logprobs_mode",
                                 "json_whitespace")
#: Chat-only fields: OpenAI's tools, and vLLM's ``chat_template_kwargs`` / ``add_generation_prompt`` /
#: ``continue_final_message`` / ``thinking_token_budget``.
CHAT_FIELDS = COMMON_FIELDS + ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "chat_template_kwargs", "add_generation_prompt",
                               "continue_final_message", "thinking_token_budget")
COMPLETION_FIELDS = COMMON_FIELDS + ("prompt", "echo", "best_of", "suffix")
#: ``logprobs_mode`` by vLLM's names (its ``--logprobs-mode``) -> GenerationConfig's; "auto" (the default): raw for
#: greedy requests, processed when sampling.
LOGPROBS_MODES = {"auto": "auto", "raw_logprobs": "raw", "processed_logprobs": "processed"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
#: OpenAI's ranges where they are narrower than GenerationConfig's (the OpenAI endpoints keep to them).
OPENAI_RANGES = {"temperature": (0.0, 2.0)}
#: Unknown field names a log line shows (each cut to UNKNOWN_NAME_CHARS, escaped); the rest are counted.
UNKNOWN_NAMES_SHOWN = 10
UNKNOWN_NAME_CHARS = 40
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


#: GenerationConfig's and the engine's names for what a request calls otherwise.
_REQUEST_NAMES = {"max_thinking_tokens": "thinking_token_budget"}


def request_param(err: Exception, fields: tuple[str, ...]) -> str | None:
    """The request field an error from GenerationConfig or the engine is about: the field a ``FieldError`` names, in
    the spelling of the request whose ``fields`` are given (the prompt is ``messages`` in a chat); None for other
    errors or fields the request does not have."""
    from logitproc.runtime.field_error import FieldError  # the runtime (and TVM) load on first use

    if not isinstance(err, FieldError):
        return None
    if err.param == "prompt":
        return "messages" if "messages" in fields else "prompt"
    name = _REQUEST_NAMES.get(err.param, err.param)
    return name if name in fields else None


@dataclass(frozen=True)
class ChatOptions:
    """How a chat request's prompt is rendered: its tools, the template's extra keywords (``chat_template_kwargs``),
    whether the generation prompt is added, or the final assistant message continued instead."""

    tools: ToolRequest | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def render_kwargs(self) -> dict[str, Any]:
        """Keywords for the template (``tools`` as the client sent them, as transformers passes them)."""
        kwargs = dict(self.template_kwargs)
        if self.tools is not None:
            kwargs["tools"] = [dict(t) for t in self.tools.definitions]
        return kwargs


#: Template keywords a request may not set through chat_template_kwargs (the server sets them).
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                            "bos_token", "eos_token")


def chat_options(body: Mapping[str, Any], messages: list[dict[str, Any]],
                 default_whitespace: str | None = None) -> ChatOptions:
    """A chat request's (or ``/tokenize``'s) rendering options; APIError(400) naming the field.
    ``default_whitespace``: the server's JSON whitespace policy (its calls' arguments follow it, ``parse_tools``)."""
    kwargs = _typed(body, "chat_template_kwargs", dict, "an object of template keywords") or {}
    reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS or not isinstance(k, str))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved} (the request's own fields do)",
                          "chat_template_kwargs")
    add = _typed(body, "add_generation_prompt", bool, "a boolean")
    continued = bool(_typed(body, "continue_final_message", bool, "a boolean"))
    if continued:
        if add:
            raise bad_request("continue_final_message continues the last message: add_generation_prompt must be "
                              "false with it", "continue_final_message")
        if messages[-1]["role"] != "assistant":
            raise bad_request("continue_final_message needs the last message to be an assistant message (the text "
                              "to continue)", "continue_final_message")
    return ChatOptions(parse_tools(body, default_whitespace), kwargs, not continued if add is None else add,
                       continued)


@dataclass
class ParsedRequest:
    """What a chat or completions request asks for. ``prompts`` holds one item per prompt: chat messages
    (a list of {"role", "content"}) for chat, text or token ids for completions."""

    chat: bool
    model: str | None
    prompts: list[Any]
    config: GenerationConfig
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    jump_forward: bool | None = None  # None: as the server was started
    chat_options: ChatOptions = field(default_factory=lambda: ChatOptions())

    @property
    def n(self) -> int:
        return self.config.n


def _typed(body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise bad_request(f"{name} must be {what}, got {shown(value)}", name)
    if not isinstance(value, kinds):
        raise bad_request(f"{name} must be {what}, got {shown(value)}", name)
    return value


def _shown_name(name: str) -> str:
    """A client's field name for a log line: as it is when plain, else escaped (``ascii``); cut to a bounded length."""
    cut = name[:UNKNOWN_NAME_CHARS]
    shown = cut if _PLAIN_NAME.fullmatch(cut) else ascii(cut)
    return shown + ("..." if len(name) > UNKNOWN_NAME_CHARS else "")


def _ignore_unknown(body: Mapping[str, Any], known: tuple[str, ...], endpoint: str) -> None:
    """Log the unknown fields of a request in one bounded line: how many, and the first few names, escaped (a
    newline in a name cannot forge a log line, 20,000 names do not write a megabyte)."""
    unknown = [k for k in body if k not in known]
    if unknown:
        names = ", ".join(_shown_name(k) for k in unknown[:UNKNOWN_NAMES_SHOWN])
        more = f" and {len(unknown) - UNKNOWN_NAMES_SHOWN} more" if len(unknown) > UNKNOWN_NAMES_SHOWN else ""
        log.info("%s: ignoring %d unknown field(s): %s%s", endpoint, len(unknown), names, more)


def _message_text(index: int, content: Any) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}) joined."""
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are supported (the "
                                  f"models served read text: images, audio and files are refused), got "
                                  f"{shown(part)}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise bad_request(f"{where} must be a string or a list of text parts, got {type(content).__name__}", "messages")


def _tool_calls(index: int, value: Any, ids: set[str]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as the template gets them: ``arguments`` parsed to a dict (as
    transformers' templates expect); each call's id is added to ``ids``."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a list of calls, got {shown(value)}", "messages")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(call.get("id"), str) or not isinstance(
                function.get("name"), str) or call.get("type", "function") != "function":
            raise bad_request(f"{where}[{i}] must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                              f"'arguments': ...}}}}, got {shown(call)}", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise bad_request(f"{where}[{i}].function.arguments is not JSON: {shown(arguments)}",
                                  "messages") from None
        if not isinstance(arguments, Mapping):
            raise bad_request(f"{where}[{i}].function.arguments must be a JSON object, got {shown(arguments)}",
                              "messages")
        ids.add(call["id"])
        calls.append({"id": call["id"], "type": "function",
                      "function": {"name": function["name"], "arguments": dict(arguments)}})
    return calls


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages as the template gets them: {"role", "content"} (developer becomes system), an assistant's
    ``tool_calls`` (arguments as dicts) and ``reasoning_content``, a tool message's ``tool_call_id`` (it must answer
    a call of an earlier assistant message) and ``name``; a 400 naming what is wrong."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for index, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise bad_request(f"messages[{index}] must be an object with role and content", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{index}].role must be one of {list(CHAT_ROLES)}, got {shown(role)}",
                              "messages")
        parsed: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                  "content": _message_text(index, message.get("content"))}
        if role == "assistant":
            if message.get("tool_calls"):
                parsed["tool_calls"] = _tool_calls(index, message["tool_calls"], call_ids)
            reasoning = message.get("reasoning_content")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad_request(f"messages[{index}].reasoning_content must be a string, got "
                                      f"{shown(reasoning)}", "messages")
                parsed["reasoning_content"] = reasoning
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in call_ids:
                raise bad_request(f"messages[{index}].tool_call_id must be the id of a call in an earlier assistant "
                                  f"message's tool_calls, got {shown(call_id)}", "messages")
            parsed["tool_call_id"] = call_id
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad_request(f"messages[{index}].name must be a string, got {shown(name)}", "messages")
            parsed["name"] = name
        messages.append(parsed)
    return messages


def parse_prompt(value: Any) -> list[str | list[int]]:
    """A completions prompt: text, token ids, or a list of either (one request each)."""
    def ids_ok(items: list[Any]) -> bool:
        return all(isinstance(t, int) and not isinstance(t, bool) for t in items)

    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if ids_ok(value):
            return [list(value)]
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(isinstance(p, list) and p and ids_ok(p) for p in value):
            return [list(p) for p in value]
    raise bad_request("prompt must be a string, a non-empty list of token ids, or a non-empty list of strings or of "
                      "token-id lists", "prompt")


def _choice_grammar(choices: Any) -> dict[str, Any]:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request("structured_outputs.choice must be a non-empty list of non-empty strings",
                          "structured_outputs")
    alternatives = " | ".join(json.dumps(c) for c in choices)
    return {"type": "grammar", "grammar": f"start: {alternatives}", "syntax": "lark"}


def structured_output_format(value: Any) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` ({json | regex | choice | grammar | json_object}) as a response_format."""
    if not isinstance(value, Mapping):
        raise bad_request("structured_outputs must be an object with one of "
                          f"{list(STRUCTURED_OUTPUT_KEYS)}", "structured_outputs")
    given = {k: v for k, v in value.items() if k in STRUCTURED_OUTPUT_KEYS and v not in (None, False)}
    _ignore_unknown(value, STRUCTURED_OUTPUT_KEYS, "structured_outputs")
    if len(given) != 1:
        raise bad_request(f"structured_outputs must set exactly one of {list(STRUCTURED_OUTPUT_KEYS)}, got "
                          f"{sorted(given) or 'none'}", "structured_outputs")
    (kind, spec), = given.items()
    if kind == "json":
        return {"type": "json_schema", "json_schema": {"name": "schema", "schema": spec}}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "regex":
        return {"type": "regex", "regex": spec}
    if kind == "choice":
        return _choice_grammar(spec)
    return {"type": "grammar", "grammar": spec, "syntax": "ebnf" if "::=" in str(spec) else "lark"}


def _config(body: Mapping[str, Any], values: dict[str, Any], fields: tuple[str, ...],
            defaults: Mapping[str, Any], tool_calls: bool = False) -> GenerationConfig:
    """The request's GenerationConfig; ``tool_calls``: the request's tools may be called (its ``json_whitespace``
    then lays out their arguments: ``tool_definitions.parse_tools``)."""
    from logitproc.runtime.config import GenerationConfig
    from logitproc.runtime.response_format import with_whitespace

    values = {**defaults, **values}
    whitespace = values.pop("json_whitespace", None)  # the server's default (serve --json-whitespace)
    if body.get("logprobs_mode") is not None:
        values["logprobs_mode"] = parse_logprobs_mode(body["logprobs_mode"])
    for name in CONFIG_FIELDS:
        if body.get(name) is not None:
            values[name] = body[name]
    for name, (low, high) in OPENAI_RANGES.items():
        value = body.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not low <= value <= high:
            raise bad_request(f"{name} must be in [{low}, {high}] (OpenAI's range), got {shown(value)}", name)
    response_format = body.get("response_format")
    if body.get("structured_outputs") is not None:
        if response_format is not None:
            raise bad_request("give either response_format or structured_outputs, not both", "structured_outputs")
        response_format = structured_output_format(body["structured_outputs"])
    if body.get("json_whitespace") is not None:  # the layout of a JSON answer (extension)
        whitespace = body["json_whitespace"]
        kind = response_format.get("type") if isinstance(response_format, Mapping) else None
        if kind not in ("json_object", "json_schema") and not tool_calls:
            raise bad_request("json_whitespace lays out a JSON answer: it needs a response_format of type "
                              "json_object or json_schema, or tools the model may call", "json_whitespace")
    try:
        values["response_format"] = with_whitespace(response_format, whitespace)
    except ValueError as err:
        raise bad_request(str(err), "json_whitespace") from None
    try:
        return GenerationConfig(**values)
    except (ValueError, TypeError) as err:
        raise bad_request(str(err), request_param(err, fields)) from None


def parse_logprobs_mode(value: Any, field: str = "logprobs_mode") -> str:
    """GenerationConfig's logprobs_mode for one of vLLM's names (``LOGPROBS_MODES``); APIError(400) otherwise."""
    if isinstance(value, str) and value in LOGPROBS_MODES:
        return LOGPROBS_MODES[value]
    allowed = ", ".join(LOGPROBS_MODES)
    if value in ("raw_logits", "processed_logits"):
        raise bad_request(f"{field} {value!r} is not supported (logits are not returned); use one of {allowed}",
                          field)
    raise bad_request(f"{field} must be one of {allowed}, got {shown(value)}", field)


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = bool(_typed(body, "stream", bool, "a boolean"))
    options = _typed(body, "stream_options", dict, "an object like {\"include_usage\": true}") or {}
    if options and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request(f"stream_options.include_usage must be a boolean, got {shown(include_usage)}",
                          "stream_options")
    return stream, include_usage


def _max_tokens(body: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    for name in names:  # the first one given wins (max_completion_tokens replaces max_tokens in chat)
        if body.get(name) is not None:
            value = body[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad_request(f"{name} must be an integer >= 1, got {shown(value)}", name)
            return {"max_tokens": value}
    return {}


def _body(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string, got {shown(model)}", "model")
    _typed(body, "user", str, "a string")
    return body


def parse_chat_request(body: Any, defaults: Mapping[str, Any] = MappingProxyType({})) -> ParsedRequest:
    """A ``/v1/chat/completions`` body; APIError(400) naming the field on anything wrong. ``defaults``
    (GenerationConfig values: the model's sampling defaults) fill the fields the request leaves unset."""
    body = _body(body)
    _ignore_unknown(body, CHAT_FIELDS, "chat.completions")
    messages = parse_messages(body.get("messages"))
    stream, include_usage = _stream_options(body)
    values = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    from logitproc.runtime.config import MAX_TOP_LOGPROBS

    logprobs = _typed(body, "logprobs", bool, "a boolean")
    top = _typed(body, "top_logprobs", int, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    values.update(logprobs=bool(logprobs), top_logprobs=top or 0)
    budget = _typed(body, "thinking_token_budget", int, "an integer >= 0")
    if budget is not None:
        if budget < 0:
            raise bad_request(f"thinking_token_budget must be an integer >= 0, got {budget}", "thinking_token_budget")
        values["max_thinking_tokens"] = budget
    options = chat_options(body, messages, defaults.get("json_whitespace"))
    calls = options.tools is not None and options.tools.calls_expected
    config = _config(body, values, CHAT_FIELDS, defaults, calls)
    return ParsedRequest(True, body.get("model"), [messages], config, stream, include_usage,
                         jump_forward=_typed(body, "jump_forward", bool, "a boolean"), chat_options=options)


def parse_completion_request(body: Any, defaults: Mapping[str, Any] = MappingProxyType({})) -> ParsedRequest:
    """A ``/v1/completions`` body; APIError(400) naming the field on anything wrong; ``defaults`` as for chat
    (but max_tokens defaults to 16, as OpenAI's)."""
    body = _body(body)
    _ignore_unknown(body, COMPLETION_FIELDS, "completions")
    prompts = parse_prompt(body.get("prompt"))
    stream, include_usage = _stream_options(body)
    values = _max_tokens(body, ("max_tokens",))
    values.setdefault("max_tokens", 16)  # OpenAI's default for completions
    from logitproc.runtime.config import MAX_TOP_LOGPROBS

    logprobs = _typed(body, "logprobs", int, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", "logprobs")
        values.update(logprobs=True, top_logprobs=logprobs)
    echo = bool(_typed(body, "echo", bool, "a boolean"))
    if echo and logprobs is not None:
        raise bad_request("echo together with logprobs is not supported (prompt logprobs are not computed)", "echo")
    if body.get("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    best_of = _typed(body, "best_of", int, "an integer")
    n = body.get("n", 1)
    if best_of is not None and best_of != n:
        raise bad_request(f"best_of must equal n ({n}) here, got {best_of}", "best_of")
    config = _config(body, values, COMPLETION_FIELDS, defaults)
    return ParsedRequest(False, body.get("model"), prompts, config, stream, include_usage, echo,
                         jump_forward=_typed(body, "jump_forward", bool, "a boolean"))
