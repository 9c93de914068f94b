"""Mistral's tool calls (``[TOOL_CALLS]``) through ``logitproc serve`` and the official openai client.

Two of Mistral's real chat templates (llama.cpp's copies, from the llama-cpp-python sdist) on the tiny random model:
Mistral Nemo's (``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``, ids inside the list in the history) and Mistral
Small 3.2's (``[TOOL_CALLS]name[ARGS]{...}``; ``[CALL_ID]id`` in the history). Both refuse tool call ids other than
9 alphanumerics: the server's ids satisfy them, and a whole agent loop renders back through the template. The
tiny vocabulary spells the markers in bytes here; tests/test_marker_tokens.py has them as control tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import material
import openai
import pytest
from logitproc.serve.answer_parser import AnswerParser
from logitproc.serve.chat_template import ChatTemplate
from logitproc.serve.tool_syntax import CallSyntax, detect_syntax
from server_process import KEY, ServerProcess
from test_server_tools import MESSAGES as QUESTION
from test_server_tools import SCHEMAS, TOOLS

TEMPLATES = {CallSyntax.MISTRAL_JSON: "mistralai-Mistral-Nemo-Instruct-2407",
             CallSyntax.MISTRAL_ARGS: "Mistral-Small-3.2-24B-Instruct-2506"}
#: A short system prompt in place of Mistral Small 3.2's default one (2,000 tokens of the tiny vocabulary).
MESSAGES = [{"role": "system", "content": "You call tools."}, *QUESTION]
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _template(name: str):
    return material.llama_cpp_models() / "templates" / f"{name}.jinja"


@pytest.fixture(scope="module", params=list(TEMPLATES), ids=[s.value for s in TEMPLATES])
def served(request) -> Iterator[tuple[CallSyntax, openai.OpenAI, str]]:
    proc = ServerProcess("--model", "tiny", "--max-batch", "8", "--chat-template",
                         str(_template(TEMPLATES[request.param])))
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        yield request.param, client, client.models.list().data[0].id
    finally:
        assert proc.stop() == 0


def _assert_valid(message) -> None:
    for call in message.tool_calls or []:
        assert MISTRAL_ID.fullmatch(call.id), call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("name", [*TEMPLATES.values(), "mistralai-Ministral-3-14B-Reasoning-2512",
                                  "unsloth-mistral-Devstral-Small-2507"])
def test_the_syntax_is_read_from_mistral_s_templates(name) -> None:
    expected = CallSyntax.MISTRAL_JSON if "Nemo" in name else CallSyntax.MISTRAL_ARGS
    assert detect_syntax(ChatTemplate.from_file(_template(name), "<s>", "</s>")) is expected


MISTRAL_ANSWERS = {
    CallSyntax.MISTRAL_JSON: 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "s": "], {"}}, '
                             '{"name": "w", "arguments": {}}]',
    CallSyntax.MISTRAL_ARGS: 'Sure. [TOOL_CALLS]add[ARGS]{"a": 1, "s": "[TOOL_CALLS]}"}[TOOL_CALLS]w[ARGS]{}',
}


@pytest.mark.parametrize("syntax", list(MISTRAL_ANSWERS))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_parser_reads_mistral_calls_however_the_text_is_cut(syntax, step) -> None:
    text = MISTRAL_ANSWERS[syntax]
    parser = AnswerParser(syntax)
    pieces = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    assert "".join(p.content for p in pieces) == "Sure. "
    assert [(c.name, c.arguments) for c in parser.tool_calls] == [("add", '{"a": 1, "s": "' + (
        "], {" if syntax is CallSyntax.MISTRAL_JSON else "[TOOL_CALLS]}") + '"}'), ("w", "{}")]
    assert all(MISTRAL_ID.fullmatch(c.id) for c in parser.tool_calls) and parser.finish_reason("stop") == "tool_calls"


def test_required_and_named_calls_parse_and_validate(served) -> None:
    _, client, model = served
    for seed in range(6):
        choice = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                max_tokens=200, temperature=1.0, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        assert choice.model_extra["tool_calls_valid"] is True
        _assert_valid(choice.message)
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                       parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=9, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and _calls(choice.message)[0][0] == "add"
        assert len(choice.message.tool_calls) == 1
        _assert_valid(choice.message)


def test_auto_answers_in_text_or_calls(served) -> None:
    _, client, model = served
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=1.0,
                                       seed=0, n=4)
    for choice in r.choices:
        _assert_valid(choice.message)
        assert "[TOOL_CALLS]" not in (choice.message.content or "")
    assert any(not c.message.tool_calls and c.message.content for c in r.choices)


def test_parallel_calls_streamed_accumulate_to_the_non_streamed_answer(served) -> None:
    syntax, client, model = served
    seed = {CallSyntax.MISTRAL_JSON: 9, CallSyntax.MISTRAL_ARGS: 8}[syntax]  # seeds whose calls close in time
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300,
                  temperature=1.0, seed=seed, extra_body={"min_tokens": 100})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) >= 2
    _assert_valid(whole.message)
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and _calls(final.message) == _calls(whole.message)
    _assert_valid(final.message)


def test_an_agent_loop_renders_the_ids_back_through_the_template(served) -> None:
    """Call, tool result (its tool_call_id the server's 9-character id, which the template checks), answer."""
    _, client, model = served
    messages = list(MESSAGES)
    asked = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=21)
    first = asked.choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    messages.append(first.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": 21})})
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=20, temperature=1.0, seed=22)
    assert final.choices[0].message.tool_calls == [] and final.choices[0].message.content
    assert final.usage.prompt_tokens > asked.usage.prompt_tokens + len(call.function.arguments)
    # an id the template refuses is the client's error, named
    messages[-2]["tool_calls"][0]["id"] = messages[-1]["tool_call_id"] = "call_1"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=5)
    assert caught.value.body["param"] == "messages" and "9" in caught.value.body["message"]


def test_fifty_seeded_samples_at_temperature_one_all_parse_and_validate(served) -> None:
    """As tests/test_server_tools.py's Hermes run: every call returned validates; most answers are calls."""
    _, client, model = served
    complete = 0
    for seed in range(17):  # 51 answers
        r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=100 + seed, n=3)
        for choice in r.choices:
            _assert_valid(choice.message)
            assert choice.model_extra["tool_calls_valid"] is (choice.finish_reason == "tool_calls")
            complete += choice.finish_reason == "tool_calls"
    assert complete >= 46, complete  # measured: 51 of 51 for both syntaxes
