"""Tools, tool calls and reasoning through ``logitproc serve`` and the official openai client.

One server for the module: the tiny random model with Qwen3's real chat template (llama.cpp's copy, from the
llama-cpp-python sdist), which writes Hermes ``<tool_call>`` calls and has a think block. The model is random: the
grammar does the work, and every call the server returns must parse and validate against its function's schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import material
import openai
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from json_layouts import layout_of
from logitproc.serve.answer_parser import AnswerParser
from logitproc.serve.chat_template import ChatTemplate
from logitproc.serve.tool_syntax import CallSyntax, ReasoningMarkers, detect_syntax
from server_process import KEY, ServerProcess

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "number", "maximum": 10},
                                        "op": {"enum": ["plus", "minus"]}, "exact": {"type": "boolean"}},
       "required": ["a", "b", "op"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and 2 + 3?"}]


@pytest.fixture(scope="module")
def template_path():
    return material.llama_cpp_models() / "templates" / "Qwen-Qwen3-0.6B.jinja"


@pytest.fixture(scope="module")
def server(template_path) -> Iterator[ServerProcess]:
    proc = ServerProcess("--model", "tiny", "--max-batch", "16", "--chat-template", str(template_path))
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _assert_valid(message) -> None:
    """Every call names a function given and its arguments parse and validate against its schema."""
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---------------------------------------------------------------------------------------------------- choices
def test_required_and_named_calls_come_from_the_first_token(client, model_id) -> None:
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=1.0, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and choice.model_extra["tool_calls_valid"] is True
    _assert_valid(choice.message)
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                       max_tokens=200, temperature=1.0, seed=4, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert {c.function.name for c in choice.message.tool_calls} == {"add"}
        _assert_valid(choice.message)


def test_auto_lets_the_model_answer_with_text_or_calls(client, model_id) -> None:
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                       temperature=1.0, seed=0, n=3)
    for choice in r.choices:
        _assert_valid(choice.message)
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
        else:
            assert isinstance(choice.message.content, str)
    assert any(not c.message.tool_calls and c.message.content for c in r.choices)  # the random model writes text


def test_none_parses_no_calls(client, model_id) -> None:
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       max_tokens=30, temperature=1.0, seed=1)
    assert r.choices[0].message.tool_calls == [] and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_the_tools_reach_the_template(client, model_id) -> None:
    plain = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=1)
    with_tools = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                                max_tokens=1)
    # Qwen3's template writes the tools' JSON into the system prompt (the tiny vocabulary: about a token a byte)
    assert with_tools.usage.prompt_tokens - plain.usage.prompt_tokens > len(json.dumps(TOOLS)) // 2


def test_fifty_seeded_samples_at_temperature_one_all_parse_and_validate(client, model_id) -> None:
    """51 answers (17 requests of n=3, seeded) with every call of them valid; the calls that close within
    max_tokens are most of them (the rest end with finish_reason "length" and the calls before the one cut)."""
    complete = 0
    for seed in range(17):  # 51 answers
        r = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=100 + seed, n=3)
        for choice in r.choices:
            _assert_valid(choice.message)
            assert choice.model_extra["tool_calls_valid"] is (choice.finish_reason == "tool_calls")
            if choice.finish_reason == "tool_calls":
                complete += 1
                assert choice.message.tool_calls
            else:  # cut inside a call: the calls before it, whole, are kept (a later one of parallel calls cut)
                assert choice.finish_reason == "length"
    assert complete >= 46, complete


def test_parallel_calls_come_numbered_streamed_as_not(client, model_id) -> None:
    """min_tokens (vLLM's) keeps the model from ending after its first call: it goes on with more calls (the
    default parallel_tool_calls), numbered by index in the stream, each valid."""
    kwargs = dict(model=model_id, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300,
                  temperature=1.0, seed=9, extra_body={"min_tokens": 120})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) >= 2
    _assert_valid(whole.message)
    assert len({c.id for c in whole.message.tool_calls}) == len(whole.message.tool_calls)
    with client.chat.completions.stream(**kwargs) as stream:
        indices = [piece.index for event in stream if event.type == "chunk" and event.chunk.choices
                   for piece in event.chunk.choices[0].delta.tool_calls or []]
        final = stream.get_final_completion().choices[0]
    assert _calls(final.message) == _calls(whole.message)
    assert sorted(set(indices)) == list(range(len(whole.message.tool_calls)))


def test_parallel_tool_calls_false_gives_one_call(client, model_id) -> None:
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=7, n=3)
    assert all(len(c.message.tool_calls) <= 1 for c in r.choices)
    assert sum(c.finish_reason == "tool_calls" for c in r.choices) >= 2


def test_streamed_calls_accumulate_to_the_non_streamed_ones(client, model_id) -> None:
    for seed in (11, 12, 13):
        kwargs = dict(model=model_id, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
                      temperature=1.0, seed=seed)
        whole = client.chat.completions.create(**kwargs).choices[0]
        first_pieces = []
        with client.chat.completions.stream(**kwargs) as stream:
            for event in stream:
                if event.type == "chunk" and event.chunk.choices and event.chunk.choices[0].delta.tool_calls:
                    piece = event.chunk.choices[0].delta.tool_calls[0]
                    if piece.id is not None:
                        first_pieces.append(piece)
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == whole.finish_reason == "tool_calls"
        assert _calls(final.message) == _calls(whole.message)
        assert [p.function.name for p in first_pieces] == [c.function.name for c in whole.message.tool_calls]
        assert all(p.function.arguments == "" for p in first_pieces)  # the name first, then the arguments


def test_a_relaxed_schema_is_reported_and_its_calls_validated_after(client, model_id) -> None:
    """uniqueItems is not enforced while generating (the grammar is relaxed, and says so): every call is still
    checked against the whole schema, and the check is reported on the choice."""
    schema = {"type": "object", "properties": {"picks": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2,
                                                         "maxItems": 2, "uniqueItems": True}},
              "required": ["picks"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": schema}}]
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=9, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.model_extra["tool_calls_relaxed"] is True
        picks = json.loads(choice.message.tool_calls[0].function.arguments)["picks"]
        assert len(picks) == 2 and set(picks) <= {1, 2, 3}  # what the grammar enforced
        valid = len(set(picks)) == 2
        assert choice.model_extra["tool_calls_valid"] is valid
        assert ("tool_call_errors" in choice.model_extra) is not valid


# ---------------------------------------------------------------------------------------------------- a loop
def test_an_agent_loop_call_result_answer(client, model_id) -> None:
    messages = list(MESSAGES)
    first = client.chat.completions.create(model=model_id, messages=messages, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=200, temperature=1.0, seed=21).choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    messages.append(first.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})})
    final = client.chat.completions.create(model=model_id, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=20, temperature=1.0, seed=22)
    assert final.choices[0].message.tool_calls == [] and final.choices[0].message.content
    # the call and its result were rendered (Qwen3: <tool_call> in the assistant turn, <tool_response> after it)
    assert final.usage.prompt_tokens > len(call.function.arguments) + len('{"temperature": 21}')


def test_tool_turns_render_as_transformers_renders_them(server, template_path) -> None:
    """/tokenize of a conversation with tools, a call (arguments as OpenAI's JSON string) and its result gives the
    ids of transformers' apply_chat_template given the same turns with the arguments as a dict."""
    transformers = pytest.importorskip("transformers")
    from logitproc.compile.tiny_model import make_tiny_model
    from logitproc.compile.tokenizer_source import from_model

    arguments = {"city": "Paris", "days": 2}
    wire = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    hf_turns = [*wire[:1], {**wire[1], "tool_calls": [{**wire[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": arguments}}]}, wire[2]]
    tokenizer = from_model(make_tiny_model(seed=0)).tokenizer()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    for kwargs in ({}, {"enable_thinking": False}):
        text = hf.apply_chat_template(hf_turns, tools=TOOLS, chat_template=template_path.read_text(),
                                      add_generation_prompt=True, tokenize=False, **kwargs)
        r = raw_post(server, "/tokenize", {"messages": wire, "tools": TOOLS, "chat_template_kwargs": kwargs})
        assert r["tokens"] == tokenizer.encode(text, add_special_tokens=False).ids


def raw_post(server: ServerProcess, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("change", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integr"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS + [TOOLS[0]]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": MESSAGES + [{"role": "tool", "tool_call_id": "call_1", "content": "21"}]}, "messages"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"thinking_token_budget": 5}, "thinking_token_budget"),  # the tiny vocabulary has no <think> token
    ({"tools": TOOLS, "json_whitespace": "indented"}, "json_whitespace"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, model_id, change, param) -> None:
    body = {"messages": MESSAGES, "max_tokens": 5, **change}
    extra = {k: body.pop(k) for k in ("chat_template_kwargs", "thinking_token_budget", "json_whitespace")
             if k in body}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, extra_body=extra, **body)
    assert caught.value.body["param"] == param, caught.value.body


# ---------------------------------------------------------------------------------------------------- whitespace
ARGUMENTS = {"a": 1, "b": 2.5, "op": "plus"}
#: Each syntax's call of ``add`` (``required``), with the arguments' text in place of ``%s``.
CALL_TEXTS = {CallSyntax.HERMES: '<tool_call>\n{"name": "add", "arguments": %s}\n</tool_call>',
              CallSyntax.LLAMA3_JSON: '{"name": "add", "parameters": %s}',
              CallSyntax.MISTRAL_JSON: '[TOOL_CALLS][{"name": "add", "arguments": %s}]',
              CallSyntax.MISTRAL_ARGS: "[TOOL_CALLS]add[ARGS]%s"}
LAYOUTS = {"compact": json.dumps(ARGUMENTS, separators=(",", ":")), "spaced": json.dumps(ARGUMENTS),
           "loose": '{\n  "a" : 1,\t"b":2.5 , "op":"plus"\n}', "indented": json.dumps(ARGUMENTS, indent=2)}


@pytest.fixture(scope="module")
def adapter(deepseek_adapter):
    return deepseek_adapter


def _grammar_takes(adapter, grammar: str, text: str) -> bool:
    from logitproc.runtime.grammar import get_backend
    from logitproc.runtime.response_format import parse_response_format

    backend = get_backend("llguidance", adapter)
    matcher = backend.matcher(backend.compile(parse_response_format({"type": "grammar", "grammar": grammar})))
    ids = [adapter.byte_tokens[b] for b in text.encode()]
    return matcher.try_accept_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("syntax", list(CallSyntax))
@pytest.mark.parametrize("policy", ["compact", "flexible"])
def test_call_arguments_keep_to_the_whitespace_policy(adapter, syntax, policy) -> None:
    """Each syntax's call grammar: the envelope as the template writes it, the arguments compact (the default, as
    OpenAI returns them) or in any whitespace (flexible; no newline-and-indent layout: indented is refused)."""
    from logitproc.serve.tool_definitions import parse_tools
    from logitproc.serve.tool_syntax import call_grammar

    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}
    tools = parse_tools({**body, "json_whitespace": policy} if policy != "compact" else body)
    assert tools is not None and tools.whitespace == policy
    grammar = call_grammar(syntax, tools)
    taken = {name: _grammar_takes(adapter, grammar, CALL_TEXTS[syntax] % text) for name, text in LAYOUTS.items()}
    assert taken == {"compact": True, "spaced": policy == "flexible", "loose": policy == "flexible",
                     "indented": policy == "flexible"}


def test_the_arguments_policy_comes_from_the_request_or_the_server() -> None:
    """``json_whitespace`` of a request with tools lays out its calls' arguments; unset, the server's
    ``--json-whitespace`` when it is one the arguments take (an ``indented`` server default lays out JSON answers
    only: the arguments stay compact); ``indented`` asked for calls is a 400 naming the field; with tool_choice
    none the field needs a JSON response_format as before."""
    from logitproc.serve.openai_protocol import APIError, parse_chat_request

    body = {"messages": MESSAGES, "tools": TOOLS}
    assert parse_chat_request(body).chat_options.tools.whitespace == "compact"
    assert parse_chat_request({**body, "json_whitespace": "flexible"}).chat_options.tools.whitespace == "flexible"
    assert parse_chat_request(body, {"json_whitespace": "flexible"}).chat_options.tools.whitespace == "flexible"
    assert parse_chat_request(body, {"json_whitespace": "indented"}).chat_options.tools.whitespace == "compact"
    assert parse_chat_request({**body, "json_whitespace": "compact"},
                              {"json_whitespace": "flexible"}).chat_options.tools.whitespace == "compact"
    for bad, message in (({**body, "json_whitespace": "indented"}, "for tool calls must be one of"),
                         ({**body, "json_whitespace": "tabs"}, "for tool calls must be one of"),
                         ({**body, "tool_choice": "none", "json_whitespace": "flexible"}, "needs a response_format")):
        with pytest.raises(APIError, match=message) as err:
            parse_chat_request(bad)
        assert err.value.param == "json_whitespace"


def test_parameters_refer_to_their_own_definitions() -> None:
    """A parameter schema's ``$ref`` to its own ``$defs`` resolves (the arguments are their own ``%json`` root)."""
    import llguidance
    from logitproc.serve.tool_definitions import parse_tools
    from logitproc.serve.tool_syntax import call_grammar

    schema = {"type": "object", "properties": {"op": {"$ref": "#/$defs/op"}}, "required": ["op"],
              "$defs": {"op": {"enum": ["plus", "minus"]}}}
    tools = parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
    for syntax in CallSyntax:
        grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar(syntax, tools))
        assert not llguidance.LLMatcher.validate_grammar(grammar), syntax


@pytest.mark.parametrize("policy", ["compact", "flexible"])
def test_served_calls_keep_to_the_whitespace_policy(client, model_id, policy) -> None:
    """Through the server with the tiny model: n = 3 sampled answers of required calls, every call's arguments
    valid and, by default, compact."""
    extra = {} if policy == "compact" else {"json_whitespace": policy}
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=1.0, seed=11, n=3, extra_body=extra)
    calls = [call for choice in r.choices for call in choice.message.tool_calls or []]
    assert calls
    for choice in r.choices:
        _assert_valid(choice.message)
    for call in calls:
        assert layout_of(call.function.arguments, policy), call.function.arguments


# ---------------------------------------------------------------------------------------------------- reasoning
def test_reasoning_content_is_split_from_the_answer(client, model_id) -> None:
    """A grammar makes the random model think first: the think block comes back as reasoning_content, the rest as
    content, streamed or not."""
    grammar = 'start: "<think>\\n" /[a-z]{3,8}/ "\\n</think>\\n\\n" /[a-z]{3,8}/'
    kwargs = dict(model=model_id, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=5,
                  response_format={"type": "grammar", "grammar": grammar})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content.isalpha() and message.content.isalpha()
    reasoning = content = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_an_answer_that_starts_inside_a_think_block(client, model_id) -> None:
    """A prompt that leaves a think block open (here a prefilled assistant message that opened one): the answer is
    read as reasoning up to </think>."""
    messages = [*MESSAGES, {"role": "assistant", "content": "<think>\nLet me see"}]
    grammar = 'start: /[a-z]{3,8}/ "\\n</think>\\n\\n" /[a-z]{3,8}/'
    r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=40, temperature=1.0, seed=6,
                                       response_format={"type": "grammar", "grammar": grammar},
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    message = r.choices[0].message
    assert message.reasoning_content.isalpha()
    assert message.content.isalpha()


def test_chat_template_kwargs_reach_the_template(client, model_id) -> None:
    """Qwen3's enable_thinking=false writes an empty think block into the prompt."""
    on = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=1)
    off = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_thinking_token_budget_is_the_engines_think_budget() -> None:
    """vLLM's thinking_token_budget becomes the config's max_thinking_tokens (the engine's ThinkBudget, tested through
    the server on a vocabulary with marker tokens in tests/test_marker_tokens.py); the engine then opens the think
    block, so the answer is read as starting inside it, and a tool grammar starts after it (the ThinkBudget holds it
    until then)."""
    from logitproc.serve.chat_turn import ChatTraits, TurnPlan
    from logitproc.serve.openai_protocol import parse_chat_request

    parsed = parse_chat_request({"messages": MESSAGES, "thinking_token_budget": 7, "tools": TOOLS,
                                 "tool_choice": "required"})
    assert parsed.config.max_thinking_tokens == 7
    plan = TurnPlan.make(ChatTraits(CallSyntax.HERMES, thinking=True), parsed.config, parsed.chat_options.tools, "")
    assert plan.markers == ReasoningMarkers(starts_inside=True)
    assert "thought" not in plan.config.response_format.text  # the grammar is the calls alone
    parser = plan.parser()
    parser.feed('weighing\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2, "op": "plus"}}'
                "\n</tool_call>")
    parser.finish()
    assert parser.reasoning == "weighing" and [c.name for c in parser.tool_calls] == ["add"]


