"""The engine with the constraints issue 5 adds, on the compiled tiny model: Tree Decode maps (engine option and
`TREE_DECODE_CONFIG`), the xgrammar backend, and JSON from both engines validating against the schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest
from logitproc.runtime import GenerationConfig
from logitproc.runtime.tree_decode import TreeDecodeConfig
from logitproc.serve.engine import Engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}}}


def byte_token(b: int) -> int:
    """The tiny vocabulary's token for one byte."""
    return 3 + b


@pytest.fixture(scope="module")
def model():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


def tree_map(model, paths: list[bytes]) -> dict:
    """A Tree Decode map allowing exactly ``paths`` (then EOS)."""
    start, end = 0, model.eos_token_ids[0]
    prefixes: dict[str, set[int]] = {}
    for path in paths:
        ids = [byte_token(b) for b in path]
        for k in range(len(ids) + 1):
            key = "_".join(str(t) for t in [start, *ids[:k]])
            prefixes.setdefault(key, set()).add(ids[k] if k < len(ids) else end)
    return {"start_token_id": start, "end_token_id": end, "sep": "_",
            "prefix_dict": {k: sorted(v) for k, v in prefixes.items()}}


def test_tree_decode_map_constrains_every_answer(model) -> None:
    paths = [b"yes", b"no", b"maybe"]
    engine = Engine(model, max_batch=4, tree_decode=TreeDecodeConfig.from_dict(tree_map(model, paths),
                                                                              model.vocab_size))
    outs = engine.generate("Pick one", GenerationConfig(temperature=1.0, seed=3, n=4, max_tokens=10))
    assert {o.text.encode() for o in outs} <= set(paths) and all(o.finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_json_schema_answers_validate_with_either_engine(model, backend) -> None:
    if backend == "xgrammar":
        pytest.importorskip("xgrammar", reason="the optional xgrammar extra is not installed")
    engine = Engine(model, max_batch=4, grammar_backend=backend, jump_forward=True)
    config = GenerationConfig(temperature=0.8, seed=11, n=2, max_tokens=1000, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    for out in engine.generate("Give me JSON", config):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text, strict=backend == "llguidance"), SCHEMA)


def test_tree_decode_environment_variable_is_confined_to_the_model_directory(model, tmp_path) -> None:
    """``TREE_DECODE_CONFIG`` (a deployment's setting) names a file in the model's directory; the command line's
    ``--tree-decode-config`` may name any file (tests/test_cli.py)."""
    outside = tmp_path / "tree.json"
    outside.write_text(json.dumps(tree_map(model, [b"ok"])))
    generate = [sys.executable, "-m", "logitproc", "generate", "--model", "tiny", "--prompt", "hi"]
    done = subprocess.run(generate, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TREE_DECODE_CONFIG=str(outside)))
    assert done.returncode == 2 and done.stdout == ""
    assert "TREE_DECODE_CONFIG" in done.stderr and "outside the model directory" in done.stderr
    inside = model.directory / "tree-test.json"
    inside.write_text(json.dumps(tree_map(model, [b"ok"])))
    try:
        done = subprocess.run(generate, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, TREE_DECODE_CONFIG="tree-test.json"))
    finally:
        inside.unlink()
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok\n" and "tree decode" in done.stderr


def _run_until_done(engine: Engine) -> dict[str, object]:
    outputs = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.output is not None:
                outputs[delta.request_id] = delta.output
    return outputs


def test_a_grammar_failing_at_run_time_ends_its_request_alone(model) -> None:
    """A grammar matcher that refuses every token from some point on (forced here: past our checks, the sampled
    token fails to be accepted) ends its own request with "error" and the message; the other request's answer is
    unchanged. (The engine itself failing mid-answer: tests/test_grammar_recovery.py.)"""
    config = GenerationConfig(temperature=0, max_tokens=40, response_format={"type": "json_object"})
    alone = Engine(model, max_batch=2).generate("Other", config)[0]
    engine = Engine(model, max_batch=2)
    broken = engine.add_request("Broken", config)
    other = engine.add_request("Other", config)
    engine.step()
    matcher = engine.scheduler.requests[broken].sequences[0].state.mask_sources[0].matcher
    matcher.try_accept_token = lambda token: False
    outputs = _run_until_done(engine)
    assert outputs[broken].finish_reason == "error"
    assert outputs[broken].error and "not allowed" in outputs[broken].error
    assert outputs[other].finish_reason == alone.finish_reason and outputs[other].text == alone.text
    assert outputs[other].error is None
