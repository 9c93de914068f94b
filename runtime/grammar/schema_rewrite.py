"""Rewriting a JSON schema into one the grammar engine can compile: exact rewrites first, then the relaxations of
the fallback chain, each recording what it no longer enforces (the finished answer is validated against the
original schema afterwards).

* :func:`normalize` (exact: the same instances are valid): the schema ``true`` as ``{}``; in drafts 4 to 7, the
  keywords beside a ``$ref`` dropped (those drafts ignore them); counts written ``2.0`` as ``2``.
* :func:`resolve_anchors` (exact, when llguidance cannot find an anchor): a ``$ref`` to a location-independent
  identifier (``#foo``: ``$anchor`` or draft 6/7's ``$id: "#foo"``) as a JSON pointer.
* :func:`rewrite_schema` (relaxed): keywords llguidance cannot build a grammar for dropped: ``min/maxProperties``,
  keywords beside a recursive ``$ref``, references outside the schema (nothing is fetched: any value), a
  ``multipleOf`` with too many digits, ``patternProperties`` whose patterns overlap, a custom meta-schema.
* :func:`drop_patterns` (relaxed): string patterns that break llguidance's lexer limits while an answer is
  generated (a group repeated many times, ``^(\\w+\\s?){1,300}$``), found before the request starts by a walk
  over each of :func:`risky_strings` (the pattern with its string's length bounds) alone.
* :func:`drop_string_rules` (relaxed): every pattern and ``format``, a step of the recovery after the engine
  failed mid-answer (``llguidance_backend.LLGuidanceBackend.after_failure``).
* :func:`relax_subschemas` (relaxed): for any other refusal (``schema too large``, ...), the smallest subschemas
  whose replacement by ``{}`` (any JSON value) lets the schema compile, found by a bounded top-down search.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

#: Keywords whose value maps names to subschemas.
NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: Keywords whose value is a list of subschemas.
LISTED_SUBSCHEMAS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
#: Keywords whose value is one subschema.
SINGLE_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
                     "propertyNames", "unevaluatedItems", "unevaluatedProperties")
#: Single-subschema keywords that ``{}`` would narrow (``not: {}`` refuses everything, ``if: {}`` always applies
#: ``then``, ``contains: {}`` needs an item): the relaxation drops them instead.
NARROWED_BY_ANY = ("not", "if", "contains")
#: Keywords llguidance does not implement: its lenient compile ignores them (the answer's validation checks them).
UNENFORCED = ("uniqueItems", "if", "then", "else", "not", "contains", "minContains", "maxContains",
              "dependentSchemas", "dependentRequired", "dependencies", "unevaluatedProperties", "unevaluatedItems",
              "propertyNames")
#: Keywords that name a subschema (``$dynamicRef``, ``$recursiveRef`` and ``$ref`` resolve through them): a subschema
#: relaxed to any JSON keeps them.
IDENTIFIERS = ("$id", "$anchor", "$dynamicAnchor", "$recursiveAnchor")
#: Keywords whose value is data (never a subschema).
DATA_KEYWORDS = ("enum", "const", "examples", "default")
#: Counting keywords, whose integral float values (``2.0``, valid JSON Schema) llguidance refuses.
COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "minContains",
          "maxContains")
#: Drafts in which the keywords beside a ``$ref`` are ignored.
OLD_DRAFTS = ("draft-04", "draft-06", "draft-07")
#: Meta-schemas llguidance knows (any other ``$schema`` is a custom meta-schema it would try to fetch).
KNOWN_META = ("json-schema.org/",)

Path = tuple[Any, ...]

#: A group repeated at least this many times (``(...){1,300}``) is what makes llguidance's lexer blow up.
RISKY_REPEAT = 32
_GROUP_REPEAT = re.compile(r"\)[*+?]?\{(\d+),?(\d*)\}")


def copy_of(schema: Any) -> Any:
    return json.loads(json.dumps(schema))


def _dicts(schema: Any) -> Iterator[tuple[Path, dict]]:
    """Every subschema that is an object, with its path (data keywords skipped)."""
    stack: list[tuple[Path, Any]] = [((), schema)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, list):
            stack.extend((path + (i,), v) for i, v in enumerate(item))
        elif isinstance(item, dict):
            yield path, item
            stack.extend((path + (k,), v) for k, v in item.items() if k not in DATA_KEYWORDS)


def _anchor_name(ref: str) -> str | None:
    """``foo`` for ``#foo`` or ``some.json#foo`` (a plain-name fragment, not a JSON pointer)."""
    fragment = ref.rpartition("#")[2] if "#" in ref else ""
    return fragment if fragment and not fragment.startswith("/") else None


