"""ResponseFormat: what a request's output must match, parsed from the OpenAI / vLLM ``response_format`` field.

Accepted forms (a dict, as in the OpenAI API, or a ResponseFormat)::

    {"type": "text"}                                                  no constraint (same as None)
    {"type": "json_object"}                                           any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    {"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"}                   extension: the whole output matches the regex
    {"type": "grammar", "grammar": "start: ...", "syntax": "lark"}    extension: a Lark (default) or GBNF/EBNF grammar

JSON formats take an optional ``"whitespace"`` (extension; ``WHITESPACE_POLICIES``): ``"compact"`` (the default, as
OpenAI returns JSON: no whitespace outside strings), ``"indented"`` (``json.dumps(value, indent=2)``'s layout) or
``"flexible"`` (any whitespace between tokens, at most 16 characters in a row)::

    {"type": "json_schema", "json_schema": {...}, "whitespace": "indented"}

Only the shape is checked here (types, required keys, unknown keys refused); whether the engine can compile the
schema, regex or grammar is decided when a request is started, as an error for that request alone.
``key`` is a canonical text of the constraint, used to cache compiled grammars.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
#: Objects and arrays nested in a schema (real-world schemas stay under 30; deeper ones overflow the Python stack).
MAX_SCHEMA_DEPTH = 256


def nesting_depth(value: Any) -> int:
    """How deeply objects and arrays nest in ``value`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_SCHEMA_DEPTH:  # deeper than that is refused anyway: stop walking
            stack.extend((child, depth + 1) for child in children)
    return deepest
GRAMMAR_SYNTAXES = ("lark", "ebnf")
#: How a JSON answer is laid out (the first is the default).
WHITESPACE_POLICIES = ("compact", "indented", "flexible")
JSON_KINDS = ("json_object", "json_schema")
#: A JSON schema may be an object or, per the JSON Schema spec, the booleans true (anything) and false (nothing).
_SCHEMA_KINDS = (dict, bool)


@dataclass(frozen=True)
class ResponseFormat:
    """A parsed response format. ``kind`` is json_object, json_schema, regex or grammar; ``text`` its source."""

    kind: str
    text: str  # canonical JSON of the schema, the regex, or the grammar text
    syntax: str = ""  # grammar: lark or ebnf
    name: str = ""  # json_schema: the schema's name
    whitespace: str = ""  # json_object / json_schema: one of WHITESPACE_POLICIES

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.syntax}:{self.whitespace}:{self.text}"

    @property
    def schema(self) -> Any:
        """The JSON schema (json_object: ``{"type": "object"}``); a ValueError for other kinds."""
        if self.kind not in ("json_object", "json_schema"):
            raise ValueError(f"a {self.kind} response format has no JSON schema")
        return json.loads(self.text)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool, name: str = "schema",
                    whitespace: str = WHITESPACE_POLICIES[0]) -> ResponseFormat:
        return parse_response_format({"type": "json_schema", "json_schema": {"name": name, "schema": schema},
                                      "whitespace": whitespace})

    @classmethod
    def regex(cls, pattern: str) -> ResponseFormat:
        return parse_response_format({"type": "regex", "regex": pattern})

    @classmethod
    def grammar(cls, text: str, syntax: str = "lark") -> ResponseFormat:
        return parse_response_format({"type": "grammar", "grammar": text, "syntax": syntax})


def _keys(where: str, value: Mapping[str, Any], required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    missing = [k for k in required if k not in value]
    if missing:
        raise ValueError(f"{where}: missing key {missing[0]!r} (required: {list(required)})")
    unknown = [k for k in value if k not in required + optional]
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (allowed: {list(required + optional)})")


def _text(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{where} must not be empty")
    return value


def _whitespace(value: Mapping[str, Any]) -> str:
    policy = value.get("whitespace", WHITESPACE_POLICIES[0])
    if policy not in WHITESPACE_POLICIES:
        raise ValueError(f"response_format.whitespace must be one of {list(WHITESPACE_POLICIES)}, got {policy!r}")
    return policy


def with_whitespace(value: Any, policy: str | None) -> Any:
    """The response_format ``value`` (a mapping as in the API, or a ResponseFormat) with the whitespace ``policy``
    where it is a JSON format that does not name one itself (a request's own choice wins); other formats as given.
    A ValueError for a policy not in ``WHITESPACE_POLICIES``."""
    if policy is None:
        return value
    if policy not in WHITESPACE_POLICIES:
        raise ValueError(f"json_whitespace must be one of {list(WHITESPACE_POLICIES)}, got {policy!r}")
    if isinstance(value, Mapping) and value.get("type") in JSON_KINDS and "whitespace" not in value:
        return {**value, "whitespace": policy}
    return value


def parse_response_format(value: Any) -> ResponseFormat | None:
    """The ResponseFormat for ``value`` (None for no constraint); a ValueError/TypeError naming what is wrong."""
    if value is None or isinstance(value, ResponseFormat):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"response_format must be a mapping like {{'type': 'json_object'}}, got {type(value).__name__}")
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"response_format.type must be one of {list(RESPONSE_FORMAT_TYPES)}, got {kind!r}")
    if kind == "text":
        _keys("response_format", value, ("type",), ())
        return None
    if kind == "json_object":
        _keys("response_format", value, ("type",), ("whitespace",))
        return ResponseFormat("json_object", '{"type":"object"}', whitespace=_whitespace(value))
    if kind == "json_schema":
        _keys("response_format", value, ("type", "json_schema"), ("whitespace",))
        spec = value["json_schema"]
        if not isinstance(spec, Mapping):
            raise TypeError(f"response_format.json_schema must be a mapping, got {type(spec).__name__}")
        _keys("response_format.json_schema", spec, ("schema",), ("name", "strict", "description"))
        schema = spec["schema"]
        if isinstance(schema, str):  # a schema given as JSON text
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"response_format.json_schema.schema is not valid JSON: {err}") from None
            except RecursionError:
                raise ValueError(f"response_format.json_schema.schema is nested more than {MAX_SCHEMA_DEPTH} levels "
                                 "deep") from None
        if not isinstance(schema, _SCHEMA_KINDS):
            raise TypeError(f"response_format.json_schema.schema must be an object or a boolean, "
                            f"got {type(schema).__name__}")
        name = spec.get("name", "schema")
        if not isinstance(name, str):
            raise TypeError(f"response_format.json_schema.name must be a string, got {type(name).__name__}")
        depth = nesting_depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"response_format.json_schema.schema is nested {depth} levels deep; at most "
                             f"{MAX_SCHEMA_DEPTH} are allowed")
        try:
            # Key order is kept: the engines write properties in the schema's order.
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"response_format.json_schema.schema cannot be written as JSON: {err}") from None
        return ResponseFormat("json_schema", text, name=name, whitespace=_whitespace(value))
    if kind == "regex":
        _keys("response_format", value, ("type", "regex"), ())
        return ResponseFormat("regex", _text("response_format.regex", value["regex"]))
    _keys("response_format", value, ("type", "grammar"), ("syntax",))
    syntax = value.get("syntax", "lark")
    if syntax not in GRAMMAR_SYNTAXES:
        raise ValueError(f"response_format.syntax must be one of {list(GRAMMAR_SYNTAXES)}, got {syntax!r}")
    return ResponseFormat("grammar", _text("response_format.grammar", value["grammar"]), syntax=syntax)