# ---------------------------------------------------------------------------------------------------- prefill
def test_continue_final_message_continues_the_assistant_text(client, model_id, template_path) -> None:
    """Greedy: the continued chat answers as a text completion of the template's rendering cut after the final
    message's text (transformers' continue_final_message)."""
    messages = [*MESSAGES, {"role": "assistant", "content": "The weather is"}]
    r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    rendered = ChatTemplate.from_file(template_path).render(messages, add_generation_prompt=False)
    prompt = rendered[: rendered.rfind("The weather is") + len("The weather is")]
    text = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert r.choices[0].message.content == text
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    assert caught.value.body["param"] == "continue_final_message"


# ---------------------------------------------------------------------------------------------------- the syntax
@pytest.mark.parametrize(("name", "syntax"), [
    ("Qwen-Qwen2.5-7B-Instruct", CallSyntax.HERMES), ("Qwen-Qwen3-0.6B", CallSyntax.HERMES),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", CallSyntax.HERMES), ("Qwen-QwQ-32B", CallSyntax.HERMES),
    ("meta-llama-Llama-3.1-8B-Instruct", CallSyntax.LLAMA3_JSON),
    ("meta-llama-Llama-3.3-70B-Instruct", CallSyntax.LLAMA3_JSON),
    ("Qwen3-Coder", None), ("GLM-4.6", None),  # <tool_call> with another form inside
    ("mistralai-Mistral-Nemo-Instruct-2407", CallSyntax.MISTRAL_JSON), ("google-gemma-2-2b-it", None),
])
def test_the_call_syntax_is_what_the_template_writes(template_path, name, syntax) -> None:
    template = ChatTemplate.from_file(template_path.with_name(f"{name}.jinja"), "<s>", "</s>")
    assert detect_syntax(template) is syntax


