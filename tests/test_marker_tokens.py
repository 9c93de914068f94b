"""Tool calls and reasoning when the markers are control tokens of the vocabulary, through ``logitproc serve`` and the
official openai client.

The model is the tiny random one with ``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, ``[TOOL_CALLS]``,
``[ARGS]``, ``[THINK]`` and ``[/THINK]`` added as control tokens (special in its tokenizer.json:
``tiny_variants.marker_tiny``), served with Qwen3's, Mistral Small 3.2's and Ministral 3 Reasoning's real templates.
The grammar must name these tokens: the answers' tokens hold each marker as its one token (the logprobs' token
texts), never spelled out, and the parser still reads the calls and the reasoning (the detokenizer keeps the control
tokens for it). The think budget (vLLM's ``thinking_token_budget``) is checked here end to end: the reasoning is cut
at the budget by the forced end-marker token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import material
import openai
import pytest
import tiny_variants
from server_process import KEY, ServerProcess
from test_server_tools import MESSAGES, SCHEMAS, TOOLS


@pytest.fixture(scope="module")
def marker_model(tmp_path_factory) -> str:
    return str(tiny_variants.write_marker_tiny(tmp_path_factory.mktemp("markers")))


def _serve(model: str, template: str) -> ServerProcess:
    templates = material.llama_cpp_models() / "templates"  # fetched on first use (not at collection)
    return ServerProcess("--model", model, "--max-batch", "8", "--chat-template", str(templates / template))


@pytest.fixture(scope="module")
def qwen(marker_model) -> Iterator[tuple[openai.OpenAI, str]]:
    proc = _serve(marker_model, "Qwen-Qwen3-0.6B.jinja")
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        yield client, client.models.list().data[0].id
    finally:
        assert proc.stop() == 0


def _tokens(choice) -> list[str]:
    return [t.token for t in choice.logprobs.content]


def _assert_valid(message) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_the_vocabulary_has_the_markers_as_control_tokens(marker_model) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{marker_model}/tokenizer.json")
    added = {t.content: t for t in tokenizer.get_added_tokens_decoder().values()}
    for marker in tiny_variants.MARKER_TOKENS:
        assert added[marker].special, marker
        assert tokenizer.decode([tokenizer.token_to_id(marker)], skip_special_tokens=True) == ""


def _spelled(tokens: list[str], markers: tuple[str, ...]) -> bool:
    """Whether a marker's text appears in the answer other than as its token."""
    text = "".join(t for t in tokens if t not in markers)
    return any(m[1:] in text for m in markers)


CLOSING_SEEDS = (0, 1, 6)


@pytest.mark.parametrize(("template", "marker_texts"), [
    ("Qwen-Qwen3-0.6B.jinja", {"<tool_call>", "</tool_call>", "<think>", "</think>"}),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", {"[TOOL_CALLS]", "[ARGS]"}),
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", {"[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]"}),
])
def test_control_tokens_are_kept_only_where_the_parser_reads_them(marker_model, template, marker_texts) -> None:
    """The template's markers that are control tokens are found; a turn keeps control tokens in its text only when
    it parses calls or reasoning (a Mistral template without a think block, asked without tools, keeps none)."""
    from logitproc.serve.chat_template import ChatTemplate
    from logitproc.serve.chat_turn import ChatTraits, TurnPlan
    from logitproc.serve.openai_protocol import parse_chat_request
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{marker_model}/tokenizer.json")
    traits = ChatTraits.of(ChatTemplate.from_file(material.llama_cpp_models() / "templates" / template), tokenizer)
    assert set(traits.marker_tokens) == traits.special_markers == marker_texts
    assert all(tokenizer.id_to_token(i) == m for m, i in traits.marker_tokens.items())
    for fields, kept in (({}, traits.thinking), ({"tools": TOOLS, "tool_choice": "none"}, traits.thinking),
                         ({"tools": TOOLS}, True)):
        parsed = parse_chat_request({"messages": MESSAGES, **fields})
        plan = TurnPlan.make(traits, parsed.config, parsed.chat_options.tools, "")
        assert plan.config.skip_special_tokens is not kept, fields


def test_hermes_calls_are_written_with_the_marker_tokens(qwen) -> None:
    client, model = qwen
    for seed in CLOSING_SEEDS:
        choice = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                max_tokens=200, temperature=1.0, seed=seed, logprobs=True).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _assert_valid(choice.message)
        tokens = _tokens(choice)
        assert tokens.count("<tool_call>") == tokens.count("</tool_call>") == len(choice.message.tool_calls)
        assert not _spelled(tokens, ("<tool_call>", "</tool_call>"))


def test_calls_close_in_time_through_the_control_token(qwen) -> None:
    """The closing at max_tokens plans through </tool_call> as a token (the grammar names it): a short budget still
    gives a whole call, closed in time."""
    client, model = qwen
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=90, temperature=1.0, seed=2, n=4,
                                       logprobs=True)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        _assert_valid(choice.message)
        assert "</tool_call>" in _tokens(choice)[-2:]  # then the end of the answer (or the budget)
    assert any(c.model_extra["closed_at_max_tokens"] for c in r.choices)


def test_auto_text_then_a_call_token(qwen) -> None:
    """Under auto the free text ends where the <tool_call> token comes; the text is content, the call parsed."""
    client, model = qwen
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0,
                                       seed=0, n=3, logprobs=True)
    for choice in r.choices:
        if choice.message.tool_calls:
            _assert_valid(choice.message)
            assert "<tool_call>" in _tokens(choice)
        assert "<tool_call>" not in (choice.message.content or "")


