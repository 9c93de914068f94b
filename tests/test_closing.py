"""Answers never cut mid-document (issue 14): near ``max_tokens`` a constrained answer is closed in time by
``DocumentClosing`` (grammar/closing.py), for JSON schemas, regexes and Lark grammars, with both engines; where no
completion fits in the budget, the answer is cut and says so, and nothing fails."""

from __future__ import annotations

import json
import math
import re

import material
import numpy as np
import pytest
from grammar_driver import allowed_ids, closer_bonus, drive
from logitproc.runtime.answer_check import check_answer
from logitproc.runtime.grammar import GrammarSource, TokenizerAdapter, get_backend
from logitproc.runtime.grammar.backend import GrammarError
from logitproc.runtime.grammar.closing import DocumentClosing, shortest_completion
from logitproc.runtime.grammar.completion_hints import completion_hints, shortest_match
from logitproc.runtime.response_format import ResponseFormat, parse_response_format

V, EOS = 129280, 1
ENGINES = ["llguidance", "xgrammar"]
#: check-jsonschema's vendored schemas driven here: small and large minimum completions, strict and relaxed grammars.
VENDORED = ["bitbucket-pipelines", "buildkite", "changie", "citation-file-format", "cloudbuild", "compose-spec",
            "dependabot", "drone-ci", "github-issue-config", "github-issue-forms", "github-workflows", "gitlab-ci",
            "meltano", "mergify", "readthedocs", "renovate", "taskfile", "woodpecker-ci"]
REGEXES = [r"[a-z]+@[a-z]+\.(com|org)", r"\(\d{3}\) \d{3}-\d{4}", r"(ab|cd)+e", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
           r"[A-Z]{2}-\d+"]
LARK = 'start: expr\nexpr: term ("+" term)*\nterm: NUMBER | "(" expr ")" | "[" expr ("," expr)* "]"\nNUMBER: /[0-9]+/\n'


@pytest.fixture(scope="module")
def adapter(deepseek_adapter: TokenizerAdapter) -> TokenizerAdapter:
    assert (deepseek_adapter.vocab_size, deepseek_adapter.eos_token_ids) == (V, (EOS,))
    return deepseek_adapter


def engine(name: str, adapter: TokenizerAdapter):
    if name == "xgrammar":
        pytest.importorskip("xgrammar", reason="the optional xgrammar extra is not installed")
    return get_backend(name, adapter)


def minimum(backend, compiled, adapter, fmt=None) -> int | None:
    """The closing plan's length from the start (an upper bound on the shortest completion)."""
    plan = shortest_completion(backend.matcher(compiled), adapter, hints=completion_hints(fmt))
    return None if plan is None else len(plan)


