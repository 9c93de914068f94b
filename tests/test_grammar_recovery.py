"""The grammar engine failing mid-answer (``runtime/grammar/recovery.py``): llguidance's lexer made to run out of its
per-step fuel (the failure issue 33 saw on a real schema, "too many expressions constructed"), through
``ConstraintFactory`` as a request's constraint is made. The answer goes on under the next grammar of the ladder
with its tokens replayed, the failed grammar leaves the cache, and where no step is left the sequence's constraint
raises the engine's error (never an unconstrained answer, never a refusal of a valid token)."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest
from grammar_driver import maskbench_folder
from logitproc import GenerationConfig
from logitproc.runtime.constraints import ConstraintFactory
from logitproc.runtime.grammar import CompiledGrammarCache, GrammarEngineError, GrammarSource, TokenizerAdapter
from logitproc.runtime.grammar.llguidance_backend import LLGuidanceBackend
from logitproc.runtime.response_format import ResponseFormat

V, EOS = 129280, 1
#: A 21-word string: fewer repetitions than the compile-time pattern walk looks at (``risky_patterns``).
WORDS = r"^(?:\S+\s+){0,20}\S+$"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "words"],
          "properties": {"name": {"type": "string"}, "words": {"type": "string", "pattern": WORDS}}}
DOCUMENT = {"name": "x", "words": " ".join(["word"] * 12)}
#: llguidance's per-step lexer fuel (200,000 by default) at which ``WORDS`` fails at the start of its string.
LOW_FUEL = 5000


@pytest.fixture(scope="module")
def adapter(deepseek_adapter: TokenizerAdapter) -> TokenizerAdapter:
    assert (deepseek_adapter.vocab_size, deepseek_adapter.eos_token_ids) == (V, (EOS,))
    return deepseek_adapter


def low_fuel_factory(adapter: TokenizerAdapter, fuel: int = LOW_FUEL) -> ConstraintFactory:
    backend = LLGuidanceBackend(adapter, llguidance.LLParserLimits(step_lexer_fuel=fuel))
    return ConstraintFactory(adapter, V, [EOS], backend=backend, cache=CompiledGrammarCache())


def config(schema: object) -> GenerationConfig:
    return GenerationConfig(response_format=ResponseFormat.json_schema(schema))


def compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def feed(source: GrammarSource, ids: list[int]) -> list[np.ndarray]:
    """Each token fed as in generation (its mask first, the token allowed by it); the masks."""
    rows = []
    for position, token in enumerate(ids):
        row = np.zeros((V + 31) // 32, np.int32)
        source.fill_bitmask(row, ())
        assert row[token // 32] >> (token % 32) & 1, f"token {token} masked at position {position}"
        source.accept_token(token)
        rows.append(row)
    return rows


def test_the_low_fuel_makes_the_engine_fail_and_never_refuse(adapter: TokenizerAdapter) -> None:
    """The premise, on the engine's own matcher (no recovery): the document fails mid-answer with an engine error,
    at this fuel and at a lower one, where a failing lexer inside llguidance's validation once read as a refused
    token."""
    for fuel in (LOW_FUEL, 2000):
        backend = LLGuidanceBackend(adapter, llguidance.LLParserLimits(step_lexer_fuel=fuel))
        matcher = backend.matcher(backend.compile(ResponseFormat.json_schema(SCHEMA)))
        row = np.zeros((V + 31) // 32, np.int32)
        ids = adapter.encode(compact(DOCUMENT))
        with pytest.raises(GrammarEngineError, match="too many expressions constructed"):
            for token in ids:
                matcher.fill_next_token_bitmask(row)
                assert matcher.try_accept_token(token), "an engine failure read as a refusal"
        assert not matcher.is_accepting()


def test_an_answer_goes_on_relaxed_after_the_engine_fails(adapter: TokenizerAdapter) -> None:
    factory = low_fuel_factory(adapter)
    ids = adapter.encode(compact(DOCUMENT))
    source = factory.grammar_source(config(SCHEMA))
    assert source is not None and source.relaxed_keywords == ()
    rows = feed(source, ids)
    assert source.is_accepting
    assert source.recovery is not None and source.recovery.recovered  # it did fail, and went on
    assert any(k.startswith(f"pattern {WORDS} (relaxed mid-answer: llguidance matcher failed: lexer error: too many "
                            "expressions constructed") for k in source.relaxed_keywords), source.relaxed_keywords
    # Every mask equals that of the schema without the pattern (the same grammar until the failure, at the start of
    # the string; the relaxed one after it).
    without = {**SCHEMA, "properties": {**SCHEMA["properties"], "words": {"type": "string"}}}
    reference = feed(low_fuel_factory(adapter).grammar_source(config(without)), ids)
    for position, (row, expected) in enumerate(zip(rows, reference, strict=True)):
        np.testing.assert_array_equal(row, expected, err_msg=f"position {position}")
    # The failed grammar is not served again: a later request gets the relaxed one from its first token, no compile.
    compiles = factory.cache.compiles
    later = factory.grammar_source(config(SCHEMA))
    assert later is not None and later.relaxed_keywords == source.relaxed_keywords
    feed(later, ids)
    assert later.is_accepting and later.recovery is not None and not later.recovery.recovered
    assert factory.cache.compiles == compiles


def test_sequences_failing_on_one_grammar_share_its_replacement(adapter: TokenizerAdapter) -> None:
    """Two sequences started on the same grammar: the first's failure replaces it (llguidance's lexer, shared by
    both, stays failed); the second fails at its next mask and takes the same replacement, made once."""
    factory = low_fuel_factory(adapter)
    ids = adapter.encode(compact(DOCUMENT))
    first, second = factory.grammar_source(config(SCHEMA)), factory.grammar_source(config(SCHEMA))
    assert first is not None and second is not None
    second_rows = feed(second, ids[:3])
    feed(first, ids)
    failures = factory.cache.failures
    second_rows += feed(second, ids[3:])
    assert first.is_accepting and second.is_accepting
    assert second.recovery is not None and len(second.recovery.recovered) == 1
    assert factory.cache.failures == failures
    assert second.relaxed_keywords == first.relaxed_keywords


def test_rollback_and_drafts_after_a_recovery(adapter: TokenizerAdapter) -> None:
    """The replayed matcher holds the whole answer: it rolls back past the failure point and takes a draft path."""
    factory = low_fuel_factory(adapter)
    ids = adapter.encode(compact(DOCUMENT))
    source = factory.grammar_source(config(SCHEMA))
    assert source is not None
    rows = feed(source, ids)
    source.rollback(len(ids) - 2)
    row = np.zeros((V + 31) // 32, np.int32)
    source.fill_bitmask(row, tuple(ids[2:5]))
    np.testing.assert_array_equal(row, rows[5])
    assert feed(source, ids[2:]) and source.is_accepting


def test_no_step_left_ends_the_answer_with_the_engine_error(adapter: TokenizerAdapter) -> None:
    """A regex has no relaxation: after its fresh compile fails too, the constraint raises the engine's error (the
    sequence ends with finish reason "error"), and the cache no longer holds the grammar."""
    factory = low_fuel_factory(adapter, fuel=3000)
    pattern = r"name: [a-z]+, words: (?:\S+\s+){0,20}\S+"
    cfg = GenerationConfig(response_format=ResponseFormat.regex(pattern))
    source = factory.grammar_source(cfg)
    assert source is not None
    with pytest.raises(GrammarEngineError, match="no relaxation of the response format is left"):
        feed(source, adapter.encode("name: x, words: " + " ".join(["word"] * 12)))
    assert len(factory.cache) == 0
    compiles = factory.cache.compiles
    assert factory.grammar_source(cfg) is not None and factory.cache.compiles == compiles + 1


FIFTY_WORDS = r"^(?:\S+\s+){0,49}\S+$"


def test_the_compile_time_walk_reads_the_pattern_with_its_length_bound(adapter: TokenizerAdapter) -> None:
    """A long pattern with ``maxLength`` costs llguidance's lexer several times what the pattern alone does (the
    case of the real schema below): at half the step fuel, the walk of the string as the schema bounds it finds the
    failure before the answer starts, and the pattern is relaxed there; without the bound it survives and stays."""
    factory = low_fuel_factory(adapter, fuel=100_000)
    bounded = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 500,
                                                            "pattern": FIFTY_WORDS}}}
    source = factory.grammar_source(config(bounded))
    assert source is not None and source.relaxed_keywords == (f"pattern {FIFTY_WORDS} (llguidance's lexer limits)",)
    free = {"type": "object", "properties": {"summary": {"type": "string", "pattern": FIFTY_WORDS}}}
    source = factory.grammar_source(config(free))
    assert source is not None and source.relaxed_keywords == ()


@pytest.mark.parametrize("fuel", [100_000, 25_000])
def test_the_real_schema_with_less_fuel(adapter: TokenizerAdapter, fuel: int) -> None:
    """The failure issue 33 measured: ``Github_ultra---o62059`` of the MaskBench sample at half llguidance's step
    fuel failed at the start of its 50-word string (``maxLength: 500``), 4,858 bytes into its valid instance. Now
    the compile-time walk relaxes that pattern before the answer starts; at an eighth of the fuel its two other
    patterns fail too, mid-answer, and the answer goes on with them relaxed (the ladder's third step); the next
    answer starts on the relaxed grammar."""
    folder = maskbench_folder()
    if folder is None:
        pytest.skip("no MaskBench sample on this machine (shared/data/maskbench-dev or $LOGITPROC_MASKBENCH)")
    data = json.loads((folder / "Github_ultra---o62059.json").read_text())
    factory = low_fuel_factory(adapter, fuel=fuel)
    valid = [t["data"] for t in data["tests"] if t["valid"]]
    assert valid
    for answer in range(2):
        source = factory.grammar_source(config(data["schema"]))
        assert source is not None and source.recovery is not None
        feed(source, adapter.encode(compact(valid[0])))
        assert source.is_accepting
        assert bool(source.recovery.recovered) == (fuel < 100_000 and answer == 0)
        relaxed = [k.split(" (")[0] for k in source.relaxed_keywords]
        assert relaxed[0] == f"pattern {FIFTY_WORDS}" and source.relaxed_keywords[0].endswith("(llguidance's lexer "
                                                                                              "limits)")
        assert relaxed[1:] == ([] if fuel == 100_000 else [r"pattern ^(?:\S+\s+){0,9}\S+$", "pattern ^([0-9]{16})$"])


@pytest.fixture(scope="module")
def tiny():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel
    return CompiledModel.open(tiny_model(), target="cpu")


def test_the_engine_goes_on_or_ends_the_one_request(tiny) -> None:
    """The engine on the tiny model with llguidance's step fuel lowered (an engine made for the model's tokenizer,
    passed as ``grammar_backend``): a schema request whose grammar fails mid-answer finishes as usual, its answer
    valid and the pattern reported relaxed; a regex request whose grammar fails with no relaxation left ends with
    "error" naming the engine's failure; a third request in the same batch gives the answer it gives alone."""
    from logitproc.serve.engine import Engine

    probe = Engine(tiny, max_batch=1)
    adapter = TokenizerAdapter(tiny.tokenizer, probe.vocab_size, probe.eos_token_ids)
    backend = LLGuidanceBackend(adapter, llguidance.LLParserLimits(step_lexer_fuel=2000))
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string", "maxLength": 4}}}
    configs = {
        "schema": GenerationConfig(temperature=0, max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
        "regex": GenerationConfig(temperature=0, max_tokens=60, response_format={
            "type": "regex", "regex": r"name: [a-z]{1,3}, words: (?:\S+\s+){0,20}\S+"}),
        "other": GenerationConfig(temperature=0, max_tokens=40, response_format={"type": "json_object"}),
    }
    alone = probe.generate("Hi", configs["other"])[0]
    engine = Engine(tiny, max_batch=3, grammar_backend=backend)
    ids = {name: engine.add_request("Hi", config) for name, config in configs.items()}
    outputs = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.output is not None:
                outputs[delta.request_id] = delta.output
    answer = outputs[ids["schema"]]
    assert answer.finish_reason in ("stop", "length") and answer.error is None
    assert answer.schema_valid is True and answer.grammar_complete
    assert any(k.startswith(f"pattern {WORDS} (relaxed mid-answer: ") for k in answer.relaxed_keywords)
    failed = outputs[ids["regex"]]
    assert failed.finish_reason == "error" and failed.text.startswith("name: ")
    assert "GrammarEngineError" in failed.error and "too many expressions constructed" in failed.error
    assert "no relaxation of the response format is left" in failed.error
    other = outputs[ids["other"]]
    assert (other.text, other.finish_reason, other.error) == (alone.text, alone.finish_reason, None)