# ---------------------------------------------------------------------------------------------------- the parser
TWO_CALLS = ('<think>\nweigh it </thin> up\n</think>\n\nSure. <tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Pa\\"}ris", "n": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": '
             '{}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 2, 5, len(TWO_CALLS)])
def test_the_answer_parser_gives_the_same_message_however_the_text_is_cut(step) -> None:
    parser = AnswerParser(CallSyntax.HERMES, ReasoningMarkers())
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    for start in range(0, len(TWO_CALLS), step):
        for piece in (parser.feed(TWO_CALLS[start:start + step]),):
            reasoning += piece.reasoning
            content += piece.content
            for call in piece.calls:
                entry = calls.setdefault(call.index, [call.name, ""])
                entry[1] += call.arguments
    rest = parser.finish()
    assert (reasoning + rest.reasoning, content + rest.content) == ("weigh it </thin> up", "Sure. ")
    assert [tuple(v) for v in calls.values()] == [
        ("get_weather", '{"city": "Pa\\"}ris", "n": [1, {"a": "}"}]}'), ("add", "{}")]
    assert [(c.name, c.arguments) for c in parser.tool_calls] == [tuple(v) for v in calls.values()]
    assert parser.finish_reason("stop") == "tool_calls"


def test_a_call_cut_short_is_not_a_call() -> None:
    parser = AnswerParser(CallSyntax.HERMES)
    parser.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    parser.finish()
    assert parser.tool_calls == [] and parser.incomplete and parser.finish_reason("length") == "length"


# ---------------------------------------------------------------------------------------------------- Llama 3.1
def test_llama_3_1_json_calls(template_path) -> None:
    """Llama 3.1's template (tools in the first user message; a call is the whole answer, ``{"name": ...,
    "parameters": ...}``): required calls from the first token, auto answers in text or a call."""
    proc = ServerProcess("--model", "tiny", "--chat-template",
                         str(template_path.with_name("meta-llama-Llama-3.1-8B-Instruct.jinja")))
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        for seed in range(3):
            r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               max_tokens=150, temperature=1.0, seed=seed)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            _assert_valid(choice.message)
        texts = []
        for seed in range(4, 8):
            message = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=20,
                                                     temperature=1.0, seed=seed).choices[0].message
            _assert_valid(message)
            texts.append(message.content if not message.tool_calls else None)
        assert any(texts), texts  # the random model answers in text too
    finally:
        assert proc.stop() == 0