def mask(source, path=()) -> np.ndarray:
    row = np.full((V + 31) // 32, -1, np.int32)
    if not source.fill_bitmask(row, list(path)):
        row[:] = -1
    return row


@pytest.mark.parametrize("engine_name", ENGINES)
def test_the_completion_search_completes_and_leaves_the_matcher_as_it_was(adapter, engine_name) -> None:
    backend = engine(engine_name, adapter)
    schema = material.vendored_schemas()["dependabot"] if engine_name == "llguidance" else {  # (xgrammar: small)
        "type": "object", "required": ["version", "updates"], "properties": {
            "version": {"enum": [2]}, "updates": {"type": "array", "items": {"type": "string"}}}}
    formats = [ResponseFormat.json_schema(schema),
               parse_response_format({"type": "regex", "regex": REGEXES[1]}),
               parse_response_format({"type": "grammar", "grammar": LARK, "syntax": "lark"})]
    for fmt in formats:
        source = GrammarSource(backend.matcher(backend.compile(fmt)), adapter)
        for token in adapter.encode({"regex": "(12", "grammar": "[(1"}.get(fmt.kind, '{"version"')):
            source.accept_token(token)
        before = mask(source)
        plan = shortest_completion(source.matcher, adapter)
        assert plan, fmt.kind
        assert np.array_equal(mask(source), before)  # rolled back to where it was
        for token in plan:
            source.accept_token(token)
        assert source.is_accepting, (fmt.kind, adapter.decode_bytes(plan))


@pytest.mark.parametrize("spare", [0, 2])
def test_the_closing_uses_only_tokens_the_masks_allow(adapter, spare) -> None:
    """Where llguidance forces bytes, its mask holds one spelling of them, which may not be the tokenizer's: after the
    key ``"authors`` of citation-file-format (forced ``":[{``) it allows ``":`` alone, while the tokenizer spells
    the completion ``":[`` ... A plan of the tokenizer's spelling that binds there (only its next token allowed)
    was a dead end: an answer cut at max_tokens 64 in the closing benchmark. Near the point where it binds, the plan
    is spelled again with tokens the masks allow: no dead end, and the answer closes where that spelling fits."""
    backend = engine("llguidance", adapter)
    fmt = ResponseFormat.json_schema(material.vendored_schemas()["citation-file-format"])
    compiled, hints, bonus = backend.compile(fmt), completion_hints(fmt), closer_bonus(adapter)
    prefix = b'{"abstract":"a","authors'
    for seed in range(2):
        source = GrammarSource(backend.matcher(compiled), adapter)
        for byte in prefix:
            source.accept_token(adapter.byte_tokens[byte])
        plan = shortest_completion(source.matcher, adapter, hints=hints)
        assert plan is not None
        assert not mask(source)[plan[0] >> 5] >> (plan[0] & 31) & 1  # the premise: the mask leaves it out
        budget = len(plan) + spare
        gen = drive(source, adapter, np.random.default_rng(seed), bonus, max_steps=200, patience=10**6,
                    max_tokens=budget, closing=DocumentClosing(source, budget, hints))
        assert not gen.dead_end, (seed, prefix + gen.text)  # the tokenizer's plan would bind at once: a dead end
        assert gen.complete or not spare, (seed, prefix + gen.text)  # (with no spare token, the spelling the masks
        # allow is one token longer: the answer is cut, never stuck)


@pytest.fixture(scope="module")
def vendored(adapter) -> dict[str, tuple[ResponseFormat, object, int | None]]:
    """The VENDORED schemas compiled once: (format, grammar, the plan's length from the start)."""
    backend = engine("llguidance", adapter)
    out = {}
    for name in VENDORED:
        fmt = ResponseFormat.json_schema(material.vendored_schemas()[name])
        compiled = backend.compile(fmt)
        out[name] = (fmt, compiled, minimum(backend, compiled, adapter, fmt))
    return out


def test_every_real_world_schema_has_a_plan_from_the_start(vendored) -> None:
    """With the schema's hints (required keys, a shortest string per pattern) the search finds a completion for
    each schema, citation-file-format (a DOI, dates) and github-workflows (``uses``: ``.../x.yml``) included."""
    assert {name: least for name, (_, _, least) in vendored.items() if least is None} == {}
    assert vendored["citation-file-format"][2] <= 32 and vendored["github-workflows"][2] <= 32
    assert shortest_match(r"^(.+\/)+(.+)\.(ya?ml)(@.+)?$") == "a/a.yml"
    assert shortest_match(r"^10\.\d{4,9}(\.\d+)?/[A-Za-z0-9:/_;\-\.\(\)\[\]\\]+$") == "10.0000/a"
    assert shortest_match(r"(a)\1") is None  # a back-reference is not read off: no hint, never a wrong one


@pytest.mark.parametrize("max_tokens", [16, 32, 64])
def test_real_world_schema_answers_end_as_documents_where_the_minimum_fits(adapter, vendored, max_tokens) -> None:
    """Random-logit answers (no bonus for closing characters: only the closing ends them) on check-jsonschema's
    schemas: complete JSON documents wherever the closing's minimum fits in max_tokens, valid against the whole
    schema when the grammar is exact (a relaxed one's answers are validated and flagged)."""
    backend = engine("llguidance", adapter)
    bonus = closer_bonus(adapter)
    closed = cut = 0
    for index, name in enumerate(VENDORED):
        if max_tokens == 64 and index % 2:  # (at 64, every other schema: the longest runs)
            continue
        fmt, compiled, least = vendored[name]
        assert least is not None, name
        gen = drive(GrammarSource(backend.matcher(compiled), adapter), adapter, np.random.default_rng(index), bonus,
                    max_steps=1000, patience=10**6, max_tokens=max_tokens, hints=completion_hints(fmt))
        assert len(gen.token_ids) <= max_tokens
        if least > max_tokens:
            cut += not gen.complete
            continue
        assert gen.complete, (name, max_tokens, gen.text)
        check = check_answer(fmt, gen.text.decode())
        assert check is not None and (check.valid or backend.relaxed_keywords(compiled)), (name, check)
        closed += gen.closed
    assert closed >= len(VENDORED) // 4  # most answers were ended by the closing, not by chance
    assert max_tokens > 16 or cut  # at 16 tokens some minimums do not fit: those answers are cut, as said


def test_suite_object_schemas_close_within_16_tokens(adapter) -> None:
    """JSON-Schema-Test-Suite (draft 2020-12) schemas of objects, at max_tokens 16."""
    backend = engine("llguidance", adapter)
    bonus = closer_bonus(adapter)
    done = 0
    for index, (name, group) in enumerate(material.suite_groups()):
        schema = group["schema"]
        if not isinstance(schema, dict) or not ({"properties", "required"} & set(schema)) or done >= 40:
            continue
        fmt = ResponseFormat.json_schema(schema)
        try:
            compiled = backend.compile(fmt)
        except GrammarError:
            continue
        if (minimum(backend, compiled, adapter) or 17) > 16:
            continue
        gen = drive(GrammarSource(backend.matcher(compiled), adapter), adapter, np.random.default_rng(index), bonus,
                    max_steps=1000, patience=10**6, max_tokens=16)
        assert gen.complete, (name, gen.text)
        check = check_answer(fmt, gen.text.decode())
        assert check is not None and (check.valid or backend.relaxed_keywords(compiled)), (name, check)
        done += 1
    assert done >= 30


@pytest.mark.parametrize("engine_name", ENGINES)
def test_regex_and_lark_answers_end_as_whole_matches(adapter, engine_name) -> None:
    backend = engine(engine_name, adapter)
    bonus = closer_bonus(adapter)
    formats = [parse_response_format({"type": "regex", "regex": r}) for r in REGEXES]
    formats.append(parse_response_format({"type": "grammar", "grammar": LARK, "syntax": "lark"}))
    for index, fmt in enumerate(formats):
        compiled = backend.compile(fmt)
        least = minimum(backend, compiled, adapter)
        assert least is not None, fmt.text
        for max_tokens in (4, 8, 16, 32):
            gen = drive(GrammarSource(backend.matcher(compiled), adapter), adapter,
                        np.random.default_rng(index * 10 + max_tokens), bonus, max_steps=1000, patience=10**6,
                        max_tokens=max_tokens)
            if least > max_tokens:
                continue
            assert gen.complete, (fmt.text, max_tokens, gen.text)
            if fmt.kind == "regex":
                assert re.fullmatch(fmt.text, gen.text.decode()), (fmt.text, gen.text)


def test_closing_rolls_back_and_decides_the_same_again(adapter) -> None:
    """accept k / rollback k / accept the same samples again: the same masks and the same replacements; then the
    answer ends as a document at exactly max_tokens."""
    backend = engine("llguidance", adapter)
    fmt = ResponseFormat.json_schema({"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}}})
    grammar = GrammarSource(backend.matcher(backend.compile(fmt)), adapter)
    closing = DocumentClosing(grammar, max_tokens=14)
    rng = np.random.default_rng(0)
    committed: list[int] = []

    def step(sample: int | None = None) -> tuple[bytes, int, int]:
        row = mask(grammar) & mask(closing)
        allowed = allowed_ids(row, V)
        if sample is None:
            sample = int(rng.choice(allowed[allowed != EOS]))
        token = closing.closable_token(sample)
        for source in (grammar, closing):
            source.accept_token(token)
        committed.append(token)
        return row.tobytes(), sample, token

    first = [step() for _ in range(8)]
    for source in (grammar, closing):
        source.rollback(3)
    del committed[-3:]
    assert [step(sample) for _, sample, _ in first[5:]] == first[5:]
    while closing.generated < 14:
        step()
    assert grammar.is_accepting and closing.closed and len(committed) == 14
    json.loads(adapter.decode_bytes(committed).decode())


def test_a_draft_path_past_max_tokens_allows_nothing_and_the_plan_token_alone_at_the_end(adapter) -> None:
    backend = engine("llguidance", adapter)
    grammar = GrammarSource(backend.matcher(backend.compile(parse_response_format(
        {"type": "regex", "regex": r"\d{3}-\d{4}"}))), adapter)
    plan = DocumentClosing(grammar, max_tokens=100).plan()
    assert plan is not None
    closing = DocumentClosing(grammar, max_tokens=len(plan))  # the budget equals the plan: only its next token
    assert allowed_ids(mask(closing), V).tolist() == [plan[0]]
    assert not mask(closing, plan).any()  # past max_tokens


# ---- the engine, on the compiled tiny model (a byte vocabulary: the closing's plan is one token per byte) ----------
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                         "n": {"type": "array", "items": {"type": "integer"}}}}


@pytest.fixture(scope="module")
def tiny():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


@pytest.mark.parametrize("speculative", [None, "ngram:4"])
@pytest.mark.parametrize("jump_forward", [False, True])
def test_engine_answers_close_at_max_tokens(tiny, speculative, jump_forward) -> None:
    """n = 3 random answers (temperature 1) at max_tokens 32 and 64 end as whole documents valid against the schema,
    finish_reason "length" and closed_at_max_tokens; at max_tokens 2 no completion fits: cut, said, no error."""
    from logitproc.runtime import GenerationConfig
    from logitproc.serve.engine import Engine
    from logitproc.serve.openai_responses import answer_check

    engine = Engine(tiny, max_batch=4, jump_forward=jump_forward, speculative=speculative)
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    for max_tokens in (32, 64):
        for out in engine.generate("Give me JSON", GenerationConfig(temperature=1.0, seed=5, n=3,
                                                                    max_tokens=max_tokens, response_format=fmt)):
            assert out.grammar_complete and out.schema_valid, out.text
            assert len(out.token_ids) <= max_tokens
            if out.finish_reason == "length":
                assert out.closed_at_max_tokens and "closed to fit max_tokens" in out.closing_note
            assert answer_check(out)["closed_at_max_tokens"] == out.closed_at_max_tokens
    for out in engine.generate("Give me JSON", GenerationConfig(temperature=1.0, seed=5, n=2, max_tokens=2,
                                                                response_format=fmt)):
        assert out.finish_reason == "length" and out.error is None
        assert out.grammar_complete is False and not out.closed_at_max_tokens and out.schema_valid is False
        assert "cut mid-document" in out.closing_note
    plain = engine.generate("Hi", GenerationConfig(max_tokens=3))[0]
    assert plain.grammar_complete is None and answer_check(plain) == {}


def test_engine_regex_answers_close_with_xgrammar_too(tiny) -> None:
    pytest.importorskip("xgrammar", reason="the optional xgrammar extra is not installed")
    from logitproc.runtime import GenerationConfig
    from logitproc.serve.engine import Engine

    pattern = r"[a-z]{2,}@[a-z]+\.(com|org)"
    for backend in ENGINES:
        engine = Engine(tiny, max_batch=4, grammar_backend=backend)
        for out in engine.generate("mail", GenerationConfig(temperature=1.0, seed=1, n=4, max_tokens=12,
                                                            response_format={"type": "regex", "regex": pattern})):
            assert out.grammar_complete and re.fullmatch(pattern, out.text), (backend, out.text)


def test_engine_edge_cases_end_cleanly(tiny) -> None:
    """A format that accepts at once (``a*``) at max_tokens 1; logprobs of closed answers (the closing's forced
    tokens have probability 1); a stop string that trims the document (completeness then unknown, not claimed); a
    thinking budget larger than max_tokens (the think block is ended in time for the document)."""
    from logitproc.runtime import GenerationConfig
    from logitproc.serve.engine import Engine

    engine = Engine(tiny, max_batch=4)
    schema = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": ["a"],
                                                                "properties": {"a": {"type": "string"}}}}}
    for out in engine.generate("x", GenerationConfig(temperature=1.0, seed=2, max_tokens=1, n=2,
                                                     response_format={"type": "regex", "regex": "a*"})):
        assert out.grammar_complete and re.fullmatch("a*", out.text)
    for out in engine.generate("x", GenerationConfig(temperature=1.0, seed=3, max_tokens=16, n=2, logprobs=True,
                                                     top_logprobs=2, response_format=schema)):
        assert out.grammar_complete and out.schema_valid and len(out.logprobs) == len(out.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)
    out = engine.generate("x", GenerationConfig(temperature=1.0, seed=3, max_tokens=9, stop=["}"],
                                                response_format=schema))[0]
    assert out.finish_reason == "stop" and out.grammar_complete is None and "}" not in out.text
    for out in engine.generate("x", GenerationConfig(temperature=1.0, seed=4, max_tokens=24, n=2,
                                                     max_thinking_tokens=200, think_begin="^", think_end="~",
                                                     response_format=schema)):  # thinking ended in time
        assert "~" in out.text and out.grammar_complete and out.schema_valid, out.text
        assert out.closed_at_max_tokens and out.finish_reason == "length"


