"""The llguidance engine (default; MIT, no dependencies): Earley parser over a lexer, masks computed on demand.

Compiling a response format gives a pristine ``LLMatcher`` (grammar parsed and checked once); every sequence gets a
``deep_copy`` of it. A token is validated before it is consumed, because a refused ``consume_token`` leaves an
llguidance matcher in a permanent error state.

A JSON schema is compiled strictly first. When llguidance refuses it only for keywords that validate without shaping
the text it can generate (``uniqueItems``, ``if``/``then``/``else``, ``not``, ``contains``, ``dependentSchemas``,
an unknown ``format``, a ``oneOf`` whose branches may overlap ...), it is compiled again with llguidance's
``lenient`` and ``coerce_one_of`` options: those keywords are not enforced while generating, the grammar records
them (``relaxed_keywords``), and the engine validates the finished answer against the whole schema.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from ..response_format import ResponseFormat
from .backend import GrammarBackend, GrammarError, GrammarMatcher
from .tokenizer_adapter import TokenizerAdapter

#: llguidance's refusals that a relaxed compile (lenient, coerce_one_of) answers: keywords it does not enforce.
RELAXABLE_ERRORS = ("Unimplemented keys", "Unknown format", "oneOf constraints are not supported")
#: Refusals that a rewritten schema answers (``rewrite_schema``): constraints dropped, then validated on the answer.
REWRITABLE_ERRORS = ("min/maxProperties", "circular references with sibling keys", "is not present in a registry",
                     "Expected positive integer")
#: Counting keywords, whose integral float values (``2.0``, valid JSON Schema) llguidance refuses: read as ints.
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "minContains",
           "maxContains")
#: Keywords that only validate (a relaxed grammar drops them); reported when the schema holds them.
VALIDATION_KEYWORDS = ("uniqueItems", "if", "then", "else", "not", "contains", "minContains", "maxContains",
                       "dependentSchemas", "dependentRequired", "dependencies", "unevaluatedProperties",
                       "unevaluatedItems", "propertyNames")

#: llguidance's parser limits: the grammar size raised for large real-world schemas (default 500,000); the lexer's
#: limits stay (raised, ``a{1000000}`` passes the probe and then costs seconds per mask).
LIMITS = llguidance.LLParserLimits(max_grammar_size=2_000_000)

_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA_KEYWORDS = ("enum", "const", "examples", "default")

#: JSON layout: any whitespace between tokens, as vLLM's default, but at most this many characters in a row, so that
#: a sampled output cannot spin in whitespace.
MAX_JSON_WHITESPACE = 16


def first_line(error: str | None) -> str:
    """llguidance's error without the parser state it appends (a dump of 20-odd lines)."""
    return (error or "unknown error").strip().splitlines()[0] if (error or "").strip() else "unknown error"


def json_options(relaxed: bool = False) -> dict[str, Any]:
    options: dict[str, Any] = {"whitespace_flexible": True,
                               "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"}
    if relaxed:
        options.update(lenient=True, coerce_one_of=True)
    return options


def relaxed_keywords(schema: Any, error: str) -> tuple[str, ...]:
    """What a relaxed compile of ``schema`` leaves unenforced: the validating keywords it holds, the formats
    llguidance does not know and ``oneOf`` (named by ``error``, the strict compile's refusal)."""
    found: set[str] = set()
    stack = [schema]
    while stack:  # every subschema: a keyword's value may be a subschema, a list of them, or names to subschemas
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            found.update(k for k in VALIDATION_KEYWORDS if k in item)
            for key, value in item.items():
                if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in _DATA_KEYWORDS:
                    stack.append(value)
    if "Unimplemented keys:" in error:  # the keys llguidance names, e.g. Unimplemented keys: ["$dynamicRef"]
        try:
            found.update(json.loads(error.split("Unimplemented keys:", 1)[1].strip().split("]")[0] + "]"))
        except ValueError:
            pass
    if "Unknown format:" in error:
        found.add("format: " + error.split("Unknown format:", 1)[1].strip().split()[0].strip("\"'."))
    if "oneOf" in error:
        found.add("oneOf")
    return tuple(sorted(found)) or (error,)


def rewrite_schema(schema: Any) -> tuple[Any, tuple[str, ...]]:
    """A copy of ``schema`` without what llguidance cannot build a grammar for, and what was dropped:
    ``minProperties``/``maxProperties`` (llguidance only takes them when every listed key is required), the keywords
    beside a ``$ref`` (a recursive reference with siblings), and references outside the schema (the engine runs
    offline: such a value may be any JSON)."""
    notes: set[str] = set()
    copy = json.loads(json.dumps(schema))
    stack = [copy]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        for key in _COUNTS:  # 2.0 is 2 (exact: nothing dropped)
            if isinstance(item.get(key), float) and item[key].is_integer():
                item[key] = int(item[key])
        for key in ("minProperties", "maxProperties"):
            if key in item:
                del item[key]
                notes.add(key)
        ref = item.get("$ref")
        if isinstance(ref, str):
            if not ref.startswith("#"):
                del item["$ref"]
                notes.add("$ref (outside the schema)")
            elif len(item) > 1:
                for key in [k for k in item if k != "$ref"]:
                    del item[key]
                notes.add("keywords beside $ref")
        stack.extend(v for k, v in item.items() if k not in _DATA_KEYWORDS)
    return copy, tuple(sorted(notes))


