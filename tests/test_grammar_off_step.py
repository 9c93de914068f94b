"""Grammars compiled off the step (``Engine.submit``): a request whose schema compiles waits in the compiling state
while the running streams get a token every step; a schema that cannot compile fails its request only; the grammar
cache compiles a schema once however many requests ask for it. On the tiny compiled model; counted in steps."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from logitproc.runtime import GenerationConfig
from logitproc.runtime.grammar import GLOBAL_CACHE, GrammarMatcher, TokenizerAdapter
from logitproc.runtime.grammar.llguidance_backend import LLGuidanceBackend
from logitproc.serve.engine import Engine

RUNNING = GenerationConfig(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


def large_schema(tag: str, fields: int = 400) -> dict:
    """An object schema of ``fields`` nested objects (a few hundred ms to compile for the tiny vocabulary); ``tag``
    makes it a schema no other test compiled (the grammar cache is per process)."""
    return {"type": "object", "description": tag, "properties": {f"field_{i}": {
        "type": "object", "properties": {
            "name": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 7 + 9}}}$"},
            "kind": {"enum": [f"k{i}_{j}" for j in range(8)]},
            "n": {"type": "integer", "minimum": i, "maximum": 10 * i + 5}},
        "required": ["name", "kind"]} for i in range(fields)}, "required": [f"field_{i}" for i in range(0, fields, 3)]}


def constrained(schema: dict) -> GenerationConfig:
    return GenerationConfig(temperature=0.0, max_tokens=8,
                            response_format={"type": "json_schema", "json_schema": {"schema": schema}})


def test_a_compiling_grammar_never_holds_up_a_running_stream(model) -> None:
    """While a large schema compiles, every step gives the running stream its next token; the request then runs and
    answers as it does when added with add_request. A step can outlast a compile on a fast machine (the schema is then
    compiled before the next step): the schema grows until at least one step ran while it compiled."""
    Engine(model).generate("Warm up", GenerationConfig(temperature=0.0, max_tokens=2))  # functions loaded, not timed
    for fields in (400, 1600, 6400):
        engine = Engine(model)
        running = engine.add_request("Hello there", RUNNING)
        engine.step()
        schema = large_schema(f"off the step {fields}", fields)
        pending = engine.submit("Some JSON:", constrained(schema))
        plain = engine.submit("Plain text:", GenerationConfig(temperature=0.0, max_tokens=3))
        assert plain.ready.done()  # nothing to compile: queued at once, not behind the compile
        assert engine.num_compiling == 1 and engine.has_unfinished()
        compiling_steps = 0
        outputs = {}
        while engine.has_unfinished():
            compiling = engine.num_compiling
            deltas = {d.request_id: d for d in engine.step()}
            if running not in outputs:
                assert len(deltas[running].token_ids) == 1  # its next token, every step
            compiling_steps += compiling and engine.num_compiling
            outputs.update({rid: d.output for rid, d in deltas.items() if d.output is not None})
        assert outputs[plain.request_id].finish_reason == "length"
        assert pending.ready.result() == pending.request_id
        if compiling_steps > 0:  # steps ran while the grammar compiled
            break
    assert compiling_steps > 0, "even the largest schema compiled within one step"
    [alone] = Engine(model).generate("Some JSON:", constrained(schema))
    assert outputs[pending.request_id].token_ids == alone.token_ids


def test_a_grammar_that_cannot_compile_fails_only_its_request(model) -> None:
    engine = Engine(model)
    running = engine.add_request("abc", GenerationConfig(temperature=0.0, max_tokens=20, ignore_eos=True))
    bad = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    pending = engine.submit("abc", constrained(bad))
    finished = {}
    while engine.has_unfinished():
        finished.update({d.request_id: d.output for d in engine.step() if d.output is not None})
    with pytest.raises(ValueError):
        pending.ready.result()
    assert list(finished) == [running] and finished[running].finish_reason == "length"
    assert engine.num_compiling == 0 and engine.num_running == 0


def test_checks_other_than_the_grammar_raise_at_submit(model) -> None:
    engine = Engine(model, max_batch=2)
    with pytest.raises(ValueError, match="n=3 sequences do not fit in max_batch=2"):
        engine.submit("abc", GenerationConfig(n=3))
    engine.submit("abc", GenerationConfig(max_tokens=2), request_id="same")
    with pytest.raises(ValueError, match="request id 'same' is already in use"):
        engine.submit("abc", GenerationConfig(max_tokens=2), request_id="same")
    while engine.has_unfinished():
        engine.step()


def test_a_request_aborted_while_compiling_ends_with_abort(model) -> None:
    engine = Engine(model)
    pending = engine.submit("abc", constrained(large_schema("aborted while compiling", 200)))
    engine.abort(pending.request_id)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    [delta] = deltas
    assert delta.request_id == pending.request_id and delta.finish_reason == "abort"
    assert delta.output.token_ids == []


def test_the_grammar_cache_compiles_a_schema_once_for_many_requests(model) -> None:
    engine = Engine(model)
    schema = large_schema("asked for by four requests", 100)
    before = GLOBAL_CACHE.compiles
    pending = [engine.submit("abc", constrained(schema)) for _ in range(4)]
    while engine.has_unfinished():
        engine.step()
    assert [p.ready.result() for p in pending] == [p.request_id for p in pending]
    assert GLOBAL_CACHE.compiles == before + 1


class HeldFirstMask(GrammarMatcher):
    """llguidance's matcher whose first mask waits until the test lets it go (``Gate``): a grammar whose first mask
    takes as long as the test wants. Everything else is the real matcher's."""

    def __init__(self, inner: GrammarMatcher, gate: threading.Event) -> None:
        self.inner, self.gate, self.first = inner, gate, True

    def fill_next_token_bitmask(self, row: np.ndarray) -> None:
        if self.first:
            self.first = False
            if not self.gate.wait(timeout=30):
                raise AssertionError("the first mask was held for 30 s")
        self.inner.fill_next_token_bitmask(row)

    def try_accept_token(self, token_id: int) -> bool:
        return self.inner.try_accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def is_accepting(self) -> bool:
        return self.inner.is_accepting()

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def forced_bytes(self) -> bytes:
        return self.inner.forced_bytes()