# ---- the plan and the sequence's other token rules ------------------------------------------------------------------
def rule_driven(adapter, config, seed: int) -> tuple[list[int], bool]:
    """One random answer through every mask source ``ConstraintFactory`` makes for ``config`` (grammar, closing,
    token rules), as the engine runs them: (tokens, whether a row ever allowed nothing)."""
    from logitproc.runtime.constraints import ConstraintFactory

    sources = ConstraintFactory(adapter, V, [EOS]).sources_for(config)
    closing = next(s for s in sources if isinstance(s, DocumentClosing))
    rng, out = np.random.default_rng(seed), []
    while len(out) < config.max_tokens:
        row = np.full((V + 31) // 32, -1, np.int32)
        for source in sources:
            part = mask(source, [])
            row &= part
        allowed = allowed_ids(row, V)
        if not allowed.size:
            return out, True
        token = closing.closable_token(int(rng.choice(allowed[allowed != EOS] if allowed.size > 1 else allowed)))
        if token == EOS:
            break
        for source in sources:
            source.accept_token(token)
        out.append(token)
    return out, False


@pytest.mark.parametrize("rule", ["bad_words", "allowed_token_ids"])
def test_the_plan_respects_bad_words_and_allowed_token_ids(adapter, rule) -> None:
    """The plan's tokens are ones the sequence's token rules allow: with ``"}`` (one token of this tokenizer, the
    tokeniser's way to close ``{"a":"...``) banned, or only one-byte tokens allowed, the closing writes the same bytes
    one token each; before, the plan's banned token left a row with nothing allowed (grammar_dead_end)."""
    from logitproc.runtime import GenerationConfig

    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "string"}}}
    # flexible: a compact grammar forces '{"a":"' from the start, and llguidance then allows only the tokenizer's
    # own tokens for it ('{"'), none of them a one-byte token
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}, "whitespace": "flexible"}
    rules = {"bad_words": {"bad_words": ['"}']},
             "allowed_token_ids": {"allowed_token_ids": sorted({*adapter.byte_tokens.values(), EOS})}}[rule]
    banned = set(adapter.encode('"}'))
    for seed in range(3):
        config = GenerationConfig(max_tokens=12, response_format=fmt, **rules)
        tokens, dead_end = rule_driven(adapter, config, seed)
        assert not dead_end
        text = adapter.decode_bytes(tokens).decode()
        assert json.loads(text).keys() == {"a"}, text
        if rule == "bad_words":
            assert not banned & set(tokens)
        else:
            assert all(len(adapter.token_bytes[t]) == 1 for t in tokens)