def test_streamed_calls_accumulate_to_the_non_streamed_ones(qwen) -> None:
    client, model = qwen
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
                  temperature=1.0, seed=1)
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_grammar_naming_a_control_token_and_skip_special_tokens(qwen) -> None:
    """A user's Lark grammar names a control token by id; vLLM's skip_special_tokens says whether its text shows."""
    client, model = qwen
    think = tiny_variants.marker_tiny().tokens.index("<think>")
    fmt = {"type": "grammar", "grammar": f'start: <[{think}]> "ab"'}
    texts = [client.completions.create(model=model, prompt="x", max_tokens=5, extra_body={
        "response_format": fmt, **extra}).choices[0].text for extra in ({}, {"skip_special_tokens": False})]
    assert texts == ["ab", "<think>ab"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="x", max_tokens=5, extra_body={"skip_special_tokens": "no"})
    assert caught.value.body["param"] == "skip_special_tokens"


def _reasoning_stream(client, kwargs) -> tuple[str, str]:
    reasoning = content = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    return reasoning, content


@pytest.mark.parametrize("budget", [0, 3, 12])
def test_the_think_budget_cuts_the_reasoning(qwen, budget) -> None:
    """thinking_token_budget: the engine opens the think block (the <think> token ends the prompt), at most
    ``budget`` tokens of reasoning, then the forced </think> token; reasoning_content and content split there,
    streamed as not."""
    client, model = qwen
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=30, temperature=1.0, seed=7 + budget,
                  extra_body={"thinking_token_budget": budget, "ignore_eos": True})
    choice = client.chat.completions.create(logprobs=True, **kwargs).choices[0]
    tokens = _tokens(choice)
    end = tokens.index("</think>")
    assert end <= budget and "<think>" not in tokens[:end]
    message = choice.message
    if not any("\ufffd" in t for t in tokens):  # every token whole characters: the texts are the tokens' texts
        assert message.reasoning_content == ("".join(tokens[:end]).strip() or None)
        assert message.content == "".join(tokens[end + 1:]).lstrip()
    assert _reasoning_stream(client, kwargs) == (message.reasoning_content or "", message.content)


def test_the_think_budget_then_a_call(qwen) -> None:
    """With tools the call grammar starts after thinking: reasoning, then a call of marker tokens."""
    client, model = qwen
    choice = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=1.0,
        seed=6, logprobs=True, extra_body={"thinking_token_budget": 6}).choices[0]
    assert choice.finish_reason == "tool_calls"
    _assert_valid(choice.message)
    tokens = _tokens(choice)
    assert tokens.index("</think>") <= 6 and tokens.index("</think>") < tokens.index("<tool_call>")
    assert "<tool_call>" not in (choice.message.model_extra["reasoning_content"] or "")


def test_mistral_calls_with_control_tokens(marker_model) -> None:
    """[TOOL_CALLS] and [ARGS] are special tokens (dropped from text by default): the turn keeps them for the
    parser; the calls come back parsed and valid, each marker one token."""
    proc = _serve(marker_model, "Mistral-Small-3.2-24B-Instruct-2506.jinja")
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": "You call tools."}, *MESSAGES]
        for seed in range(3):
            choice = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                    tool_choice="required", max_tokens=200, temperature=1.0,
                                                    seed=seed, logprobs=True).choices[0]
            assert choice.finish_reason == "tool_calls", choice
            _assert_valid(choice.message)
            tokens = _tokens(choice)
            assert tokens.count("[TOOL_CALLS]") == tokens.count("[ARGS]") == len(choice.message.tool_calls)
            assert not _spelled(tokens, ("[TOOL_CALLS]", "[ARGS]"))
            assert all(len(c.id) == 9 for c in choice.message.tool_calls)
    finally:
        assert proc.stop() == 0


def test_mistral_think_markers_and_budget(marker_model) -> None:
    """Ministral 3 Reasoning's template writes Mistral's [THINK] ... [/THINK]: they are the reasoning parser's and
    the think budget's markers (control tokens here): the budget forces [/THINK], reasoning_content and content split
    there, streamed as not; with tools the call comes after thinking."""
    proc = _serve(marker_model, "mistralai-Ministral-3-14B-Reasoning-2512.jinja")
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": "Think, then answer."}, *MESSAGES]
        for budget in (0, 5):
            kwargs = dict(model=model, messages=messages, max_tokens=30, temperature=1.0, seed=budget,
                          extra_body={"thinking_token_budget": budget, "ignore_eos": True})
            choice = client.chat.completions.create(logprobs=True, **kwargs).choices[0]
            tokens = _tokens(choice)
            end = tokens.index("[/THINK]")
            assert end <= budget and "[THINK]" not in tokens[:end]
            message = choice.message
            assert "[/THINK]" not in (message.reasoning_content or "")
            assert _reasoning_stream(client, kwargs) == (message.reasoning_content or "", message.content)
        choice = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=1.0,
            seed=1, logprobs=True, extra_body={"thinking_token_budget": 4}).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _assert_valid(choice.message)
        tokens = _tokens(choice)
        assert tokens.index("[/THINK]") <= 4 and tokens.index("[/THINK]") < tokens.index("[TOOL_CALLS]")
    finally:
        assert proc.stop() == 0
