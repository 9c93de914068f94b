"""A chat request's tools (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``), checked at the boundary.

``parse_tools(body)`` gives a :class:`ToolRequest` or None (no tools and no tool_choice). Everything wrong is an
``APIError`` (400) whose ``param`` is the path of the field (``tools[1].function.parameters``, ``tool_choice``):
a function name outside OpenAI's ``[A-Za-z0-9_-]{1,64}``, two functions of one name, parameters that are not a valid
JSON Schema (checked with ``jsonschema`` against the draft the schema declares, 2020-12 by default) or not an object
schema (a call's arguments are a JSON object), a ``tool_choice`` naming a function that is not in ``tools``, a
``tool_choice`` other than none without tools, or a ``json_whitespace`` the calls' arguments cannot be laid out in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .api_error import bad_request, shown

#: OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: A function without ``parameters`` takes no arguments (OpenAI's reading): an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
#: The whitespace policies of a call's arguments (``json_whitespace``; the first is the default): those of a JSON
#: answer (``runtime.response_format.WHITESPACE_POLICIES``) but ``indented``, whose layout the grammar engine holds
#: only for a whole answer.
ARGUMENT_WHITESPACE = ("compact", "flexible")


class ToolChoice(Enum):
    """What the model may do with the tools: OpenAI's ``tool_choice`` values (``NAMED``: the one function given)."""

    AUTO = "auto"
    REQUIRED = "required"
    NONE = "none"
    NAMED = "named"


@dataclass(frozen=True)
class FunctionTool:
    """One function the model may call; ``parameters`` is the JSON Schema of its arguments (an object)."""

    name: str
    parameters: Mapping[str, Any]
    description: str | None = None


@dataclass(frozen=True)
class ToolRequest:
    """The request's tools as the template gets them (``definitions``, as the client sent them), the functions,
    the choice (``named``: the function of ``ToolChoice.NAMED``), whether several calls may come in one turn, and
    the whitespace policy of the calls' arguments (``ARGUMENT_WHITESPACE``)."""

    definitions: tuple[Mapping[str, Any], ...]
    functions: tuple[FunctionTool, ...]
    choice: ToolChoice = ToolChoice.AUTO
    named: str | None = None
    parallel: bool = True
    whitespace: str = "compact"  # the layout of the calls' arguments: ARGUMENT_WHITESPACE

    @property
    def calls_expected(self) -> bool:
        """The answer may hold calls (there are tools and the choice is not none)."""
        return bool(self.functions) and self.choice is not ToolChoice.NONE

    @property
    def callable(self) -> tuple[FunctionTool, ...]:
        """The functions a call may name: the named one, else all."""
        if self.choice is ToolChoice.NAMED:
            return tuple(f for f in self.functions if f.name == self.named)
        return self.functions

    def function(self, name: str) -> FunctionTool | None:
        return next((f for f in self.functions if f.name == name), None)


def _schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a JSON Schema for a call's arguments (None: it is)."""
    if not isinstance(schema, Mapping):
        return f"must be a JSON Schema object, got {shown(schema)}"
    kind = schema.get("type")
    if kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return f"must describe a JSON object (a call's arguments are one), got type {shown(kind)}"
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path)
        return f"is not a valid JSON Schema: {err.message[:300]}" + (f" (at /{where})" if where else "")
    except RecursionError:
        return "is nested too deeply to check"
    return None


def _function(index: int, tool: Any) -> FunctionTool:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"),
                                                                                          Mapping):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}} "
                          f"(only function tools are supported), got {shown(tool)}", where)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise bad_request(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {shown(name)}",
                          f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string, got {shown(description)}",
                          f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    problem = _schema_problem(parameters)
    if problem is not None:
        raise bad_request(f"{where}.function.parameters {problem}", f"{where}.function.parameters")
    return FunctionTool(name, parameters, description)


def _choice(value: Any, names: set[str]) -> tuple[ToolChoice, str | None]:
    if isinstance(value, str):
        if value not in ("auto", "required", "none"):
            raise bad_request(f"tool_choice must be 'auto', 'required', 'none' or {{'type': 'function', 'function': "
                              f"{{'name': ...}}}}, got {shown(value)}", "tool_choice")
        return ToolChoice(value), None
    function = value.get("function") if isinstance(value, Mapping) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise bad_request(f"tool_choice must be 'auto', 'required', 'none' or {{'type': 'function', 'function': "
                          f"{{'name': ...}}}}, got {shown(value)}", "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names the function {shown(name)}, which is not in tools "
                          f"({sorted(names)})", "tool_choice")
    return ToolChoice.NAMED, name


def _whitespace(body: Mapping[str, Any], default: str | None) -> str:
    """The calls' whitespace policy: the request's ``json_whitespace``, else the server's default when it is one
    of ``ARGUMENT_WHITESPACE`` (a server default of ``indented`` lays out JSON answers only), else compact."""
    policy = body.get("json_whitespace")
    if policy is None:
        return default if default in ARGUMENT_WHITESPACE else ARGUMENT_WHITESPACE[0]
    if policy not in ARGUMENT_WHITESPACE:
        raise bad_request(f"json_whitespace for tool calls must be one of {list(ARGUMENT_WHITESPACE)} (their "
                          f"arguments' layout; indented is for a JSON response_format), got {shown(policy)}",
                          "json_whitespace")
    return policy


def parse_tools(body: Mapping[str, Any], default_whitespace: str | None = None) -> ToolRequest | None:
    """The request's tools, choice, parallel flag and the arguments' whitespace policy (``json_whitespace``, else
    ``default_whitespace``, the server's: ``_whitespace``); None when it has neither tools nor a tool_choice."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(f"parallel_tool_calls must be a boolean, got {shown(parallel)}", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: give the functions in tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request(f"tools must be a list of function tools, got {shown(tools)}", "tools")
    functions = [_function(i, tool) for i, tool in enumerate(tools)]
    seen: dict[str, int] = {}
    for i, function in enumerate(functions):
        if function.name in seen:
            raise bad_request(f"tools[{i}].function.name {function.name!r} is already the name of "
                              f"tools[{seen[function.name]}]: function names must be unique",
                              f"tools[{i}].function.name")
        seen[function.name] = i
    kind, named = _choice("auto" if choice is None else choice, set(seen))
    whitespace = _whitespace(body, default_whitespace) if kind is not ToolChoice.NONE else ARGUMENT_WHITESPACE[0]
    return ToolRequest(tuple(tools), tuple(functions), kind, named, True if parallel is None else parallel,
                       whitespace)

