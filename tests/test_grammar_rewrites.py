"""Each step of the fallback chain only widens what is valid (issue 33): an instance the original schema accepts
(``jsonschema``) is accepted by every rewritten schema, and by the grammar compiled from the result (keys in the
grammar's order). Over the JSON-Schema-Test-Suite's valid instances (every draft) and a sample of the MaskBench
development set (real-world schemas; skipped where this machine has none)."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import material
import pytest
from grammar_driver import maskbench_folder, respell
from logitproc.runtime.grammar import TokenizerAdapter, get_backend
from logitproc.runtime.grammar.backend import GrammarError
from logitproc.runtime.grammar.llguidance_backend import LLGuidanceMatcher
from logitproc.runtime.grammar.schema_rewrite import (
    apply_relaxations,
    drop_patterns,
    lenient_reading,
    normalize,
    relaxations,
    resolve_anchors,
    rewrite_schema,
)
from logitproc.runtime.response_format import ResponseFormat

V, EOS = 129280, 1
META = {"draft4": "http://json-schema.org/draft-04/schema#", "draft6": "http://json-schema.org/draft-06/schema#",
        "draft7": "http://json-schema.org/draft-07/schema#",
        "draft2019-09": "https://json-schema.org/draft/2019-09/schema",
        "draft2020-12": "https://json-schema.org/draft/2020-12/schema"}
#: Every refusal ``rewrite_schema`` answers at once: each of its rewrites applied.
EVERY_REFUSAL = "min/maxProperties circular references with sibling keys is not present in a registry too many " \
                "digits are not disjoint does not exist"
#: Relaxations tried per schema (a fixed sample where a large schema has more).
RELAXATIONS_PER_SCHEMA = 40
#: Texts the respelling of an instance in the grammar's key order may feed (``respell``).
FEEDS = 400_000
#: MaskBench files of the sample (every n-th, sorted by name).
MASKBENCH_STRIDE = 8


def _patterns(schema: Any) -> set[str]:
    found: set[str] = set()
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("pattern"), str):
                found.add(item["pattern"])
            if isinstance(item.get("patternProperties"), dict):
                found.update(item["patternProperties"])
            stack.extend(v for k, v in item.items() if k not in ("enum", "const", "examples", "default"))
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _validator(schema: Any) -> type:
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def _valid(cls: type, schema: Any, instance: Any) -> bool | None:
    """Whether ``instance`` is valid against ``schema`` read as ``cls``'s draft; None when it cannot be checked
    (a reference outside the schema, nothing fetched)."""
    try:
        return cls(schema).is_valid(instance)
    except Exception:  # noqa: BLE001 - an unresolvable reference, or a schema jsonschema cannot read
        return None


def _rewrites(schema: Any, seed: int) -> list[tuple[str, Any]]:
    """Each rewrite of the chain applied alone to ``schema``, named."""
    lenient = lenient_reading(json.loads(json.dumps(schema)))
    out = [("normalize", normalize(schema)), ("resolve_anchors", resolve_anchors(schema)),
           ("lenient_reading", lenient), ("rewrite_schema", rewrite_schema(schema, EVERY_REFUSAL)[0])]
    patterns = _patterns(schema)
    if patterns:
        out.append(("drop_patterns", drop_patterns(schema, patterns)))
    candidates = list(relaxations(lenient))  # the search runs on the lenient reading
    if len(candidates) > RELAXATIONS_PER_SCHEMA:
        candidates = random.Random(seed).sample(candidates, RELAXATIONS_PER_SCHEMA)
    out += [(f"relax {'/'.join(map(str, path))} ({action})", apply_relaxations(lenient, [(path, action)]))
            for path, action in candidates]
    return out


def _narrowed(schema: Any, instances: list[Any], seed: int) -> list[str]:
    """The rewrites of ``schema`` that refuse one of ``instances`` that ``schema`` accepts."""
    if not isinstance(schema, dict):
        return []
    custom_meta = "$schema" in schema and "json-schema.org/" not in str(schema["$schema"])
    cls = _validator(schema)
    valid = [i for i in instances if _valid(cls, schema, i)]
    if not valid:
        return []
    found = []
    for name, rewritten in _rewrites(schema, seed):
        if custom_meta and name == "rewrite_schema":
            continue  # a custom meta-schema is dropped on purpose: its vocabularies are not read (documented)
        for instance in valid:
            if _valid(cls, rewritten, instance) is False:
                found.append(f"{name}: {json.dumps(instance)[:80]}")
                break
    return found


def _with_draft(schema: Any, draft: str) -> Any:
    return {"$schema": META[draft], **schema} if isinstance(schema, dict) and "$schema" not in schema else schema


@pytest.mark.parametrize("draft", list(META))
def test_every_rewrite_widens_on_the_test_suite(draft) -> None:
    """Every rewrite step (the exact ones, the keyword drops, the pattern drops, each relaxation the search may
    choose) keeps every valid instance of the Test-Suite's groups valid."""
    narrowed = []
    for index, (name, group) in enumerate(material.suite_groups(draft)):
        instances = [t["data"] for t in group["tests"] if t["valid"]]
        narrowed += [f"{name}: {n}" for n in _narrowed(_with_draft(group["schema"], draft), instances, index)]
    assert narrowed == []


