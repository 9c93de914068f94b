"""What a closing search may write whole, read from a JSON schema: the keys it requires and a shortest string for
each ``pattern``, so that the search writes required keys (not optional ones) and solves string patterns a byte-by-byte
search would not (``.../x.yml``, a DOI) in one step; and, from a Lark grammar, the control tokens it names.

    completion_hints(fmt) -> CompletionHints(keys, values, tails, tokens)

* ``keys``: every name a ``required`` lists, as the JSON text of the key and its colon (``"name":``), in the order
  the schema first names them;
* ``values``: ``"a"``, and a shortest string matching each ``pattern``, as a JSON string (``"a/a.yml"``);
* ``tails``: the same without the opening quote (``a/a.yml"``), to end a string already open (most real patterns
  take any prefix: ``^(.+/)+(.+)\\.ya?ml$``);
* ``tokens``: the ids a Lark grammar names as tokens (``<[id]>``, e.g. a tool call's ``</tool_call>`` that is a
  control token of the vocabulary): a byte search cannot reach them, so it tries them where no byte fits.

The shortest string is read off Python's regular-expression parse tree (``re._parser``): one character from each
class (``a``, ``0``, ``A`` first), the minimum of each repetition, the shortest branch; lookarounds and anchors add
nothing. It is kept only when Python's ``re.search`` matches it; the grammar checks each hint before the search uses
it, so a wrong one costs a try, never a wrong plan.
"""

from __future__ import annotations

import functools
import json
import re
import re._constants as sre
import re._parser as sre_parser
from dataclasses import dataclass
from typing import Any

from ..response_format import ResponseFormat

#: Characters tried for a character class, in this order: a letter, a digit, an uppercase letter, then the rest of
#: printable ASCII.
CHARACTERS = "a0A" + "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "a0A\"\\") + " "
#: At most this many hints of each kind (a schema with thousands of patterns keeps its first ones).
MAX_HINTS = 256
_DATA_KEYWORDS = ("enum", "const", "examples", "default")


@dataclass(frozen=True)
class CompletionHints:
    keys: tuple[bytes, ...] = ()
    values: tuple[bytes, ...] = ()
    tails: tuple[bytes, ...] = ()
    tokens: tuple[int, ...] = ()


#: A token named by id in llguidance's Lark (``<[123]>``).
_TOKEN_BY_ID = re.compile(r"<\[(\d+)\]>")


def completion_hints(fmt: ResponseFormat | None) -> CompletionHints:
    """The hints of a JSON schema format, or a Lark grammar's tokens (none for other formats); computed once per
    schema."""
    if fmt is not None and fmt.kind == "grammar" and fmt.syntax == "lark":
        return CompletionHints(tokens=tuple(dict.fromkeys(int(t) for t in _TOKEN_BY_ID.findall(fmt.text))))
    if fmt is None or fmt.kind != "json_schema":
        return CompletionHints()
    return _hints(fmt.text)


@functools.lru_cache(maxsize=256)
def _hints(schema_text: str) -> CompletionHints:
    keys: dict[bytes, None] = {}
    patterns: dict[str, None] = {}
    queue: list[Any] = [json.loads(schema_text)]
    while queue:  # breadth first: the names near the root come first
        item = queue.pop(0)
        if isinstance(item, list):
            queue.extend(item)
        elif isinstance(item, dict):
            if isinstance(item.get("required"), list):
                keys.update((json.dumps(n, ensure_ascii=False).encode() + b":", None)
                            for n in item["required"] if isinstance(n, str))
            if isinstance(item.get("pattern"), str):
                patterns[item["pattern"]] = None
            queue.extend(v for k, v in item.items() if k not in _DATA_KEYWORDS)
    values = [b'"a"']  # the shortest non-empty string, where one is needed (minLength 1)
    for pattern in patterns:
        text = shortest_match(pattern)
        if text is not None:
            values.append(json.dumps(text, ensure_ascii=False).encode())
    return CompletionHints(tuple(keys)[:MAX_HINTS], tuple(values[:MAX_HINTS]),
                           tuple(v[1:] for v in values[:MAX_HINTS] if len(v) > 2))


def shortest_match(pattern: str) -> str | None:
    """A shortest string that ``pattern`` finds (see the module doc), or None when it cannot be read off."""
    try:
        text = _shortest(sre_parser.parse(pattern))
        return text if text is not None and re.search(pattern, text) else None
    except (re.error, RecursionError, ValueError, TypeError):
        return None


def _shortest(items: Any) -> str | None:
    out = []
    for op, arg in items:
        part = _one(op, arg)
        if part is None:
            return None
        out.append(part)
    return "".join(out)


def _one(op: Any, arg: Any) -> str | None:
    if op is sre.LITERAL:
        return chr(arg)
    if op in (sre.AT, sre.ASSERT, sre.ASSERT_NOT):
        return ""
    if op is sre.ANY:
        return CHARACTERS[0]
    if op is sre.NOT_LITERAL:
        return next(c for c in CHARACTERS if ord(c) != arg)
    if op is sre.IN:
        return next((c for c in CHARACTERS if _in_class(arg, c)), None)
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
        low, _high, sub = arg
        part = _shortest(sub)
        return None if part is None else part * low
    if op is sre.SUBPATTERN:
        return _shortest(arg[-1])
    if op is sre.ATOMIC_GROUP:
        return _shortest(arg)
    if op is sre.BRANCH:
        options = [t for t in (_shortest(b) for b in arg[1]) if t is not None]
        return min(options, key=len) if options else None
    return None  # back-references, conditionals: not read off


_CATEGORIES = {
    sre.CATEGORY_DIGIT: str.isdigit, sre.CATEGORY_NOT_DIGIT: lambda c: not c.isdigit(),
    sre.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
    sre.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
    sre.CATEGORY_SPACE: str.isspace, sre.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
}


def _in_class(items: Any, char: str) -> bool:
    negate = False
    found = False
    for op, arg in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            found |= ord(char) == arg
        elif op is sre.RANGE:
            found |= arg[0] <= ord(char) <= arg[1]
        elif op is sre.CATEGORY:
            test = _CATEGORIES.get(arg)
            found |= bool(test and test(char))
    return found != negate
