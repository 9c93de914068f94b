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
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from ..response_format import ResponseFormat
from .backend import GrammarBackend, GrammarEngineError, GrammarError, GrammarMatcher
from .json_layout import IndentedMatcher, JsonLayout
from .schema_rewrite import (
    DATA_KEYWORDS,
    NAMED_SUBSCHEMAS,
    UNENFORCED,
    drop_patterns,
    drop_string_rules,
    normalize,
    relax_subschemas,
    rewrite_schema,
    risky_patterns,
    risky_strings,
    schema_problem,
    string_rules,
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
#: starts (``schema_rewrite.risky_strings``; a pattern past the limits fails within a few tokens).
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
    """A compiled grammar: the pristine matcher, what its compile relaxed, whether its matchers are held to the
    indented layout, the schema it was compiled from (a JSON schema after the fallback chain; None for other
    formats) and its step on the recovery ladder (``LLGuidanceBackend.after_failure``; 0: as first compiled)."""

    __slots__ = ("matcher", "relaxed", "indented", "schema", "step")

    def __init__(self, matcher: llguidance.LLMatcher, relaxed: tuple[str, ...] = (), indented: bool = False,
                 schema: Any = None, step: int = 0) -> None:
        self.matcher = matcher
        self.relaxed = relaxed
        self.indented = indented
        self.schema = schema
        self.step = step


class LLGuidanceMatcher(GrammarMatcher):
    """One sequence's llguidance matcher. llguidance in its error state (only its own failures put it there: a token
    is validated before it is consumed) raises :class:`GrammarEngineError` from every call that needs the grammar,
    never a refusal nor an empty mask."""

    __slots__ = ("_m", "_adapter", "_eos")

    def __init__(self, matcher: llguidance.LLMatcher, adapter: TokenizerAdapter) -> None:
        self._m = matcher
        self._adapter = adapter
        self._eos = frozenset(adapter.eos_token_ids)

    def _check(self) -> None:
        if self._m.is_error():  # llguidance would allow EOS alone: an error must not pass for a finished answer
            raise GrammarEngineError(f"llguidance matcher failed: {first_line(self._m.get_error())}")

    def fill_next_token_bitmask(self, row: np.ndarray) -> None:
        self._check()
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._check()
        self._adapter.clear_padding(row)

    def try_accept_token(self, token_id: int) -> bool:
        token = int(token_id)
        self._check()
        if token in self._eos:  # validate_tokens never counts EOS; it is taken exactly where the grammar accepts
            if not self._m.is_accepting():
                return False
            consumed = self._m.consume_token(token)
        else:
            if self._m.validate_tokens([token]) != 1:
                self._check()  # the lexer failing inside the validation is not a refusal
                return False
            consumed = self._m.consume_token(token)
        if not consumed:
            self._check()
            raise GrammarEngineError(f"llguidance refused a token it had validated: {token}")
        return True

    def try_accept_tokens(self, token_ids: Sequence[int]) -> int:
        ids = [int(t) for t in token_ids]
        if self._eos.intersection(ids):
            return super().try_accept_tokens(ids)
        self._check()
        count = self._m.validate_tokens(ids)
        if count < len(ids):
            self._check()
        if count and not self._m.consume_tokens(ids[:count]):
            self._check()
            raise GrammarEngineError("llguidance refused tokens it had validated")
        return count

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise GrammarError(f"llguidance cannot roll back {num_tokens} tokens: {first_line(self._m.get_error())}")

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def forced_bytes(self) -> bytes:
        self._check()
        forced = bytes(self._m.compute_ff_bytes())
        self._check()
        return forced


class LLGuidanceBackend(GrammarBackend):
    """llguidance over the adapter's tokenizer (its JSON), the model's vocabulary size and EOS ids; ``limits``: the
    parser's limits (``LIMITS`` unless given: lower ones reproduce the lexer failing mid-answer in tests)."""

    name = "llguidance"

    def __init__(self, tokenizer: TokenizerAdapter, limits: llguidance.LLParserLimits | None = None) -> None:
        super().__init__(tokenizer)
        self.limits = LIMITS if limits is None else limits
        self.lltokenizer = llguidance.LLTokenizer(tokenizer.json, n_vocab=tokenizer.vocab_size,
                                                  eos_token=list(tokenizer.eos_token_ids))
        self._lock = threading.Lock()

    @property
    def cache_name(self) -> str:
        return self.name if self.limits is LIMITS else f"{self.name} {self.limits}"

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
        return llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=self.limits)

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
        broken = {string["pattern"] for string in risky_strings(schema) if not self._string_survives(string)}
        if broken:  # llguidance's lexer limits would end an answer mid-way: relaxed before the request starts
            schema = drop_patterns(schema, broken)
            matcher = self._compile(response_format, relaxed=True, schema=schema)
            if matcher.is_error():
                raise GrammarError(f"llguidance cannot compile this json_schema: {first_line(matcher.get_error())}")
            relaxed = tuple(sorted({*relaxed, *(f"pattern {p} (llguidance's lexer limits)" for p in broken)}))
        self._probe(matcher, response_format)
        return LLGuidanceGrammar(matcher, relaxed, indented=response_format.whitespace == "indented", schema=schema)

    def _string_survives(self, string: dict, seeds: int = 2, steps: int = PATTERN_WALK) -> bool:
        """Whether random walks over the string schema ``string`` alone (a pattern with its length bounds:
        ``risky_strings``; ``seeds`` walks of ``steps`` tokens, fixed seeds, never closing the string) stay within
        llguidance's lexer limits; a pattern past them fails within a few dozen tokens, most at the string's start.
        The walks run on their own compile: llguidance's lexer state is shared by every copy of a compiled grammar,
        and what one walk builds counts against the limit of the others."""
        fmt = ResponseFormat.json_schema(string)
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

    def after_failure(self, response_format: ResponseFormat, failed: LLGuidanceGrammar,
                      error: GrammarEngineError) -> LLGuidanceGrammar | None:
        """The recovery ladder after a matcher of ``failed`` raised ``error`` (``grammar/recovery.py``), from the
        step after ``failed.step``: 1, the same grammar compiled afresh (llguidance's lexer is shared by every
        matcher of a compiled grammar, and once failed it stays failed: a new compile has a lexer of its own); for a
        JSON schema then 2, its risky patterns dropped (``risky_patterns``: groups repeated many times, whose lexer
        states cost most); 3, every pattern and ``format`` dropped; 4, any JSON value. Each step accepts every
        document the one before accepts; a step that changes nothing, or does not compile, is passed over. What a
        step drops is added to the relaxed keywords, with the engine's error."""
        why = f"relaxed mid-answer: {error}"
        schema = failed.schema
        for step in range(failed.step + 1, 5):
            notes: tuple[str, ...] = ()
            if step == 1:
                candidate = schema
            elif response_format.kind != "json_schema":
                return None
            elif step == 2:
                risky = set(risky_patterns(schema))
                if not risky:
                    continue
                candidate, notes = drop_patterns(schema, risky), tuple(f"pattern {p} ({why})" for p in sorted(risky))
            elif step == 3:
                patterns, formats = string_rules(schema)
                if not patterns and not formats:
                    continue
                candidate = drop_string_rules(schema)
                notes = tuple([f"pattern {p} ({why})" for p in sorted(patterns)]
                              + [f"format: {f} ({why})" for f in sorted(formats)])
            else:
                if schema == {}:
                    return None
                candidate, notes = {}, (f"the whole schema: any JSON ({why})",)
            try:
                if response_format.kind == "json_schema":
                    matcher = self._compile(response_format, relaxed=bool(failed.relaxed) or step > 1,
                                            schema=candidate)
                else:
                    matcher = self._compile(response_format, relaxed=False)
            except GrammarError:
                continue
            if matcher.is_error():
                continue
            return LLGuidanceGrammar(matcher, tuple(sorted({*failed.relaxed, *notes})), failed.indented,
                                     schema=candidate, step=step)
        return None

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

