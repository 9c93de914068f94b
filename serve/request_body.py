"""The HTTP layer's one JSON-body parser: bytes become a JSON value within limits, or a ``BodyError`` naming the limit.

    parse_json(raw, max_bytes) -> the value        BodyError(status 400 / 413, message) otherwise

The limits: at most ``max_bytes`` bytes (413), UTF-8 (400), strict JSON (no ``NaN`` / ``Infinity``; 400), containers
nested at most ``MAX_DEPTH`` deep, number literals of at most ``MAX_NUMBER_CHARS`` characters, and strings (keys too)
that are valid Unicode: an escaped lone surrogate (``"\\ud800"``) is refused here rather than echoed into an error
message that then cannot be encoded. Every message names what was wrong without echoing the client's bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any

#: Containers (objects, arrays) nested deeper than this are refused (a JSON schema rarely needs a tenth of it).
MAX_DEPTH = 100
#: Characters of one number literal: enough for any int64 / uint64 and any float64 written out.
MAX_NUMBER_CHARS = 64


class BodyError(ValueError):
    """A request body that is refused: ``status`` 400 (not acceptable JSON) or 413 (too large)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _number(kind: type) -> Any:
    def parse(literal: str) -> Any:
        if len(literal) > MAX_NUMBER_CHARS:
            raise BodyError(400, f"the request body holds a number literal of {len(literal)} characters; at most "
                                 f"{MAX_NUMBER_CHARS} are accepted")
        number = kind(literal)
        if kind is float and not math.isfinite(number):
            raise BodyError(400, f"the request body holds the number {literal}, outside float64's range")
        return number

    return parse


def _constant(name: str) -> Any:
    raise BodyError(400, f"the request body is not valid JSON: {name} is not a JSON value")


def _check_strings_and_depth(value: Any) -> None:
    """Walk the parsed value without recursion: refuse nesting over MAX_DEPTH and strings that are not Unicode."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.items()
        elif isinstance(item, list):
            children = ((None, v) for v in item)
        else:
            _check_string(item)
            continue
        if depth > MAX_DEPTH:
            raise BodyError(400, f"the request body nests objects and arrays more than {MAX_DEPTH} deep")
        for key, child in children:
            _check_string(key)
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
            else:
                _check_string(child)


def _check_string(item: Any) -> None:
    if isinstance(item, str) and not item.isascii():
        try:
            item.encode("utf-8")
        except UnicodeEncodeError as err:
            raise BodyError(400, f"the request body holds a string with a lone surrogate (U+{ord(item[err.start]):04X}"
                                 "): not valid Unicode") from None


def parse_json(raw: bytes, max_bytes: int) -> Any:
    """The JSON value of a request body; BodyError when it is over ``max_bytes`` or not acceptable JSON."""
    if len(raw) > max_bytes:
        raise BodyError(413, f"the request body has {len(raw)} bytes; this server accepts at most {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BodyError(400, f"the request body is not valid UTF-8 (byte {err.start})") from None
    try:
        value = json.loads(text, parse_int=_number(int), parse_float=_number(float), parse_constant=_constant)
    except json.JSONDecodeError as err:
        raise BodyError(400, f"the request body is not valid JSON: {err.msg} (line {err.lineno}, column "
                             f"{err.colno})") from None
    except RecursionError:
        raise BodyError(400, f"the request body nests objects and arrays more than {MAX_DEPTH} deep") from None
    _check_strings_and_depth(value)
    return value
