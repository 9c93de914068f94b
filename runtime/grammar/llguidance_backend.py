"""The llguidance engine (default; MIT, no dependencies): Earley parser over a lexer, masks computed on demand.

Compiling a response format gives a pristine ``LLMatcher`` (grammar parsed and checked once); every sequence gets a
``deep_copy`` of it. A token is validated before it is consumed, because a refused ``consume_token`` leaves an
llguidance matcher in a permanent error state.

A JSON schema goes through a fallback chain before any request starts (``_compile_schema``): exact rewrites
(``schema_rewrite.normalize``), strict, then llguidance's ``lenient``/``coerce_one_of`` for keywords that validate
without shaping the text (``uniqueItems``, ``if``/``then``/``else``, an unknown ``format``, an overlapping ``oneOf``
...), then rewrites for the refusals llguidance names, then the smallest offending subschemas relaxed to any JSON,
at last any JSON; string patterns past llguidance's lexer limits are found by walks and dropped. Only a schema with
no valid instance, or one that is not valid JSON Schema (``schema_problem``), is refused. What each step leaves
unenforced is recorded (``relaxed_keywords``), and the engine validates the finished answer against the whole
schema.
"""

from __future__ import annotations

import json
import threading
from functools import cached_property
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from ..response_format import ResponseFormat
from .backend import GrammarBackend, GrammarError, GrammarMatcher
from .json_layout import IndentedMatcher, JsonLayout
from .schema_rewrite import (
    DATA_KEYWORDS,
    NAMED_SUBSCHEMAS,
    UNENFORCED,
    drop_patterns,
    normalize,
    relax_subschemas,
    rewrite_schema,
    risky_patterns,
    schema_problem,
)
from .tokenizer_adapter import TokenizerAdapter

#: llguidance's refusals that a relaxed compile (lenient, coerce_one_of) answers: keywords it does not enforce.
RELAXABLE_ERRORS = ("Unimplemented keys", "Unknown format", "oneOf constraints are not supported")
#: Refusals that a rewritten schema answers (``schema_rewrite.rewrite_schema``): constraints dropped, then validated
#: on the answer.
REWRITABLE_ERRORS = ("min/maxProperties", "circular references with sibling keys", "is not present in a registry",
                     "too many digits", "are not disjoint", "does not exist")
#: A refusal that no relaxation answers: the schema has no valid instance.
UNSATISFIABLE = "Unsatisfiable schema"
#: Keywords that only validate (a relaxed grammar drops them); reported when the schema holds them.
VALIDATION_KEYWORDS = UNENFORCED

#: llguidance's parser limits: the grammar size raised for large real-world schemas (default 500,000); the lexer's
#: limits stay (raised, ``a{1000000}`` passes the probe and then costs seconds per mask).
LIMITS = llguidance.LLParserLimits(max_grammar_size=2_000_000)


#: Tokens of each random walk that checks a risky string pattern against llguidance's lexer limits before a request
#: starts (``schema_rewrite.risky_patterns``; a pattern past the limits fails within a few tokens).
PATTERN_WALK = 48

#: JSON layout: any whitespace between tokens, as vLLM's default, but at most this many characters in a row, so that
#: a sampled output cannot spin in whitespace.
MAX_JSON_WHITESPACE = 16


def first_line(error: str | None) -> str:
    """llguidance's error without the parser state it appends (a dump of 20-odd lines)."""
    return (error or "unknown error").strip().splitlines()[0] if (error or "").strip() else "unknown error"