class HeldFirstMasks(LLGuidanceBackend):
    """llguidance, each of its matchers' first mask held by ``gate``."""

    def __init__(self, tokenizer: TokenizerAdapter, gate: threading.Event) -> None:
        super().__init__(tokenizer)
        self.gate = gate

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return HeldFirstMask(super().matcher(compiled), self.gate)


def test_a_first_mask_is_made_before_its_request_joins_the_steps(model) -> None:
    """A request's first grammar mask is made on the grammar thread, before the request joins the steps: however
    long it takes (here held until the test lets it go, after 6 steps), every step gives the running stream its
    next token, and the request waits in the compiling state; then it runs and answers as it does alone."""
    config = constrained(large_schema("first mask held", 40))
    probe = Engine(model)
    [alone] = probe.generate("Some JSON:", config)
    adapter = TokenizerAdapter(model.tokenizer, probe.vocab_size, probe.eos_token_ids)
    gate = threading.Event()
    engine = Engine(model, grammar_backend=HeldFirstMasks(adapter, gate))
    running = engine.add_request("Hello there", RUNNING)
    engine.step()
    pending = engine.submit("Some JSON:", config)
    for _ in range(6):
        deltas = {d.request_id: d for d in engine.step()}
        assert len(deltas[running].token_ids) == 1
        assert engine.num_compiling == 1 and pending.request_id not in deltas
    gate.set()
    outputs = {}
    while pending.request_id not in outputs:
        deltas = {d.request_id: d for d in engine.step()}
        assert len(deltas[running].token_ids) == 1
        outputs.update({rid: d.output for rid, d in deltas.items() if d.output is not None})
    assert outputs[pending.request_id].token_ids == alone.token_ids


def test_constraints_prepared_at_load_answer_as_made_on_demand(model) -> None:
    """``prepare_constraints`` (what ``logitproc serve`` calls while loading) makes the grammar backend and the
    tokenizer's tables up front; requests then answer as they do with everything made by the first request."""
    config = constrained(large_schema("prepared at load", 20))
    [on_demand] = Engine(model).generate("Some JSON:", config)
    engine = Engine(model)
    engine.prepare_constraints()
    engine.prepare_constraints()  # once is enough; again changes nothing
    [prepared] = engine.generate("Some JSON:", config)
    assert prepared.token_ids == on_demand.token_ids and prepared.text == on_demand.text