def _maskbench_sample() -> list[tuple[str, dict]]:
    folder = maskbench_folder()
    if folder is None:
        pytest.skip("no MaskBench sample on this machine (shared/data/maskbench-dev or $LOGITPROC_MASKBENCH)")
    files = sorted(folder.glob("*.json"))[::MASKBENCH_STRIDE]
    return [(path.name, json.loads(path.read_text())) for path in files]


def test_every_rewrite_widens_on_real_world_schemas() -> None:
    """The same property over a sample of the MaskBench development set's schemas and valid instances."""
    narrowed = []
    for index, (name, data) in enumerate(_maskbench_sample()):
        instances = [t["data"] for t in data["tests"] if t["valid"]]
        narrowed += [f"{name}: {n}" for n in _narrowed(data["schema"], instances, index)]
    assert narrowed == []


@pytest.fixture(scope="module")
def adapter(deepseek_adapter: TokenizerAdapter) -> TokenizerAdapter:
    assert (deepseek_adapter.vocab_size, deepseek_adapter.eos_token_ids) == (V, (EOS,))
    return deepseek_adapter


def test_respell_writes_keys_in_the_grammar_order_and_names_a_refusal(adapter) -> None:
    """The bench's and the test's respelling (``grammar_driver.respell``): a document whose keys come reversed, at
    every level of a wide nesting, is found in the grammar's order within 20 feeds a byte; a
    value the grammar refuses for another cause is named with the text before it."""
    backend = get_backend("llguidance", adapter)
    keys = [f"k{i:02d}" for i in range(12)]
    inner = {"type": "object", "properties": {k: {"type": "integer"} for k in keys}, "additionalProperties": False}
    schema = {"type": "object", "properties": {k: inner for k in keys}, "additionalProperties": False}
    compiled = backend.compile(ResponseFormat.json_schema(schema))
    value = {k: {j: i * j_index for j_index, j in enumerate(reversed(keys))} for i, k in enumerate(reversed(keys))}
    found = respell(backend.matcher(compiled), adapter, value, max_feeds=20 * len(json.dumps(value)))
    assert found.accepted
    assert json.loads(found.text) == value and list(json.loads(found.text)) == keys
    bad = {**value, "k03": {**value["k03"], "k05": "five"}}
    refused = respell(backend.matcher(compiled), adapter, bad)
    assert not refused.accepted
    assert refused.text.endswith(b'"k05":') and refused.refused == b'"five"'


@pytest.mark.parametrize(("schema", "value", "spelled"), [
    # a required property between two others (docker-compose's ``version``): after ``services`` only ``version``
    ({"type": "object", "properties": {"networks": {}, "services": {"type": "object"}, "version": {"type": "string"},
                                       "volumes": {"type": "object"}}, "required": ["version"],
      "additionalProperties": False},
     {"version": "3", "services": {"web": {}}, "volumes": {}}, b'{"services":{"web":{}},"version":"3","volumes":{}}'),
    # branches of an anyOf that order their properties differently (swagger-2.0's parameters)
    ({"anyOf": [{"type": "object", "properties": {"description": {"type": "string"}, "in": {"enum": ["body"]}},
                 "required": ["in"], "additionalProperties": False},
                {"type": "object", "properties": {"required": {"enum": [True]}, "in": {"enum": ["path"]},
                                                  "description": {"type": "string"}},
                 "required": ["required", "in"], "additionalProperties": False}]},
     {"in": "path", "description": "d", "required": True}, b'{"required":true,"in":"path","description":"d"}'),
])
def test_respell_finds_the_order_of_the_real_world_causes(adapter, schema, value, spelled) -> None:
    """What the MaskBench sample's documents hold, where refusals are llguidance's key order (issue 33; the search
    before ``respell`` gave up on 7 large ones): a required property between the members (its ranking counts only
    the members the grammar takes at the position), and branches that order their properties differently (each
    tried where no member is first)."""
    backend = get_backend("llguidance", adapter)
    fmt = ResponseFormat.json_schema(schema)
    found = respell(backend.matcher(backend.compile(fmt)), adapter, value)
    assert found.accepted and found.text == spelled
    alone = LLGuidanceMatcher(backend.unrewritten(fmt), adapter)
    text = json.dumps(value, separators=(",", ":")).encode()
    assert alone.try_accept_tokens([adapter.byte_tokens[b] for b in text]) < len(text)  # llguidance's own refusal


