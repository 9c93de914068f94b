"""An independent check of a JSON text's whitespace layout (``json.dumps``'s compact or ``indent=2`` layout, or any:
flexible), for the tests of the whitespace policies."""

from __future__ import annotations

import json
import re

STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")


class _Members(list):
    """An object's members in order (duplicate keys kept)."""


def _laid_out(value: object, indent: int | None, level: int = 0) -> str:
    """``value`` written as ``json.dumps`` writes it, compact or with ``indent`` (members kept as they came)."""
    if isinstance(value, (_Members, list)):
        is_object = isinstance(value, _Members)
        items = [(json.dumps(k) + (":" if indent is None else ": ") + _laid_out(v, indent, level + 1)) if is_object
                 else _laid_out(v, indent, level + 1) for k, v in (value if is_object else enumerate(value))]
        open_, close = "{}" if is_object else "[]"
        if not items:
            return open_ + close
        if indent is None:
            return open_ + ",".join(items) + close
        pad = "\n" + " " * (indent * (level + 1))
        return open_ + pad + ("," + pad).join(items) + "\n" + " " * (indent * level) + close
    return json.dumps(value)


def layout_of(text: str, policy: str) -> bool:
    """Whether ``text`` is JSON laid out as ``policy`` says, by an independent writer of ``json.dumps``'s layouts;
    strings and numbers are compared as placeholders (their spelling is the model's choice, not the layout's)."""
    json.loads(text)  # it parses
    if policy == "flexible":
        return True
    shape = NUMBER.sub("0", STRING.sub('""', text))
    value = json.loads(shape, object_pairs_hook=_Members)
    return _laid_out(value, 2 if policy == "indented" else None) == shape
