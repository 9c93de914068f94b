"""Where a JSON schema requires ``uniqueItems``: the schemas that apply at each position of a document (a value
reached by object keys and array indexes), resolved lazily as the document is written.

A :class:`Position` is a disjunction of conjunctions of subschemas: every subschema of one conjunction applies
(``allOf``, ``$ref``), and the value must match one of the conjunctions (``anyOf``, ``oneOf`` read as ``anyOf``).
It is read conservatively, so that nothing valid is ever refused: an array must have unique items only when *every*
conjunction that admits an array has ``uniqueItems: true``; a reference that cannot be resolved, a keyword not
followed (``not``, ``if``/``then``/``else``, ``contains``, ``dependentSchemas``, ``unevaluated*``) or more than
``MAX_BRANCHES`` conjunctions make the position :data:`ANYTHING` (nothing required). A position's finite set of
values (``enum``, ``const``, ``boolean``, ``null``) lets the array's generation avoid dead ends (every value used).
"""

from __future__ import annotations

import re
import threading
from typing import Any

from .schema_rewrite import normalize, resolve_anchors

#: More conjunctions than this at one position: the position is read as anything (nothing enforced).
MAX_BRANCHES = 32

#: A scalar JSON value as compared by JSON Schema: ("s", text), ("n", sign, digits, exponent: 1 == 1.0 == 1e0),
#: ("b", bool), ("z",); numbers also by their double value ("f", float).
ValueKey = tuple


_NUMBER = re.compile(r"(-?)(\d+)(?:\.(\d+))?(?:[eE]([+-]?\d+))?")


def value_key(value: Any) -> ValueKey | None:
    """The comparison key of a scalar JSON value (None for an object or an array)."""
    if value is None:
        return ("z",)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, (int, float)):
        return number_key(repr(value))
    if isinstance(value, str):
        return ("s", value)
    return None


def number_key(text: str) -> ValueKey | None:
    """The key of a JSON number written as ``text`` by its exact value (``1``, ``1.0``, ``10e-1`` and ``0.1e1`` are
    one key; any exponent, however large), or None when ``text`` is not a JSON number."""
    match = _NUMBER.fullmatch(text)
    if match is None:
        return None
    sign, whole, fraction, exponent = match.groups()
    digits = (whole + (fraction or "")).lstrip("0")
    if not digits:
        return ("n", "", "0", 0)
    shift = int(exponent or 0) - len(fraction or "")
    stripped = digits.rstrip("0")
    return ("n", sign, stripped, shift + len(digits) - len(stripped))


def double_key(text: str) -> ValueKey:
    """The key of a JSON number by its double value, as most JSON parsers read it (``1e400`` is inf and ``1e-400``
    is 0 there): items whose doubles are equal are also kept apart, so that an answer checked with such a parser
    (``jsonschema`` over Python's ``json``) has unique items too."""
    return ("f", float(text))