def json_options(relaxed: bool = False, whitespace: str = "flexible") -> dict[str, Any]:
    """llguidance's JSON options for a whitespace policy (``response_format.WHITESPACE_POLICIES``): compact, no
    whitespace; flexible, any (at most ``MAX_JSON_WHITESPACE`` in a row); indented, spaces and newlines anywhere,
    held to the layout by ``json_layout.IndentedMatcher``. ``relaxed``: unimplemented keywords ignored, ``oneOf`` as
    ``anyOf``."""
    options: dict[str, Any]
    if whitespace == "compact":
        options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    elif whitespace == "indented":
        options = {"whitespace_flexible": True, "whitespace_pattern": "[\\x20\\x0A]+"}
    else:
        options = {"whitespace_flexible": True,
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
                if key in NAMED_SUBSCHEMAS and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in DATA_KEYWORDS:
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


class LLGuidanceGrammar:
    """A compiled grammar: the pristine matcher, what its compile relaxed, and whether its matchers are held to the
    indented layout."""

    __slots__ = ("matcher", "relaxed", "indented")

    def __init__(self, matcher: llguidance.LLMatcher, relaxed: tuple[str, ...] = (), indented: bool = False) -> None:
        self.matcher = matcher
        self.relaxed = relaxed
        self.indented = indented


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

    @cached_property
    def _closes_string(self) -> np.ndarray:
        """bool ``[vocab_size]``: tokens holding a quote, and EOS (the pattern walks never take them)."""
        tokens = self.tokenizer.token_bytes
        out = np.array([b'"' in t for t in tokens] + [True] * (self.tokenizer.vocab_size - len(tokens)), bool)
        out[list(self.tokenizer.eos_token_ids)] = True
        return out

    def grammar_text(self, fmt: ResponseFormat, relaxed: bool = False, schema: Any = None) -> str:
        if fmt.kind in ("json_object", "json_schema"):
            text = fmt.text if schema is None else json.dumps(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=json_options(relaxed, fmt.whitespace))
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

    def _schema_error(self, response_format: ResponseFormat, schema: Any) -> str | None:
        """Why a relaxed compile of ``schema`` fails (None: it compiles)."""
        try:
            matcher = self._compile(response_format, relaxed=True, schema=schema)
        except GrammarError as err:
            return str(err)
        return first_line(matcher.get_error()) if matcher.is_error() else None

    def compile(self, response_format: ResponseFormat) -> LLGuidanceGrammar:
        if response_format.kind != "json_schema":
            matcher = self._compile(response_format, relaxed=False)
            if matcher.is_error():
                raise GrammarError(f"llguidance cannot compile this {response_format.kind}: "
                                   f"{first_line(matcher.get_error())}")
            self._probe(matcher, response_format)
            return LLGuidanceGrammar(matcher, indented=response_format.whitespace == "indented")
        matcher, relaxed, schema = self._compile_schema(response_format)
        broken = {p for p in risky_patterns(schema) if not self._pattern_survives(p)}
        if broken:  # llguidance's lexer limits would end an answer mid-way: relaxed before the request starts
            matcher = self._compile(response_format, relaxed=True, schema=drop_patterns(schema, broken))
            if matcher.is_error():
                raise GrammarError(f"llguidance cannot compile this json_schema: {first_line(matcher.get_error())}")
            relaxed = tuple(sorted({*relaxed, *(f"pattern {p} (llguidance's lexer limits)" for p in broken)}))
        self._probe(matcher, response_format)
        return LLGuidanceGrammar(matcher, relaxed, indented=response_format.whitespace == "indented")

    def _pattern_survives(self, pattern: str, seeds: int = 2, steps: int = PATTERN_WALK) -> bool:
        """Whether random walks over a string of ``pattern`` alone (``seeds`` walks of ``steps`` tokens, fixed
        seeds, never closing the string) stay within llguidance's lexer limits; a pattern past them fails within a
        few dozen tokens. The walks run on their own compile: llguidance's lexer state is shared by every copy of a
        compiled grammar, and what one walk builds counts against the limit of the others."""
        fmt = ResponseFormat.json_schema({"type": "string", "pattern": pattern})
        try:
            pristine = self._compile(fmt, relaxed=True)
        except GrammarError:
            return False
        row = np.zeros((self.tokenizer.vocab_size + 31) // 32, np.int32)
        quote = self.tokenizer.byte_tokens.get(ord('"'))
        for seed in range(seeds):
            matcher, rng = pristine.deep_copy(), np.random.default_rng(seed)
            if quote is None or not matcher.consume_token(quote):  # the string opened; never closed below
                return True
            for _ in range(steps):
                matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
                self.tokenizer.clear_padding(row)
                allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
                allowed = allowed[~self._closes_string[allowed]]
                if matcher.is_error() or not allowed.size or not matcher.consume_token(int(rng.choice(allowed))):
                    break
            if matcher.is_error():
                return False
        return True

    def _compile_schema(self, fmt: ResponseFormat) -> tuple[llguidance.LLMatcher, tuple[str, ...], Any]:
        """The fallback chain, before any request starts: strict; lenient (validating keywords ignored, ``oneOf`` as
        ``anyOf``); the refused keywords rewritten away; the smallest subschemas that stop it compiling relaxed to
        any JSON; at last any JSON value. Each step records what it does not enforce. Only a schema llguidance
        proves unsatisfiable (no valid instance: ``false``) is refused."""
        original = fmt.schema
        if original is False:
            raise GrammarError("this json_schema is false: no JSON value is valid")
        schema = normalize(original)
        matcher = self._compile(fmt, relaxed=False, schema=schema)
        if not matcher.is_error():
            return matcher, (), schema
        error = strict_error = first_line(matcher.get_error())
        problem = schema_problem(original) if UNSATISFIABLE not in error else None
        if problem is not None:
            raise GrammarError(f"this json_schema is not valid JSON Schema: {problem}")
        notes: set[str] = set()
        if UNSATISFIABLE not in error:
            if any(e in error for e in RELAXABLE_ERRORS):
                error = self._schema_error(fmt, schema) or ""
            for _ in range(3):  # each rewrite answers one kind of refusal; a schema may have a few
                if not any(e in error for e in REWRITABLE_ERRORS):
                    break
                schema, dropped = rewrite_schema(schema, error)
                notes.update(dropped)
                error = self._schema_error(fmt, schema) or ""
            if error and UNSATISFIABLE not in error:
                found = relax_subschemas(schema, lambda candidate: self._schema_error(fmt, candidate))
                if found is not None:
                    schema, parts = found
                    notes.update(f"{part} ({error})" for part in parts)
                else:
                    schema = {}
                    notes.add(f"the whole schema: any JSON ({error})")
                error = self._schema_error(fmt, schema) or ""
        if error:
            raise GrammarError(f"llguidance cannot compile this json_schema: {error}")
        keywords = relaxed_keywords(original, strict_error)
        notes.update(keywords if keywords != (strict_error,) or not notes else ())
        return self._compile(fmt, relaxed=True, schema=schema), tuple(sorted(notes)), schema

    def relaxed_keywords(self, compiled: LLGuidanceGrammar) -> tuple[str, ...]:
        return compiled.relaxed

    def unrewritten(self, fmt: ResponseFormat) -> llguidance.LLMatcher | None:
        """llguidance alone on the schema as given (relaxed: lenient, ``oneOf`` as ``anyOf``; none of the chain's
        rewrites), a fresh matcher; None when it cannot compile it. The reference for what the chain's rewrites
        change (``scripts/bench_grammar.py``, ``tests/test_grammar_rewrites.py``)."""
        try:
            matcher = self._compile(fmt, relaxed=True)
        except GrammarError:
            return None
        return None if matcher.is_error() else matcher

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

    @cached_property
    def layout(self) -> JsonLayout:
        """The indented layout's rows for this tokenizer (made on first use)."""
        return JsonLayout(self.tokenizer)

    def matcher(self, compiled: LLGuidanceGrammar) -> GrammarMatcher:
        with self._lock:
            copy = compiled.matcher.deep_copy()
        matcher = LLGuidanceMatcher(copy, self.tokenizer)
        return IndentedMatcher(matcher, self.layout) if compiled.indented else matcher

