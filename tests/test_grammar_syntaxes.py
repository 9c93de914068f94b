"""Grammars in both syntaxes (Lark and GBNF/EBNF) on both grammar engines, end to end through the engine.

Before, the llguidance backend called the module ``llguidance.gbnf_to_lark`` as a function, so every EBNF request
failed on the default engine (issue 16, item 4).
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
