"""Grammars in both syntaxes (Lark and GBNF/EBNF) on both grammar engines, end to end through the engine, and the
grammars refused before a request starts, in one sentence (issue 16, items 4 and 6).

Before, the llguidance backend called the module ``llguidance.gbnf_to_lark`` as a function, so every EBNF request
failed on the default engine; an unsatisfiable regex ended its answer with a 22-line engine dump, ``a{1000000}``
ended it in "error" after the mask had allowed a token, and a schema nested 5,000 deep raised RecursionError.
"""

from __future__ import annotations

import pytest
from logitproc.runtime import GenerationConfig
from logitproc.serve.engine import Engine

GRAMMARS = {
    "lark": 'start: answer "!"\nanswer: "yes" | "no" | "maybe"',
    "ebnf": 'root ::= answer "!"\nanswer ::= "yes" | "no" | "maybe"',
}


@pytest.fixture(scope="module")
def model():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


@pytest.mark.parametrize("syntax", sorted(GRAMMARS))
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_both_syntaxes_on_both_engines(model, backend: str, syntax: str) -> None:
    if backend == "xgrammar":
        pytest.importorskip("xgrammar", reason="the xgrammar extra is not installed")
    engine = Engine(model, max_batch=4, grammar_backend=backend)
    fmt = {"type": "grammar", "grammar": GRAMMARS[syntax], "syntax": syntax}
    for seed in range(4):
        [out] = engine.generate("answer:", GenerationConfig(temperature=1.0, seed=seed, max_tokens=20,
                                                            response_format=fmt))
        assert out.finish_reason == "stop", out
        assert out.text in ("yes!", "no!", "maybe!")


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_broken_ebnf_grammar_is_refused_naming_the_engine(model, backend: str) -> None:
    if backend == "xgrammar":
        pytest.importorskip("xgrammar", reason="the xgrammar extra is not installed")
    engine = Engine(model, grammar_backend=backend)
    fmt = {"type": "grammar", "grammar": 'root ::= "a" undefined_rule', "syntax": "ebnf"}
    with pytest.raises(ValueError, match=backend):
        engine.add_request("x", GenerationConfig(response_format=fmt))


@pytest.mark.parametrize(("fmt", "says"), [
    ({"type": "regex", "regex": "a[^\\x00-\\U0010FFFF]"}, "llguidance cannot use this regex: NoExtensionBias"),
    ({"type": "regex", "regex": "a{1000000}"}, "llguidance cannot use this regex: lexer error: too many expressions"),
])
def test_grammars_that_cannot_work_are_refused_before_the_request_starts(model, fmt, says: str) -> None:
    engine = Engine(model)
    with pytest.raises(ValueError, match=says) as caught:
        engine.add_request("x", GenerationConfig(response_format=fmt))
    assert "\n" not in str(caught.value)  # one sentence, no parser dump
    assert not engine.has_unfinished()


def test_a_schema_nested_too_deeply_is_refused_naming_the_field() -> None:
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    with pytest.raises(ValueError, match="response_format.json_schema.schema is nested 257 levels deep; at most 256"):
        GenerationConfig(response_format=fmt)
    text = '{"a":' * 5000 + "1" + "}" * 5000
    with pytest.raises(ValueError, match="response_format.json_schema.schema is nested"):
        GenerationConfig(response_format={"type": "json_schema", "json_schema": {"schema": text}})
