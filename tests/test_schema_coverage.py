"""Real-world schemas compile (issue 14): strictly where llguidance enforces every keyword, else relaxed (the
keywords it does not enforce are recorded), and the finished answer is validated against the whole schema; valid
instances of the JSON-Schema-Test-Suite are accepted by the grammars, invalid ones refused or flagged."""

from __future__ import annotations

import json

import material
import numpy as np
import pytest
from grammar_driver import accepts_value, closer_bonus, drive
from logitproc.runtime import GenerationConfig
from logitproc.runtime.answer_check import check_answer
from logitproc.runtime.grammar import GrammarSource, TokenizerAdapter, get_backend
from logitproc.runtime.grammar.backend import GrammarError
from logitproc.runtime.response_format import ResponseFormat

V, EOS = 129280, 1


@pytest.fixture(scope="module")
def adapter(deepseek_adapter: TokenizerAdapter) -> TokenizerAdapter:
    assert (deepseek_adapter.vocab_size, deepseek_adapter.eos_token_ids) == (V, (EOS,))
    return deepseek_adapter


def test_real_world_schemas_compile_and_their_answers_are_checked(adapter) -> None:
    """check-jsonschema's 26 vendored schemas (CI configs, compose, renovate, dependabot, ...): all compile (strict,
    lenient, rewritten, or with the part that is too large relaxed); random-logit answers validate or are flagged."""
    backend = get_backend("llguidance", adapter)
    bonus = closer_bonus(adapter)
    relaxed = {}
    for index, (name, schema) in enumerate(material.vendored_schemas().items()):
        fmt = ResponseFormat.json_schema(schema)
        compiled = backend.compile(fmt)
        relaxed[name] = backend.relaxed_keywords(compiled)
        gen = drive(GrammarSource(backend.matcher(compiled), adapter), adapter, np.random.default_rng(index), bonus,
                    max_steps=200)
        if gen.finished:
            check = check_answer(fmt, gen.text.decode())
            assert check is not None
            if not relaxed[name]:  # exact grammars give valid answers; relaxed ones are flagged when they are not
                assert check.valid is not False, (name, check.error)
    assert len(relaxed) == 26
    assert relaxed["dependabot"] == ("else", "if", "not", "then", "uniqueItems")
    assert "format: simple-template" in relaxed["mergify"]  # an unknown format is an annotation, never a refusal
    assert relaxed["changie"] == ()  # compiled strictly
    # too large for llguidance's JSON compiler: only the per-task inputs (259 anyOf branches) go unenforced
    assert relaxed["azure-pipelines"] == ("/definitions/task/anyOf: dropped (schema too large)",)


#: ``$schema`` of each Test-Suite draft (its groups mostly leave it out; the grammar and the check need it).
META = {"draft4": "http://json-schema.org/draft-04/schema#", "draft6": "http://json-schema.org/draft-06/schema#",
        "draft7": "http://json-schema.org/draft-07/schema#",
        "draft2019-09": "https://json-schema.org/draft/2019-09/schema",
        "draft2020-12": "https://json-schema.org/draft/2020-12/schema"}
#: Valid instances a grammar refuses on purpose: known ``format``s are enforced while generating (an answer asked to
#: be a ``date-time`` is one), where JSON Schema 2020-12 reads them as annotations; and a custom meta-schema's
#: vocabularies are not read (its ``$schema`` is dropped, the usual vocabularies apply).
DELIBERATE = ("format: ", "vocabulary: schema that uses custom metaschema")


def with_draft(schema, draft: str):
    return {"$schema": META[draft], **schema} if isinstance(schema, dict) and "$schema" not in schema else schema


@pytest.mark.parametrize("draft", list(META))
def test_suite_instances_are_accepted_or_flagged(adapter, draft) -> None:
    """JSON-Schema-Test-Suite, every draft: a schema with a valid instance is never refused, and every valid instance
    is accepted by its grammar as a JSON value (in some spelling: keys in any order, ``1.0`` or ``1``), strict or
    relaxed, apart from the deliberate exceptions above; an invalid one is refused by the grammar or flagged by the
    final validation. Only schemas without a valid instance (``false``) are refused."""
    backend = get_backend("llguidance", adapter)
    refused, missed, unflagged = [], [], []
    valid_count = 0
    for name, group in material.suite_groups(draft):
        fmt = ResponseFormat.json_schema(with_draft(group["schema"], draft))
        try:
            grammar = backend.compile(fmt)
        except GrammarError as err:
            refused.append((name, any(test["valid"] for test in group["tests"]), str(err)))
            continue
        for test in group["tests"]:
            if test["valid"]:
                valid_count += 1
                if not accepts_value(backend.matcher(grammar), adapter, test["data"]) \
                        and not name.startswith(DELIBERATE):
                    missed.append(f"{name}: {json.dumps(test['data'])[:60]}")
                continue
            text = json.dumps(test["data"], ensure_ascii=False)
            matcher, ids = backend.matcher(grammar), adapter.encode(text)
            in_grammar = matcher.try_accept_tokens(ids) == len(ids) and matcher.is_accepting()
            check = check_answer(fmt, text)
            if in_grammar and (check is None or check.valid is True):
                unflagged.append(f"{name}: {text[:60]}")
    assert valid_count > 300
    assert not [r for r in refused if r[1]], refused  # no schema with a valid instance is refused
    assert all("false" in error or "Unsatisfiable" in error for _, _, error in refused), refused
    assert not missed, missed
    assert not unflagged, unflagged