class LLGuidanceGrammar:
    """A compiled grammar: the pristine matcher and what its compile relaxed."""

    __slots__ = ("matcher", "relaxed")

    def __init__(self, matcher: llguidance.LLMatcher, relaxed: tuple[str, ...] = ()) -> None:
        self.matcher = matcher
        self.relaxed = relaxed


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("_m", "_adapter", "_eos")

    def __init__(self, matcher: llguidance.LLMatcher, adapter: TokenizerAdapter) -> None:
        self._m = matcher
        self._adapter = adapter
        self._eos = frozenset(adapter.eos_token_ids)

    def fill_next_token_bitmask(self, row: np.ndarray) -> None:
        if self._m.is_error():  # llguidance would allow EOS alone: an error must not pass for a finished answer
            raise GrammarError(f"llguidance matcher failed: {first_line(self._m.get_error())}")
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._m.is_error():
            raise GrammarError(f"llguidance matcher failed: {first_line(self._m.get_error())}")
        self._adapter.clear_padding(row)

    def try_accept_token(self, token_id: int) -> bool:
        token = int(token_id)
        if token in self._eos:  # validate_tokens never counts EOS; it is taken exactly where the grammar accepts
            return self._m.is_accepting() and not self._m.is_error() and bool(self._m.consume_token(token))
        if self._m.validate_tokens([token]) != 1:
            return False
        return bool(self._m.consume_token(token))

    def try_accept_tokens(self, token_ids: list[int]) -> int:
        ids = [int(t) for t in token_ids]
        if self._eos.intersection(ids):
            return super().try_accept_tokens(ids)
        count = self._m.validate_tokens(ids)
        if count and not self._m.consume_tokens(ids[:count]):
            raise GrammarError(f"llguidance refused tokens it had validated: {first_line(self._m.get_error())}")
        return count

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise GrammarError(f"llguidance cannot roll back {num_tokens} tokens: {first_line(self._m.get_error())}")

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def forced_bytes(self) -> bytes:
        return bytes(self._m.compute_ff_bytes())


class LLGuidanceBackend(GrammarBackend):
    """llguidance over the adapter's tokenizer (its JSON), the model's vocabulary size and EOS ids."""

    name = "llguidance"

    def __init__(self, tokenizer: TokenizerAdapter) -> None:
        super().__init__(tokenizer)
        self.lltokenizer = llguidance.LLTokenizer(tokenizer.json, n_vocab=tokenizer.vocab_size,
                                                  eos_token=list(tokenizer.eos_token_ids))
        self._lock = threading.Lock()

    def grammar_text(self, fmt: ResponseFormat, relaxed: bool = False, schema: Any = None) -> str:
        if fmt.kind in ("json_object", "json_schema"):
            text = fmt.text if schema is None else json.dumps(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=json_options(relaxed))
        if fmt.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(fmt.text)
        lark = fmt.text if fmt.syntax == "lark" else gbnf_to_lark(fmt.text)
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def _compile(self, response_format: ResponseFormat, relaxed: bool, schema: Any = None) -> llguidance.LLMatcher:
        try:
            grammar = self.grammar_text(response_format, relaxed, schema)
        except Exception as err:  # the converters raise ValueError or their own errors
            raise GrammarError(f"llguidance cannot read this {response_format.kind}: {err}") from None
        return llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=LIMITS)

    def compile(self, response_format: ResponseFormat) -> LLGuidanceGrammar:
        matcher = self._compile(response_format, relaxed=False)
        relaxed: tuple[str, ...] = ()
        if matcher.is_error() and response_format.kind == "json_schema":
            error = first_line(matcher.get_error())
            if any(e in error for e in RELAXABLE_ERRORS):
                matcher = self._compile(response_format, relaxed=True)
                relaxed = relaxed_keywords(response_format.schema, error)
                error = first_line(matcher.get_error()) if matcher.is_error() else ""
            if any(e in error for e in REWRITABLE_ERRORS):
                schema, dropped = rewrite_schema(response_format.schema)
                matcher = self._compile(response_format, relaxed=True, schema=schema)
                relaxed = tuple(sorted({*relaxed_keywords(response_format.schema, error), *dropped}))
        if matcher.is_error():
            raise GrammarError(f"llguidance cannot compile this {response_format.kind}: "
                               f"{first_line(matcher.get_error())}")
        self._probe(matcher, response_format)
        return LLGuidanceGrammar(matcher, relaxed)

    def relaxed_keywords(self, compiled: LLGuidanceGrammar) -> tuple[str, ...]:
        return compiled.relaxed

    def _probe(self, compiled: llguidance.LLMatcher, response_format: ResponseFormat) -> None:
        """Refuse, before any request starts, a grammar no output can satisfy (no first token and nothing to accept)
        or one whose first token already breaks llguidance's limits (``a{1000000}``): the first mask, and its
        first token consumed, on a copy. Compiled grammars are cached, so this runs once per grammar."""
        probe = compiled.deep_copy()
        row = np.zeros((self.tokenizer.vocab_size + 31) // 32, np.int32)
        probe.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.tokenizer.clear_padding(row)
        what = f"this {response_format.kind}"
        if probe.is_error():
            raise GrammarError(f"llguidance cannot use {what}: {first_line(probe.get_error())}")
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        if not allowed.size:
            if not probe.is_accepting():
                raise GrammarError(f"{what} can never be satisfied: no text matches it")
            return
        if not probe.consume_token(int(allowed[0])) or probe.is_error():
            raise GrammarError(f"llguidance cannot use {what}: {first_line(probe.get_error())} (its limits; "
                               "write the pattern with fewer repetitions)")

    def matcher(self, compiled: LLGuidanceGrammar) -> LLGuidanceMatcher:
        with self._lock:
            copy = compiled.matcher.deep_copy()
        return LLGuidanceMatcher(copy, self.tokenizer)

