"""``uniqueItems`` while generating (issue 33): the document automaton on text, the wrapped matcher's masks against
a walk of every allowed token, rollback, random-logit answers on DeepSeek-V3's vocabulary with both engines, answers
closed within a small budget, and the tiny model sampling at temperature 1 through the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from grammar_driver import allowed_ids, closer_bonus, drive
from logitproc.runtime.config import GenerationConfig
from logitproc.runtime.constraints import ConstraintFactory
from logitproc.runtime.grammar import TokenizerAdapter
from logitproc.runtime.grammar.unique_items import START, UniqueItems, UniqueItemsMatcher
from logitproc.runtime.grammar.unique_positions import SchemaPositions, unenforced_unique_items

V, EOS = 129280, 1
ENGINES = ["llguidance", "xgrammar"]

NESTED = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "nums": {"type": "array", "items": {"type": "number"}, "uniqueItems": True},
        "flags": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
        "colors": {"type": "array", "items": {"enum": ["red", "green"]}, "uniqueItems": True},
        "free": {"type": "array", "items": {"type": "string"}},
        "either": {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "string"}]},
        "both": {"anyOf": [{"type": "array", "uniqueItems": True}, {"type": "null"}]},
        "groups": {"type": "array", "items": {"type": "object", "properties": {"t": {"$ref": "#/$defs/ids"}}}},
    },
    "$defs": {"ids": {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}},
}


@pytest.mark.parametrize(("text", "kept"), [
    ('{"tags":["a","b"]}', True),
    ('{"tags":["a","a"]}', False),
    ('{"tags":["a","\\u0061"]}', False),  # equal after unescaping
    ('{"tags":["é","\\u00e9","x"]}', False),
    ('{"tags":["a","ab","b"]}', True),
    ('{"nums":[1,1.0]}', False),  # 1 and 1.0 are equal in JSON Schema
    ('{"nums":[1, 1e0 ]}', False),
    ('{"nums":[1,10,100]}', True),
    ('{"nums":[0,-0]}', False),
    ('{"nums":[0,0e0101010101010101010101]}', False),  # any exponent: exact values
    ('{"nums":[1e400,2e400]}', False),  # both inf as doubles (as Python's json reads them): kept apart too
    ('{"nums":[0.5,5e-1,1]}', False),
    ('{"nums":[1,"1",true]}', True),  # different types are different values
    ('{"flags":[true,false]}', True),
    ('{"flags":[true,t', False),  # can only become a duplicate: refused at once
    ('{"flags":[true,false,', False),  # every boolean used: no further item
    ('{"colors":["red","green",', False),
    ('{"colors":["red","r', False),
    ('{"colors":["red","g', True),
    ('{"free":["a","a"]}', True),  # no uniqueItems there
    ('{"either":[1,1]}', True),  # one branch without uniqueItems: not required
    ('{"both":[null,null]}', False),  # every branch that admits an array requires it
    ('{"groups":[{"t":[1,2]},{"t":[1,2]}]}', True),  # objects as items: not compared
    ('{"groups":[{"t":[1,2]},{"t":[3,3', True),
    ('{"groups":[{"t":[1,2]},{"t":[3,3]', False),  # nested: an array inside objects inside an array
    ('{"groups":[{"t":[1,2]},{"t":[3,\n  3\n]', False),
])
def test_the_automaton_refuses_a_duplicate_where_it_completes(text: str, kept: bool) -> None:
    rules = UniqueItems(SchemaPositions(NESTED))
    assert (rules.advance(START, text.encode()) is not None) == kept


def test_what_is_reported_as_not_enforced() -> None:
    scalar = {"type": "array", "uniqueItems": True, "items": {"enum": ["a", 1, None]}}
    objects = {"type": "array", "uniqueItems": True, "items": {"type": "object"}}
    under_not = {"not": {"type": "array", "uniqueItems": True, "items": {"type": "string"}}}
    assert unenforced_unique_items(SchemaPositions(scalar)) is None
    nested = {**NESTED, "properties": {k: v for k, v in NESTED["properties"].items() if k != "both"}}
    assert unenforced_unique_items(SchemaPositions(nested)) is None
    assert unenforced_unique_items(SchemaPositions(NESTED)) == "uniqueItems (object or array items)"  # "both"
    assert unenforced_unique_items(SchemaPositions(objects)) == "uniqueItems (object or array items)"
    assert unenforced_unique_items(SchemaPositions({"type": "array", "uniqueItems": True})) == \
        "uniqueItems (object or array items)"
    assert unenforced_unique_items(SchemaPositions(under_not)) == "uniqueItems"


@pytest.fixture(scope="module")
def adapter(deepseek_adapter: TokenizerAdapter) -> TokenizerAdapter:
    assert (deepseek_adapter.vocab_size, deepseek_adapter.eos_token_ids) == (V, (EOS,))
    return deepseek_adapter


@pytest.fixture(scope="module")
def factories(adapter: TokenizerAdapter) -> dict[str, ConstraintFactory]:
    return {engine: ConstraintFactory(adapter, V, [EOS], backend=engine) for engine in ENGINES}


def _engine(factories: dict[str, ConstraintFactory], engine: str) -> ConstraintFactory:
    if engine == "xgrammar":
        pytest.importorskip("xgrammar", reason="the optional xgrammar extra is not installed")
    return factories[engine]


def _config(schema: dict, whitespace: str = "compact", **extra) -> GenerationConfig:
    return GenerationConfig(response_format={"type": "json_schema", "json_schema": {"schema": schema},
                                             "whitespace": whitespace}, **extra)


def _walked_row(matcher: UniqueItemsMatcher, adapter: TokenizerAdapter, in_string: bool) -> np.ndarray:
    """The mask the wrapper must give: the inner grammar's row, each allowed token walked by the automaton (inside a
    string that allows much of the vocabulary, those that cannot leave it, without a quote or a backslash, are not
    walked: such a string's values are unbounded)."""
    row = np.zeros((V + 31) // 32, np.int32)
    matcher.inner.fill_next_token_bitmask(row)
    flat = row.view(np.uint32)
    allowed = allowed_ids(row, V)
    for token in allowed:
        data = adapter.token_bytes[token]
        if in_string and allowed.size > 2000 and b'"' not in data and b"\\" not in data:
            continue
        if data and matcher.rules.advance(matcher.state, data) is None:
            flat[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
    return row


MASK_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["tags", "nums", "flags", "colors"],
               "properties": {
                   "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                   "nums": {"type": "array", "items": {"type": "number"}, "uniqueItems": True},
                   "flags": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
                   "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "uniqueItems": True}}}
DOCUMENT = '{"tags":["a","the","a b","th"],"nums":[1,12,1.5,-3],"flags":[true,false],"colors":["red","blue","green"]}'


@pytest.mark.parametrize(("engine", "whitespace"), [("llguidance", "compact"), ("llguidance", "flexible"),
                                                     ("xgrammar", "compact")])
def test_the_mask_is_the_grammars_without_the_tokens_that_complete_a_duplicate(adapter, factories, engine,
                                                                                 whitespace) -> None:
    """At every byte of a document, the wrapper's mask equals the grammar's with every allowed token walked (the
    token classes and the fast path for string ends lose nothing and refuse nothing more); the tokens that would
    repeat an item are among those refused."""
    factory = _engine(factories, engine)
    source = factory.grammar_source(_config(MASK_SCHEMA, whitespace))
    matcher = source.matcher
    assert isinstance(matcher, UniqueItemsMatcher)
    row = np.zeros((V + 31) // 32, np.int32)
    refused_somewhere = set()
    in_string = False
    for index, byte in enumerate(DOCUMENT.encode()):
        matcher.fill_next_token_bitmask(row)
        expected = _walked_row(matcher, adapter, in_string)
        in_string ^= byte == ord('"') and DOCUMENT[index - 1] != "\\"
        assert np.array_equal(row, expected), DOCUMENT.encode()[: len(matcher._states) - 1]
        inner = np.zeros_like(row)
        matcher.inner.fill_next_token_bitmask(inner)
        refused_somewhere |= {adapter.token_bytes[t] for t in allowed_ids(inner & ~row, V)}
        assert source.matcher.try_accept_token(adapter.byte_tokens[byte])
    assert source.is_accepting
    assert {b'"', b'",', b'"]', b",", b"]", b"t"} <= refused_somewhere  # "a" again; 1 again; true again; a 4th colour


def _prefix(factory: ConstraintFactory, adapter: TokenizerAdapter, schema: dict, text: str):
    source = factory.grammar_source(_config(schema))
    ids = [adapter.byte_tokens[b] for b in text.encode()]
    assert source.matcher.try_accept_tokens(ids) == len(ids), text
    return source


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("text", "refused", "allowed"), [
    ('{"tags":["a","b","a', ['"', '",', '"]'], ["b", '"b']),
    ('{"tags":["a","b",', ['"a"'], ['"c"', '"']),
    ('{"nums":[1,2,1', [",", "]", ".0"], ["0", ".5"]),
    ('{"nums":[1,2,1.', [], ["5"]),
    ('{"flags":[false,', ["f", "false"], ["t", "true"]),
    ('{"colors":["green","blue","red"', [","], ["]"]),
    ('{"colors":["green",', ['"green"', '"g'], ['"red"', '"b']),
])
def test_the_mask_on_text(adapter, factories, engine, text, refused, allowed) -> None:
    """Unit cases of the mask: after ``text``, the tokens spelled in ``refused`` are not allowed (and refused when
    accepted), those in ``allowed`` are (when the tokenizer has them as one token)."""
    factory = _engine(factories, engine)
    schema = {"type": "object", "properties": MASK_SCHEMA["properties"]}
    source = _prefix(factory, adapter, schema, text)
    row = np.zeros((V + 31) // 32, np.int32)
    source.fill_bitmask(row, [])
    ids = {adapter.token_bytes[t]: t for t in range(len(adapter.token_bytes)) if adapter.token_bytes[t]}
    for spelling in refused:
        token = ids.get(spelling.encode())
        if token is not None:
            assert not (int(row[token >> 5]) >> (token & 31)) & 1, spelling
            assert not source.matcher.try_accept_token(token), spelling
    for spelling in allowed:
        token = ids.get(spelling.encode())
        if token is not None:
            assert (int(row[token >> 5]) >> (token & 31)) & 1, spelling


def test_accept_rollback_accept_gives_the_same_masks(adapter, factories) -> None:
    source = _prefix(factories["llguidance"], adapter, MASK_SCHEMA, '{"tags":["a","b"],"nums":[1')
    row, again = np.zeros((V + 31) // 32, np.int32), np.zeros((V + 31) // 32, np.int32)
    path = [adapter.byte_tokens[b] for b in b',2,1']
    masks = []
    for token in path:
        source.fill_bitmask(row, [])
        masks.append(row.copy())
        source.accept_token(token)
    source.rollback(len(path))
    for token, expected in zip(path, masks, strict=True):
        source.fill_bitmask(again, [])
        assert np.array_equal(again, expected)
        source.accept_token(token)
    source.fill_bitmask(row, [])
    source.rollback(3)
    source.fill_bitmask(again, path[1:])  # a draft path gives the row of the state after it
    assert np.array_equal(again, row)


def _unique(value: object) -> bool:
    if isinstance(value, dict):
        return all(_unique(v) for v in value.values())
    if isinstance(value, list):
        keys = [json.dumps(v, sort_keys=True) if not isinstance(v, (int, float)) or isinstance(v, bool) else float(v)
                for v in value]
        return len(set(keys)) == len(keys) and all(_unique(v) for v in value)
    return True


RANDOM_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["tags", "nums", "flags", "colors"],
                 "properties": {
                     "tags": {"type": "array", "items": {"type": "string", "maxLength": 1}, "uniqueItems": True,
                              "minItems": 3},
                     "nums": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                              "uniqueItems": True, "minItems": 4},
                     "flags": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 1},
                     "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "uniqueItems": True,
                                "minItems": 2}}}


@pytest.mark.parametrize("engine", ENGINES)
def test_random_answers_have_unique_items(adapter, factories, engine) -> None:
    """Random logits (closers favoured late), with and without a budget: every answer parses, has unique items and
    is valid; at max_tokens 40 the closing still ends every answer as a whole document."""
    import jsonschema

    factory = _engine(factories, engine)
    bonus = closer_bonus(adapter)
    for seed in range(6):
        for max_tokens in (None, 40):
            source = factory.grammar_source(_config(RANDOM_SCHEMA))
            gen = drive(source, adapter, np.random.default_rng(seed), bonus, max_steps=400, patience=30,
                        max_tokens=max_tokens)
            assert gen.complete and not gen.dead_end, gen.text
            value = json.loads(gen.text)
            assert _unique(value), gen.text
            jsonschema.validate(value, RANDOM_SCHEMA)


@pytest.fixture(scope="module")
def tiny():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


TINY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["tags", "kinds", "nums", "flags"],
               "properties": {
                   "tags": {"type": "array", "items": {"type": "string", "pattern": "^[ab]{1,2}$"},
                            "uniqueItems": True, "minItems": 3},
                   "kinds": {"type": "array", "items": {"enum": ["x", "y", "z", 1, 1.5]}, "uniqueItems": True,
                             "minItems": 2},
                   "nums": {"type": "array", "items": {"type": "number"}, "uniqueItems": True, "minItems": 3},
                   "flags": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 1}}}


def test_tiny_model_answers_at_temperature_1_have_unique_items(tiny) -> None:
    """The engine with the tiny model sampling at temperature 1 (n = 4): strings, an enum (strings and numbers),
    numbers and booleans; every answer complete, with unique items, valid, and nothing reported relaxed for
    uniqueItems. At max_tokens 96 (the shortest answer is 73 bytes, one token each) the arrays still close
    in time, with unique items."""
    from logitproc.serve.engine import Engine

    engine = Engine(tiny, max_batch=4)
    for max_tokens in (160, 96):
        config = _config(TINY_SCHEMA, temperature=1.0, seed=11, n=4, max_tokens=max_tokens)
        for out in engine.generate("Give me JSON", config):
            assert out.grammar_complete and out.schema_valid, (max_tokens, out.text, out.schema_error)
            assert _unique(json.loads(out.text)), out.text
            assert not any("uniqueItems" in k for k in out.relaxed_keywords)
            assert len(out.token_ids) <= max_tokens