PIECES = ["<tool_call>", "\n", '{"name": "f", "arguments": ', '{"name": "g\\"", "arguments": ', "{", "}", '"', "\\",
          "</tool_call>", "<think>", "</think>", " ", "a", ",", "[", "]", '"k": ', "1", "<tool_", "</thi",
          "[TOOL_CALLS]", "[TOOL_CALLS][", "f[ARGS]", "[ARGS]", "[CALL_ID]abc", ", ", "[TOOL_", "[THINK]", "[/THINK]",
          "[/THI"]


def _split(parser: AnswerParser, text: str, cuts: list[int]) -> tuple[str, str, list[tuple[str, str]], str | None]:
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)] + [parser.finish()]
    for piece in pieces:
        reasoning += piece.reasoning
        content += piece.content
        for call in piece.calls:
            calls.setdefault(call.index, [call.name or "", ""])[1] += call.arguments
    return reasoning, content, [tuple(v) for v in calls.values()], parser.finish_reason("stop")


@settings(max_examples=300, deadline=None)
@example(pieces=["<tool_call>"] * 4 + ["[TOOL_CALLS]", "f[ARGS]", "[TOOL_CALLS][", '{"name": "f", "arguments": '],
         cuts=[89], syntax=CallSyntax.MISTRAL_ARGS, thinking=False, inside=False, mistral=False)  # text after a call,