def _pointer_target(root: Any, ref: str) -> Any:
    """The subschema a local JSON pointer (``#/$defs/a``) names, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _types(schema: dict) -> set[str] | None:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return None


class Position:
    """The schemas that apply at one place of a document (see the module doc); children memoised."""

    __slots__ = ("conjunctions", "_keys", "_indexes", "_unique", "_finite")

    def __init__(self, conjunctions: tuple[tuple[dict, ...], ...] | None) -> None:
        #: None: anything (nothing known, nothing enforced).
        self.conjunctions = conjunctions
        self._keys: dict[str, Position] = {}
        self._indexes: dict[int, Position] = {}
        self._unique: bool | None = None
        self._finite: frozenset | None | bool = False  # False: not computed yet

    @property
    def unique(self) -> bool:
        """An array here must have unique items (every conjunction that admits an array says so)."""
        if self._unique is None:
            self._unique = _requires_unique(self.conjunctions)
        return self._unique

    @property
    def finite(self) -> frozenset | None:
        """The keys of every value allowed here when they are finitely many scalars (an enum, booleans), else
        None."""
        if self._finite is False:
            self._finite = _finite_values(self.conjunctions)
        return self._finite  # type: ignore[return-value]


ANYTHING = Position(None)


def _requires_unique(conjunctions: tuple[tuple[dict, ...], ...] | None) -> bool:
    if not conjunctions:
        return False
    admits_array = False
    for conj in conjunctions:
        types = [t for t in (_types(s) for s in conj) if t is not None]
        if any("array" not in t for t in types) or any(
                isinstance(s.get("enum"), list) and not any(isinstance(v, list) for v in s["enum"]) for s in conj) \
                or any("const" in s and not isinstance(s["const"], list) for s in conj):
            continue  # this conjunction admits no array
        admits_array = True
        if not any(s.get("uniqueItems") is True for s in conj):
            return False
    return admits_array


def _finite_values(conjunctions: tuple[tuple[dict, ...], ...] | None) -> frozenset | None:
    if not conjunctions:
        return None
    out: set = set()
    for conj in conjunctions:
        values: set | None = None
        for schema in conj:
            if "const" in schema:
                found = {value_key(schema["const"])}
            elif isinstance(schema.get("enum"), list):
                found = {value_key(v) for v in schema["enum"]}
            else:
                types = _types(schema)
                if types is None or not types <= {"boolean", "null"}:
                    continue
                found = ({("b", True), ("b", False)} if "boolean" in types else set()) | (
                    {("z",)} if "null" in types else set())
            values = found if values is None else values & found
        if values is None or None in values:
            return None  # unbounded, or an object or array among the values
        out |= values
    return frozenset(out)


class SchemaPositions:
    """The positions of one schema (thread-safe: positions are memoised, their results are the same either way)."""

    def __init__(self, schema: Any) -> None:
        self.schema = resolve_anchors(normalize(schema)) if isinstance(schema, dict) else schema
        self._lock = threading.Lock()
        self.root = self._position([self.schema])

    # ---- resolution ----------------------------------------------------------------------------------------------
    def _expand(self, schema: Any, conj: list[dict], seen: set[int]) -> list[list[dict]] | None:
        """The conjunctions ``conj`` becomes with ``schema`` added (``[]``: none, ``schema`` is false; None:
        unknown)."""
        if schema is True or schema == {}:
            return [conj]
        if schema is False:
            return []
        if not isinstance(schema, dict):
            return None
        if id(schema) in seen:  # a cycle through references: already applied
            return [conj]
        seen = seen | {id(schema)}
        out = [[*conj, schema]]
        ref = schema.get("$ref")
        if ref is not None:
            target = _pointer_target(self.schema, ref) if isinstance(ref, str) else None
            if target is None:
                return None
            out = self._and(out, target, seen)
        for key in ("$dynamicRef", "$recursiveRef"):
            if key in schema:
                return None
        for sub in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
            if out is None:
                return None
            out = self._and(out, sub, seen)
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and out is not None:
                combined: list[list[dict]] = []
                for branch in branches:
                    for partial in out:
                        more = self._expand(branch, partial, seen)
                        if more is None:
                            return None
                        combined.extend(more)
                if len(combined) > MAX_BRANCHES:
                    return None
                out = combined
        return out

    def _and(self, conjs: list[list[dict]] | None, schema: Any, seen: set[int]) -> list[list[dict]] | None:
        if conjs is None:
            return None
        out: list[list[dict]] = []
        for conj in conjs:
            more = self._expand(schema, conj, seen)
            if more is None:
                return None
            out.extend(more)
        return out if len(out) <= MAX_BRANCHES else None

    def _position(self, schemas: list[Any]) -> Position:
        """The position where every schema of ``schemas`` applies."""
        conjs: list[list[dict]] | None = [[]]
        for schema in schemas:
            conjs = self._and(conjs, schema, set())
            if conjs is None:
                return ANYTHING
        return Position(tuple(tuple(c) for c in conjs))

    def _union(self, parts: list[list[Any]]) -> Position:
        """The position where one of ``parts`` (each a list of schemas that apply together) applies."""
        conjs: list[tuple[dict, ...]] = []
        for schemas in parts:
            position = self._position(schemas)
            if position.conjunctions is None:
                return ANYTHING
            conjs.extend(position.conjunctions)
        if len(conjs) > MAX_BRANCHES:
            return ANYTHING
        return Position(tuple(conjs))

    # ---- children --------------------------------------------------------------------------------------------------
    def child_key(self, position: Position, key: str) -> Position:
        """The position of the value of ``key`` in an object at ``position``."""
        if position.conjunctions is None:
            return ANYTHING
        found = position._keys.get(key)
        if found is None:
            parts = []
            for conj in position.conjunctions:
                schemas: list[Any] = []
                for schema in conj:
                    props = schema.get("properties")
                    matched = isinstance(props, dict) and key in props
                    if matched:
                        schemas.append(props[key])
                    patterns = schema.get("patternProperties")
                    for pattern, sub in (patterns.items() if isinstance(patterns, dict) else ()):
                        try:
                            hit = re.search(pattern, key) is not None
                        except re.error:
                            hit = False  # a pattern Python cannot read: its subschema is not applied (nothing added)
                        if hit:
                            schemas.append(sub)
                            matched = True
                    if not matched and "additionalProperties" in schema:
                        schemas.append(schema["additionalProperties"])
                parts.append(schemas)
            found = self._union(parts)
            with self._lock:
                position._keys.setdefault(key, found)
        return found

    def child_index(self, position: Position, index: int) -> Position:
        """The position of item ``index`` of an array at ``position``."""
        if position.conjunctions is None:
            return ANYTHING
        found = position._indexes.get(index)
        if found is None:
            parts = []
            for conj in position.conjunctions:
                schemas: list[Any] = []
                for schema in conj:
                    prefix = schema.get("prefixItems")
                    items = schema.get("items")
                    if isinstance(items, list):  # drafts 4 to 2019-09: a tuple, then additionalItems
                        if index < len(items):
                            schemas.append(items[index])
                        elif "additionalItems" in schema:
                            schemas.append(schema["additionalItems"])
                    elif isinstance(prefix, list) and index < len(prefix):
                        schemas.append(prefix[index])
                    elif items is not None:
                        schemas.append(items)
                parts.append(schemas)
            found = self._union(parts)
            with self._lock:
                position._indexes.setdefault(index, found)
        return found


#: Keywords whose subschemas ``SchemaPositions`` follows (a ``uniqueItems`` reached another way is not enforced).
FOLLOWED = ("properties", "patternProperties", "additionalProperties", "items", "prefixItems", "additionalItems",
            "allOf", "anyOf", "oneOf", "$defs", "definitions")


def unenforced_unique_items(positions: SchemaPositions) -> str | None:
    """What of the schema's ``uniqueItems`` the generation does not enforce: None when every ``uniqueItems: true``
    is on an array whose items are scalars (strings, numbers, booleans, null, their enums), reached through the
    keywords followed; ``"uniqueItems (object or array items)"`` when some array may hold objects or arrays (those
    items are compared only on the finished answer); ``"uniqueItems"`` when some is under a keyword not followed."""
    worst: str | None = None
    stack: list[tuple[Any, bool]] = [(positions.schema, True)]
    while stack:
        item, followed = stack.pop()
        if isinstance(item, list):
            stack.extend((sub, followed) for sub in item)
            continue
        if not isinstance(item, dict):
            continue
        if item.get("uniqueItems") is True:
            if not followed:
                return "uniqueItems"
            if not _scalar_items(positions, item):
                worst = "uniqueItems (object or array items)"
        for key, value in item.items():
            if key in ("enum", "const", "examples", "default"):
                continue
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") \
                    and isinstance(value, dict):
                stack.extend((sub, followed and key in FOLLOWED) for sub in value.values())
            else:
                stack.append((value, followed and key in FOLLOWED))
    return worst


def _scalar_items(positions: SchemaPositions, array_schema: dict) -> bool:
    """Whether every item an array of ``array_schema`` may hold is a scalar (by its types or its enum)."""
    parts: list[Any] = []
    items = array_schema.get("items")
    if items is None or (isinstance(items, list) and "additionalItems" not in array_schema):
        return False
    parts.extend(items if isinstance(items, list) else [items])
    parts.extend(array_schema.get("prefixItems", []) if isinstance(array_schema.get("prefixItems"), list) else [])
    if isinstance(items, list):
        parts.append(array_schema["additionalItems"])
    for part in parts:
        position = positions._position([part])
        if position.conjunctions is None:
            return False
        for conj in position.conjunctions:
            types = [t for t in (_types(s) for s in conj) if t is not None]
            scalar_types = any(not t & {"object", "array"} for t in types)
            scalar_enum = any(
                (isinstance(s.get("enum"), list) and all(value_key(v) is not None for v in s["enum"]))
                or ("const" in s and value_key(s["const"]) is not None) for s in conj)
            if not (scalar_types or scalar_enum):
                return False
    return True
