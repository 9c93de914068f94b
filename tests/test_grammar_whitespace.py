"""The whitespace policy of JSON answers (issue 33): compact (the default, as OpenAI returns JSON), indented
(``json.dumps(value, indent=2)``'s layout) and flexible (any whitespace), as a response_format field, a request field
(``json_whitespace``) and a command-line option (``--json-whitespace``); answers parse and keep to their layout,
with random logits on DeepSeek-V3's vocabulary, closed at max_tokens, and with the tiny model through the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from grammar_driver import accepts_value, closer_bonus, drive
from json_layouts import layout_of
from logitproc.runtime.grammar import GrammarSource, TokenizerAdapter, get_backend
from logitproc.runtime.response_format import ResponseFormat, parse_response_format, with_whitespace

V, EOS = 129280, 1
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "size", "sub"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "size": {"type": "number"},
                         "sub": {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "array"}}}}}
VALUE = {"name": "a b", "tags": ["a", "c"], "size": 1.5, "sub": {"x": True, "y": []}}


def test_the_policy_is_a_field_of_the_response_format() -> None:
    """compact by default; each policy its own cache key; anything else refused naming the field; a default policy
    fills only JSON formats that do not name one."""
    assert ResponseFormat.json_schema(SCHEMA).whitespace == "compact"
    assert parse_response_format({"type": "json_object"}).whitespace == "compact"
    keys = {ResponseFormat.json_schema(SCHEMA, whitespace=p).key for p in ("compact", "indented", "flexible")}
    assert len(keys) == 3
    with pytest.raises(ValueError, match="response_format.whitespace must be one of"):
        parse_response_format({"type": "json_object", "whitespace": "pretty"})
    with pytest.raises(ValueError, match="unknown key 'whitespace'"):
        parse_response_format({"type": "regex", "regex": "a", "whitespace": "compact"})
    assert with_whitespace({"type": "json_object"}, "indented") == {"type": "json_object", "whitespace": "indented"}
    assert with_whitespace({"type": "json_object", "whitespace": "flexible"}, "indented")["whitespace"] == "flexible"
    assert with_whitespace({"type": "regex", "regex": "a"}, "indented") == {"type": "regex", "regex": "a"}
    with pytest.raises(ValueError, match="json_whitespace must be one of"):
        with_whitespace({"type": "json_object"}, "tabs")


@pytest.fixture(scope="module")
def adapter(deepseek_adapter: TokenizerAdapter) -> TokenizerAdapter:
    assert (deepseek_adapter.vocab_size, deepseek_adapter.eos_token_ids) == (V, (EOS,))
    return deepseek_adapter


def _takes(backend, compiled, adapter, text: str) -> bool:
    matcher = backend.matcher(compiled)
    ids = [adapter.byte_tokens[b] for b in text.encode()]
    return matcher.try_accept_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("engine", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("policy", ["compact", "indented", "flexible"])
def test_each_policy_takes_its_layout_and_only_it(adapter, policy, engine) -> None:
    """Both engines: xgrammar lays out by itself (its separators, ``indent=2``), llguidance with the layout's
    matcher for indented."""
    if engine == "xgrammar":
        pytest.importorskip("xgrammar", reason="the optional xgrammar extra is not installed")
    backend = get_backend(engine, adapter)
    compiled = backend.compile(ResponseFormat.json_schema(SCHEMA, whitespace=policy))
    layouts = {"compact": json.dumps(VALUE, separators=(",", ":")), "indented": json.dumps(VALUE, indent=2),
               "spaced": json.dumps(VALUE)}
    taken = {name: _takes(backend, compiled, adapter, text) for name, text in layouts.items()}
    assert taken == {"compact": policy != "indented", "indented": policy != "compact",
                     "spaced": policy == "flexible"}
    # the indented layout: a newline after the last item, never before a comma, no trailing spaces, {} and [] kept
    if policy == "indented" and engine == "llguidance":
        assert not _takes(backend, compiled, adapter, json.dumps(VALUE, indent=2) + "\n")
        assert not _takes(backend, compiled, adapter, json.dumps(VALUE, indent=2).replace(",\n", "\n,", 1))
        assert not _takes(backend, compiled, adapter, json.dumps({**VALUE, "sub": {}}, indent=2).replace("{}",
                                                                                                          "{\n  }"))
        assert accepts_value(backend.matcher(compiled), adapter, VALUE) is False  # compact text refused


@pytest.mark.parametrize("policy", ["compact", "indented", "flexible"])
def test_random_answers_keep_to_the_layout_also_when_closed_at_max_tokens(adapter, policy) -> None:
    """Random-logit answers (closers favoured) parse and keep to the layout; at max_tokens 40 the closing's plan
    keeps to it too. Accept / rollback / accept gives the same masks (the layout's states are rolled back)."""
    backend = get_backend("llguidance", adapter)
    fmt = ResponseFormat.json_schema(SCHEMA, whitespace=policy)
    compiled = backend.compile(fmt)
    bonus = closer_bonus(adapter)
    for seed in range(3):
        gen = drive(GrammarSource(backend.matcher(compiled), adapter), adapter, np.random.default_rng(seed), bonus,
                    max_steps=300, patience=20)
        assert gen.finished and layout_of(gen.text.decode(), policy), gen.text
        closed = drive(GrammarSource(backend.matcher(compiled), adapter), adapter, np.random.default_rng(seed),
                       np.zeros_like(bonus), max_tokens=40, patience=10**6)
        assert closed.complete and layout_of(closed.text.decode(), policy), closed.text
    matcher = backend.matcher(compiled)
    ids = adapter.encode(json.dumps(VALUE, indent=2) if policy == "indented" else
                         json.dumps(VALUE, separators=(",", ":")))
    rows = []
    for _ in range(2):
        row = np.zeros((V + 31) // 32, np.int32)
        taken = matcher.try_accept_tokens(ids[:7])
        matcher.fill_next_token_bitmask(row)
        rows.append(row)
        matcher.rollback(taken)
    assert taken == 7 and np.array_equal(rows[0], rows[1])


def test_the_request_field_and_the_server_default() -> None:
    """``json_whitespace`` in a request sets the layout of a JSON answer; the server's default (``serve
    --json-whitespace``) fills it when the request does not; a response_format's own ``whitespace`` wins; the
    field on a request without a JSON format is refused naming it."""
    from logitproc.serve.openai_protocol import APIError, parse_chat_request

    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}
    assert parse_chat_request(body).config.response_format.whitespace == "compact"
    assert parse_chat_request({**body, "json_whitespace": "indented"}).config.response_format.whitespace == "indented"
    served = parse_chat_request(body, {"json_whitespace": "flexible"})
    assert served.config.response_format.whitespace == "flexible"
    own = {**body, "response_format": {"type": "json_object", "whitespace": "indented"}}
    assert parse_chat_request(own, {"json_whitespace": "flexible"}).config.response_format.whitespace == "indented"
    vllm = {"messages": body["messages"], "structured_outputs": {"json": SCHEMA}, "json_whitespace": "indented"}
    assert parse_chat_request(vllm).config.response_format.whitespace == "indented"
    assert parse_chat_request({"messages": body["messages"]}, {"json_whitespace": "indented"}).config \
        .response_format is None
    for bad, message in (({**body, "json_whitespace": "tabs"}, "must be one of"),
                         ({"messages": body["messages"], "json_whitespace": "compact"}, "needs a response_format")):
        with pytest.raises(APIError, match=message) as err:
            parse_chat_request(bad)
        assert err.value.param == "json_whitespace"


def test_the_command_line_option() -> None:
    import argparse

    from logitproc.serve.cli_options import add_sampling_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_sampling_arguments(parser)
    options = options_from_args(parser.parse_args(["--json-schema", json.dumps(SCHEMA), "--json-whitespace",
                                                   "indented"]))
    assert options["response_format"]["whitespace"] == "indented"
    with pytest.raises(ValueError, match="--json-whitespace lays out the answer of --json-schema"):
        options_from_args(parser.parse_args(["--json-whitespace", "compact"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--json-whitespace", "pretty"])


@pytest.fixture(scope="module")
def tiny():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


@pytest.mark.parametrize("policy", ["compact", "indented", "flexible"])
def test_tiny_model_answers_parse_and_keep_to_the_layout(tiny, policy) -> None:
    """The engine with the tiny model: n = 3 sampled answers of a schema and of json_object, closed at max_tokens
    96 (the indented layout's shortest answer to the schema is 57 bytes, many tokens of the tiny vocabulary), parse,
    are valid and keep to the policy's layout."""
    from logitproc.runtime import GenerationConfig
    from logitproc.serve.engine import Engine

    engine = Engine(tiny, max_batch=4)
    for fmt in ({"type": "json_schema", "json_schema": {"schema": SCHEMA}, "whitespace": policy},
                {"type": "json_object", "whitespace": policy}):
        for out in engine.generate("Give me JSON", GenerationConfig(temperature=1.0, seed=7, n=3, max_tokens=96,
                                                                    response_format=fmt)):
            assert out.grammar_complete and out.schema_valid, out.text
            assert layout_of(out.text, policy), out.text
