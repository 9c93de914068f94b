"""Real chat templates render as transformers' ``apply_chat_template`` renders them (the oracle), or fail as it does.

The templates are llama.cpp's ``models/templates/*.jinja`` of the supported families (read out of the
llama-cpp-python sdist by ``tests/material.py``); transformers renders each given the template string and a tiny
tokenizer that only carries the BOS/EOS texts.
"""

from __future__ import annotations

import pytest
from logitproc.serve.chat_template import CHATML, ChatTemplate, ChatTemplateError
from material import llama_cpp_models

transformers = pytest.importorskip("transformers")

TEMPLATES = [
    "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
    "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen-QwQ-32B", "microsoft-Phi-3.5-mini-instruct",
    "google-gemma-2-2b-it", "mistralai-Mistral-Nemo-Instruct-2407", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "fireworks-ai-llama-3-firefunction-v2",
    "meetkai-functionary-medium-v3.1", "meetkai-functionary-medium-v3.2",
]
BOS, EOS = "<s>", "</s>"

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]},
}}
TOOL_CALL = {"id": "abc123xyz", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "user": ([{"role": "user", "content": "What is the capital of France?"}], {}),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {}),
    "multi-turn": ([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?\n"},
    ], {}),
    "tools": ([{"role": "user", "content": "Weather in Paris?"}], {"tools": [WEATHER_TOOL]}),
    "tool result": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "22 C and sunny", "tool_call_id": "abc123xyz", "name": "get_weather"},
    ], {"tools": [WEATHER_TOOL]}),
    "no thinking": ([{"role": "user", "content": "Hi"}], {"enable_thinking": False}),
}


@pytest.fixture(scope="module")
def reference():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token=BOS, eos_token=EOS)


@pytest.fixture(scope="module", params=TEMPLATES)
def template(request) -> tuple[str, str]:
    return request.param, (llama_cpp_models() / "templates" / f"{request.param}.jinja").read_text(encoding="utf-8")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_renders_as_transformers(reference, template, conversation: str, add_generation_prompt: bool) -> None:
    name, source = template
    messages, kwargs = CONVERSATIONS[conversation]
    try:
        expected = reference.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as err:  # the template refuses the conversation (raise_exception): ours must refuse it too
        with pytest.raises(ChatTemplateError, match="failed to render") as ours:
            ChatTemplate(source, BOS, EOS, name).render(messages, add_generation_prompt, **kwargs)
        assert name in str(ours.value) and str(err).splitlines()[0] in str(ours.value)
        return
    assert ChatTemplate(source, BOS, EOS, name).render(messages, add_generation_prompt, **kwargs) == expected


def test_chatml_fallback_renders_chatml() -> None:
    text = ChatTemplate(CHATML).render(CONVERSATIONS["system"][0])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplate.for_model(None, None, None).source == CHATML


def test_raise_exception_and_syntax_errors_are_chat_template_errors(tmp_path) -> None:
    failing = ChatTemplate("{{ raise_exception('roles must alternate') }}", origin="the test template")
    with pytest.raises(ChatTemplateError, match="the test template failed to render these messages: roles must"):
        failing.render([])
    with pytest.raises(ChatTemplateError, match="not valid jinja"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError, match="cannot read it"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.render([])


def test_tojson_and_strftime_now_as_transformers_defines_them() -> None:
    text = ChatTemplate("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ strftime_now('%Y') }}").render(
        [], tools=[{"name": "é<b>"}])
    compact, indented, year = text.split("|")
    assert compact == '[{"name": "é<b>"}]' and indented.startswith('[\n  {\n    "name"') and year.isdigit()