# cut before a space: the space was dropped (each later piece's leading whitespace was stripped)
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.lists(st.integers(0, 400), max_size=12),
       st.sampled_from([*CallSyntax, None]), st.booleans(), st.booleans(), st.booleans())
def test_any_text_cut_anywhere_splits_as_the_whole_text(pieces, cuts, syntax, thinking, inside, mistral) -> None:
    """The parser never fails on any text, and a stream cut anywhere gives the non-streamed message."""
    text = "".join(pieces)
    think = ("[THINK]", "[/THINK]") if mistral else ("<think>", "</think>")
    markers = ReasoningMarkers(*think, starts_inside=inside) if thinking else None
    whole = _split(AnswerParser(syntax, markers), text, [])
    assert _split(AnswerParser(syntax, markers), text, cuts) == whole


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                                        "continue_final_message", "add_generation_prompt", "thinking_token_budget",
                                        "json_whitespace"]),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                                    lambda inner: st.lists(inner, max_size=3)
                                    | st.dictionaries(st.sampled_from(["type", "function", "name", "parameters",
                                                                       "properties", "required", "x"]), inner,
                                                      max_size=4), max_leaves=12)),
       st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                                        "content": st.text(max_size=5)},
                                       optional={"tool_calls": st.just([{"id": "c1", "type": "function", "function": {
                                           "name": "f", "arguments": "{}"}}]), "tool_call_id": st.just("c1")}),
                min_size=1, max_size=3))