def _pointer(path: Path) -> str:
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _subschemas(schema: Any) -> Iterator[tuple[Path, dict]]:
    """Every subschema that is an object, with its path: only at schema positions (the values of ``properties``,
    never the map itself, so a property named ``not`` or ``minProperties`` is not read as a keyword). A subschema
    may be changed when it is yielded: its children are read after."""
    stack: list[tuple[Path, Any]] = [((), schema)]
    while stack:
        path, item = stack.pop()
        if not isinstance(item, dict):
            continue
        yield path, item
        for key, value in item.items():
            if key in NAMED_SUBSCHEMAS and isinstance(value, dict):
                stack.extend((path + (key, name), sub) for name, sub in value.items())
            elif key in LISTED_SUBSCHEMAS and isinstance(value, list):
                stack.extend((path + (key, i), sub) for i, sub in enumerate(value))
            elif key in SINGLE_SUBSCHEMAS:
                stack.append((path + (key,), value))


def lenient_reading(schema: Any) -> Any:
    """``schema`` (changed in place) as llguidance's relaxed compile reads it: without the ``UNENFORCED`` keywords,
    ``oneOf`` as ``anyOf`` (``coerce_one_of``). It accepts everything ``schema`` accepts, and compiles to the same
    grammar; every relaxed rewrite starts from it, so that dropping a part never narrows what is valid (a part
    under ``not``, a branch of a ``oneOf``, or one whose annotations ``unevaluatedProperties`` read)."""
    for _path, item in _subschemas(schema):
        for key in UNENFORCED:
            item.pop(key, None)
        if isinstance(item.get("oneOf"), list):
            branches = item.pop("oneOf")
            if "anyOf" in item:
                item["allOf"] = [*item.get("allOf", []), {"anyOf": branches}]
            else:
                item["anyOf"] = branches
    return schema


def normalize(schema: Any) -> Any:
    """An equivalent copy of ``schema`` that llguidance reads as JSON Schema means it (see the module doc)."""
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        return schema
    copy = copy_of(schema)
    old_draft = any(d in str(copy.get("$schema", "")) for d in OLD_DRAFTS)
    for path, item in _dicts(copy):
        for key in COUNTS:
            if isinstance(item.get(key), float) and item[key].is_integer():
                item[key] = int(item[key])
        if old_draft and path and isinstance(item.get("$ref"), str):  # siblings ignored (the root keeps its defs)
            for key in [k for k in item if k != "$ref"]:
                del item[key]
    return copy