def test_a_think_block_is_ended_in_time_for_the_document(adapter) -> None:
    """A thinking budget larger than max_tokens: random thinking would use every token and leave no answer. The
    closing ends the think block when the budget left is the end marker plus the document's plan, then closes the
    document: the text after the marker is whole JSON, every time."""
    from logitproc.runtime import GenerationConfig

    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    for seed in range(3):
        config = GenerationConfig(max_tokens=20, max_thinking_tokens=100, think_end="</end>", response_format={
            "type": "json_schema", "json_schema": {"schema": schema}})
        tokens, dead_end = rule_driven(adapter, config, seed)
        assert not dead_end and len(tokens) <= 20
        thinking, marker, answer = adapter.decode_bytes(tokens).decode().partition("</end>")
        assert marker, thinking
        assert json.loads(answer).keys() == {"a"}, answer


@pytest.mark.parametrize("max_tokens", [None, 10_000])
def test_engine_answers_close_where_the_context_ends(tiny, max_tokens) -> None:
    """A constrained answer whose sequence must end before max_tokens (the context, or its share with n = 2) is
    closed there as a whole document, as at max_tokens: the closing knows the sequence's real limit."""
    from logitproc.runtime import GenerationConfig
    from logitproc.serve.engine import Engine

    engine = Engine(tiny, max_batch=4)
    limit = min(engine.context_length, engine.max_total_tokens // 2)
    prompt = [5 + i % 50 for i in range(limit - 24)]  # 24 tokens of room per sequence
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    for out in engine.generate(prompt, GenerationConfig(temperature=1.0, seed=7, n=2, max_tokens=max_tokens,
                                                        response_format=fmt)):
        assert out.error is None and len(out.token_ids) <= 24
        assert out.grammar_complete and out.schema_valid, out.text