def test_a_multiple_of_is_spelled_as_llguidance_spells_it(adapter) -> None:
    """llguidance writes a number with a fractional ``multipleOf`` with exactly that many decimals, or none:
    ``75.0`` is refused for ``multipleOf: 0.25`` (``75``, ``75.00``, ``75.50`` are taken; a MaskBench instance
    writes ``75.0`` there), an engine's spelling, not the chain's: the chain's grammar takes exactly what
    llguidance alone takes; ``respell`` finds ``75``."""
    backend = get_backend("llguidance", adapter)
    fmt = ResponseFormat.json_schema({"type": "object", "properties": {"value": {"type": "number",
                                                                                 "multipleOf": 0.25}}})
    compiled = backend.compile(fmt)

    def takes(matcher, text: str) -> bool:
        ids = [adapter.byte_tokens[b] for b in text.encode()]
        return matcher.try_accept_tokens(ids) == len(ids) and matcher.is_accepting()

    texts = ['{"value":75}', '{"value":75.0}', '{"value":75.00}', '{"value":75.5}', '{"value":75.50}']
    ours = [takes(backend.matcher(compiled), t) for t in texts]
    assert ours == [takes(LLGuidanceMatcher(backend.unrewritten(fmt), adapter), t) for t in texts]
    assert ours == [True, False, True, False, True]
    found = respell(backend.matcher(compiled), adapter, {"value": 75.0})
    assert found.accepted and found.text == b'{"value":75}' and found.numbers


def test_compiled_real_world_schemas_accept_their_valid_instances(adapter) -> None:
    """Each schema of the MaskBench sample compiled through the whole chain accepts every instance that
    ``jsonschema`` finds valid, as written or respelled with its keys in the grammar's order (``respell``: llguidance
    writes properties in the schema's order), unless llguidance alone refuses it on the unrewritten schema too, in
    its order as well (its own departures: the ``format``s it enforces)."""
    backend = get_backend("llguidance", adapter)
    refused = []
    for name, data in _maskbench_sample():
        schema = data["schema"]
        fmt = ResponseFormat.json_schema(schema)
        try:
            compiled = backend.compile(fmt)
        except GrammarError as err:
            refused.append(f"{name}: {err}")
            continue
        cls = _validator(schema)
        for test in data["tests"]:
            if not test["valid"] or not _valid(cls, schema, test["data"]):
                continue
            text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False).encode()
            matcher = backend.matcher(compiled)
            if matcher.try_accept_tokens([adapter.byte_tokens[b] for b in text]) == len(text) \
                    and matcher.is_accepting():
                continue  # as written
            alone = backend.unrewritten(fmt)
            if alone is not None:
                matcher = LLGuidanceMatcher(alone.deep_copy(), adapter)
                if matcher.try_accept_tokens([adapter.byte_tokens[b] for b in text]) == len(text) \
                        and matcher.is_accepting():
                    refused.append(f"{name}: llguidance alone takes {json.dumps(test['data'])[:80]} as written")
                    continue
            if respell(backend.matcher(compiled), adapter, test["data"], max_feeds=FEEDS).accepted:
                continue  # in the grammar's key order: llguidance refuses it as written on the unrewritten schema
            if alone is not None and not respell(LLGuidanceMatcher(alone, adapter), adapter, test["data"],
                                                 max_feeds=FEEDS).accepted:
                continue  # llguidance's own refusal, rewrites or not
            refused.append(f"{name}: {json.dumps(test['data'])[:80]}")
    assert refused == []


def test_unrewritten_is_llguidance_alone(adapter) -> None:
    """The reference of the test above: llguidance's relaxed compile of the schema as given, None when it cannot
    compile it (a schema only the chain's rewrites make compile)."""
    backend = get_backend("llguidance", adapter)
    assert backend.unrewritten(ResponseFormat.json_schema({"type": "integer", "uniqueItems": True})) is not None
    assert backend.unrewritten(ResponseFormat.json_schema({"$ref": "https://example.com/x.json"})) is None