def test_any_tool_fields_parse_or_are_400s(fields, messages) -> None:
    from logitproc.serve.openai_protocol import APIError, parse_chat_request

    try:
        parsed = parse_chat_request({"messages": messages, **fields})
    except APIError as err:
        assert err.status == 400 and err.param
        return
    assert parsed.chat_options.tools is None or parsed.chat_options.tools.functions


# ---------------------------------------------------------------------------------------------------- SmolLM2
@pytest.mark.slow  # a real model's server (about 50 s here): the tiny model's tests above are the fast variant
def test_smollm2_calls_a_tool_through_qwen_s_template(template_path) -> None:
    """A real model (SmolLM2-135M, whose own ChatML template has no tools) given Qwen2.5's tool template: its greedy
    calls for a weather question parse and validate, streamed as not."""
    import os

    from logitproc.compile.model_fetch import fetch_default_model
    from logitproc.serve.cli_options import open_model

    kept = os.environ.get("LOGITPROC_TEST_MODEL_CACHE")
    path = str(fetch_default_model(kept)) if kept else "default"
    open_model(path, "cpu")  # compiled here (or found in the cache); the server then opens it from the cache
    qwen = str(template_path.with_name("Qwen-Qwen2.5-7B-Instruct.jinja"))
    proc = ServerProcess("--model", path, "--max-batch", "2", "--chat-template", qwen, api_key=None)
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=300)
        kwargs = dict(model=path, messages=[{"role": "user", "content": "What is the weather in Paris tomorrow?"}],
                      tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60)
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _assert_valid(choice.message)
        with client.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion().choices[0]
        assert _calls(final.message) == _calls(choice.message)
    finally:
        assert proc.stop() == 0