def resolve_anchors(schema: Any) -> Any:
    """``schema`` with every ``$ref`` to a plain-name fragment (``#foo``, ``other.json#foo``) that names exactly one
    ``$anchor`` (or draft 6/7 ``$id: "#foo"``) written as a JSON pointer to it (exact)."""
    copy = copy_of(schema)
    anchors: dict[str, list[Path]] = {}
    for path, item in _dicts(copy):
        name = item.get("$anchor") if isinstance(item.get("$anchor"), str) else None
        if name is None and isinstance(item.get("$id"), str) and item["$id"].startswith("#"):
            name = _anchor_name(item["$id"])
        if name:
            anchors.setdefault(name, []).append(path)
    for _path, item in _dicts(copy):
        ref = item.get("$ref")
        name = _anchor_name(ref) if isinstance(ref, str) else None
        if name and len(anchors.get(name, ())) == 1:
            item["$ref"] = _pointer(anchors[name][0])
    return copy


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a valid JSON Schema (its meta-schema refuses it, or a ``$ref`` JSON pointer names
    nothing in it), or None. A broken schema is the request's error, never relaxed into something that compiles."""
    import jsonschema

    try:  # the meta-schema without its format checks (an ECMA pattern such as \p{Cc} is not Python's)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        err = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    except Exception:  # noqa: BLE001 - an unknown meta-schema: nothing to check against
        err = None
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path)
        return f"{err.message}" + (f" (at /{where})" if where else "")
    found = list(_dicts(schema))
    if any(path and isinstance(item.get("$id"), str) for path, item in found):
        return None  # embedded resources: pointers may be relative to them
    for _path, item in found:
        ref = item.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            try:
                _at(schema, tuple(p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")))
            except (KeyError, IndexError, TypeError):
                return f"$ref {ref} names nothing in the schema"
    return None


def rewrite_schema(schema: Any, error: str) -> tuple[Any, tuple[str, ...]]:
    """A copy of ``schema`` without what llguidance refused (``error``) and cannot build a grammar for, and what was
    dropped (see the module doc)."""
    notes: set[str] = set()
    copy = lenient_reading(resolve_anchors(schema) if "does not exist" in error else copy_of(schema))
    if isinstance(copy, dict) and "$schema" in copy and not any(m in str(copy["$schema"]) for m in KNOWN_META):
        del copy["$schema"]
        notes.add("$schema (a custom meta-schema)")
    for _path, item in _subschemas(copy):
        for key in ("minProperties", "maxProperties"):
            if key in item:
                del item[key]
                notes.add(key)
        if "too many digits" in error and isinstance(item.get("multipleOf"), float):
            del item["multipleOf"]
            notes.add("multipleOf")
        if "not disjoint" in error and isinstance(item.get("patternProperties"), dict) \
                and len(item["patternProperties"]) > 1:
            item.pop("additionalProperties", None)
            item.pop("unevaluatedProperties", None)
            del item["patternProperties"]
            notes.add("patternProperties (overlapping patterns)")
        ref = item.get("$ref")
        if isinstance(ref, str):
            if not ref.startswith("#"):
                del item["$ref"]
                notes.add("$ref (outside the schema)")
            elif len(item) > 1 and "circular" in error:
                for key in [k for k in item if k != "$ref"]:
                    del item[key]
                notes.add("keywords beside $ref")
    return copy, tuple(sorted(notes))


#: String keywords that narrow a pattern's lexer state with it (``maxLength`` beside a long pattern is the costly
#: case: the lexer builds the intersection of both).
STRING_BOUNDS = ("minLength", "maxLength", "format")


def risky_strings(schema: Any) -> list[dict]:
    """The string schemas of ``schema`` whose ``pattern`` (or ``patternProperties`` name) repeats a group
    ``RISKY_REPEAT`` times or more, with the keywords that bound the string with it (``STRING_BOUNDS``): those
    whose lexer state can outgrow llguidance's limits mid-answer, as the lexer builds it (a ``{0,49}``-word
    pattern with ``maxLength: 500`` costs several times what the pattern alone does)."""
    found: list[dict] = []
    for _path, item in _subschemas(schema):
        strings = []
        if isinstance(item.get("pattern"), str):
            strings.append({"type": "string", "pattern": item["pattern"],
                            **{k: item[k] for k in STRING_BOUNDS if k in item}})
        if isinstance(item.get("patternProperties"), dict):
            strings += [{"type": "string", "pattern": name} for name in item["patternProperties"]]
        for string in strings:
            counts = [int(n or m) for m, n in _GROUP_REPEAT.findall(string["pattern"])]
            if any(c >= RISKY_REPEAT for c in counts) and string not in found:
                found.append(string)
    return found


def risky_patterns(schema: Any) -> list[str]:
    """The patterns of :func:`risky_strings`."""
    return list(dict.fromkeys(string["pattern"] for string in risky_strings(schema)))


def drop_patterns(schema: Any, patterns: set[str]) -> Any:
    """A copy of ``schema`` without the ``pattern`` keywords (and ``patternProperties`` entries, whose names then
    fall to ``additionalProperties``: dropped too) holding one of ``patterns``."""
    copy = lenient_reading(copy_of(schema))
    for _path, item in _subschemas(copy):
        if item.get("pattern") in patterns:
            del item["pattern"]
        named = item.get("patternProperties")
        if isinstance(named, dict) and patterns.intersection(named):
            for pattern in patterns.intersection(named):
                del named[pattern]
            item.pop("additionalProperties", None)
    return copy


def string_rules(schema: Any) -> tuple[set[str], set[str]]:
    """Every string ``pattern`` (and ``patternProperties`` name) and every ``format`` of ``schema``."""
    patterns: set[str] = set()
    formats: set[str] = set()
    for _path, item in _subschemas(schema):
        if isinstance(item.get("pattern"), str):
            patterns.add(item["pattern"])
        if isinstance(item.get("patternProperties"), dict):
            patterns.update(item["patternProperties"])
        if isinstance(item.get("format"), str):
            formats.add(item["format"])
    return patterns, formats


def drop_string_rules(schema: Any) -> Any:
    """A copy of ``schema`` without any string pattern or ``format`` (:func:`string_rules`): what a grammar engine's
    lexer builds states for beyond plain JSON strings."""
    patterns, _formats = string_rules(schema)
    copy = drop_patterns(schema, patterns)
    for _path, item in _subschemas(copy):
        item.pop("format", None)
    return copy


def _children(path: Path, item: dict) -> Iterator[tuple[Path, str]]:
    """The parts of the subschema at ``path`` that the search may relax, each only widening what is valid:
    ``(path, "drop")`` removes a keyword that combines subschemas (anyOf, allOf, ...), or one that ``{}`` would
    narrow (``NARROWED_BY_ANY``), from its object; ``(path, "any")`` replaces one subschema by ``{}``."""
    for key, value in item.items():
        if key in NAMED_SUBSCHEMAS and isinstance(value, dict):
            yield from ((path + (key, name), "any") for name, sub in value.items() if isinstance(sub, dict))
        elif key in LISTED_SUBSCHEMAS and isinstance(value, list):
            yield path + (key,), "drop"
        elif key in SINGLE_SUBSCHEMAS and isinstance(value, dict):
            yield path + (key,), "drop" if key in NARROWED_BY_ANY else "any"


def relaxations(schema: Any) -> Iterator[tuple[Path, str]]:
    """Every relaxation the search of :func:`relax_subschemas` may choose in ``schema`` (it goes down only into the
    subschemas it would replace by ``{}``, never into ``not``, ``if`` or ``contains``)."""
    stack: list[Path] = [()] if isinstance(schema, dict) else []
    while stack:
        frontier = stack.pop()
        for path, action in _children(frontier, _at(schema, frontier)):
            yield path, action
            if action == "any" and isinstance(_at(schema, path), dict):
                stack.append(path)


def _at(schema: Any, path: Path) -> Any:
    for part in path:
        schema = schema[int(part)] if isinstance(schema, list) else schema[part]
    return schema


def apply_relaxations(schema: Any, relaxations: list[tuple[Path, str]]) -> Any:
    """A copy of ``schema`` with each ``(path, action)`` of :func:`relaxations` applied."""
    copy = copy_of(schema)
    for path, action in relaxations:
        if not path:
            return {}
        parent = _at(copy, path[:-1])
        if action == "drop":
            parent.pop(path[-1], None)
            if path[-1] == "prefixItems":  # 2020-12's items would then apply to every item, not only the rest
                parent.pop("items", None)
        else:
            kept = _at(copy, path)
            parent[path[-1]] = {k: v for k, v in kept.items() if k in IDENTIFIERS} if isinstance(kept, dict) else {}
    return copy


def _size(value: Any) -> int:
    return len(json.dumps(value))


def relax_subschemas(schema: Any, error_of: Callable[[Any], str | None],
                     max_tries: int = 40) -> tuple[Any, tuple[str, ...]] | None:
    """The schema with the fewest, deepest subschemas relaxed that ``error_of`` (None: it compiles) accepts, and
    what was relaxed; None when ``max_tries`` compiles find nothing.

    Top-down: at a subschema, each of its parts is tried relaxed (largest first); the first one that makes the whole
    schema compile is kept and the search goes into it, looking for a smaller part that suffices; when none of its
    own parts does, that part is relaxed whole. A part of a list keyword (one branch of an anyOf) is not tried alone:
    the keyword is dropped whole. The search runs on the schema's :func:`lenient_reading` (what it relaxes is
    never under a ``not`` nor a ``oneOf`` branch)."""
    schema = lenient_reading(copy_of(schema))
    tries = 0
    chosen: list[tuple[Path, str]] = []
    frontier: Path | None = ()
    while frontier is not None:
        item = _at(schema, frontier)
        candidates = sorted(_children(frontier, item), key=lambda c: -_size(_at(schema, c[0])))
        found = None
        for path, action in candidates:
            if tries >= max_tries:
                break
            tries += 1
            if error_of(apply_relaxations(schema, [path_action for path_action in chosen if path_action[0] != frontier]
                               + [(path, action)])) is None:
                found = (path, action)
                break
        if found is None:
            break
        chosen = [c for c in chosen if c[0] != frontier] + [found]
        frontier = found[0] if found[1] == "any" and isinstance(_at(schema, found[0]), dict) else None
    if not chosen:
        return None
    relaxed = apply_relaxations(schema, chosen)
    notes = tuple(sorted(f"{_pointer(path)[1:] or '/'}: {'dropped' if action == 'drop' else 'any JSON'}"
                         for path, action in chosen))
    return relaxed, notes