def test_fallback_chain_records_what_it_relaxes(adapter) -> None:
    """Each step of the chain on a schema made for it: what compiles, what is recorded, what the grammar takes."""
    backend = get_backend("llguidance", adapter)

    def relaxed(schema) -> tuple[str, ...]:
        return backend.relaxed_keywords(backend.compile(ResponseFormat.json_schema(schema)))

    assert relaxed(True) == ()  # the schema `true`: any JSON, exactly
    assert relaxed({"type": "integer", "multipleOf": 0.123456789012345678}) == ("multipleOf",)
    overlapping = {"type": "object", "patternProperties": {"a*": {"type": "integer"}, "aaa*": {"maximum": 20}}}
    assert relaxed(overlapping) == ("patternProperties (overlapping patterns)",)
    anchored = {"$schema": META["draft7"], "allOf": [{"$ref": "#foo"}], "definitions": {"A": {"$id": "#foo",
                                                                                              "type": "integer"}}}
    assert relaxed(anchored) == ()  # exact: the anchor written as a JSON pointer
    grammar = backend.compile(ResponseFormat.json_schema(anchored))
    assert accepts_value(backend.matcher(grammar), adapter, 3)
    assert not accepts_value(backend.matcher(grammar), adapter, "x")
    with pytest.raises(GrammarError, match="no JSON value"):
        backend.compile(ResponseFormat.json_schema(False))
    # a broken schema is the request's error, never relaxed into something that compiles
    for broken, says in [({"type": "strnig"}, "at /type"), ({"properties": {"a": {"minimum": "x"}}}, "minimum"),
                         ({"properties": {"a": {"$ref": "#/x"}}}, "names nothing")]:
        with pytest.raises(GrammarError, match=says):
            backend.compile(ResponseFormat.json_schema(broken))
    with pytest.raises(GrammarError, match="Unsatisfiable"):
        backend.compile(ResponseFormat.json_schema({"allOf": [True, False]}))


def test_a_pattern_past_the_lexer_limits_is_relaxed_before_the_request_starts(adapter) -> None:
    """A group repeated 300 times made llguidance's lexer fail a few dozen tokens into an answer (issue 14's engine
    limit case): it is found by walks over the pattern alone at compile time, dropped and recorded; the answers then
    run to their end. A pattern within the limits is kept (checked the same way)."""
    backend = get_backend("llguidance", adapter)
    bonus = closer_bonus(adapter) * 0  # no bonus: long strings, where the limit was hit
    breaking = r"^(\w+\s?){1,300}$"
    fmt = ResponseFormat.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": breaking}},
                                      "required": ["a"]})
    grammar = backend.compile(fmt)
    assert backend.relaxed_keywords(grammar) == (f"pattern {breaking} (llguidance's lexer limits)",)
    for seed in range(2):
        gen = drive(GrammarSource(backend.matcher(grammar), adapter), adapter, np.random.default_rng(seed), bonus,
                    max_steps=80)
        assert not gen.dead_end and len(gen.token_ids) == 80  # no lexer error on the way
    kept = {"type": "string", "pattern": r"^(?:\S+\s+){0,99}\S+$"}  # the issue's pattern: within the limits
    assert backend.relaxed_keywords(backend.compile(ResponseFormat.json_schema(kept))) == ()


def test_an_engine_answer_reports_its_check(adapter) -> None:
    """Output.schema_valid / schema_error / relaxed_keywords on the tiny model (random answers)."""
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel
    from logitproc.serve.engine import Engine

    engine = Engine(CompiledModel.open(tiny_model(), target="cpu"), max_batch=2)
    # uniqueItems of objects is checked on the answer only (scalars are kept unique while generating)
    unique = {"type": "array", "maxItems": 3, "uniqueItems": True, "items": {
        "type": "object", "required": ["a"], "additionalProperties": False, "properties": {"a": {"enum": [1, 2]}}}}
    seen = set()
    for seed in range(6):
        config = GenerationConfig(temperature=0.8, seed=seed, max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"schema": unique}})
        [out] = engine.generate([5, 6, 7], config)
        assert out.relaxed_keywords == ("uniqueItems (object or array items)",)
        assert out.schema_valid is not None
        if out.schema_valid:
            items = [json.dumps(item) for item in json.loads(out.text)]
            assert len(set(items)) == len(items)
        else:
            assert out.schema_error
        seen.add(out.schema_valid)
    [plain] = engine.generate([5, 6, 7], GenerationConfig(max_tokens=3))
    assert plain.schema_valid is None and plain.relaxed_keywords == ()
