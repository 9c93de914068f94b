"""Tokenizers rebuilt from GGUF metadata against llama.cpp's own test material, and the checks made before compiling.

The oracle: llama.cpp's ``models/ggml-vocab-*.gguf`` (real vocabularies: Llama 3, Llama 2 / Mistral, Qwen2, Phi-3,
GPT-2, Gemma 4) and, for each, ``.gguf.inp`` texts with the ids llama.cpp must give them in ``.gguf.out`` (read out
of the llama-cpp-python sdist into the test-data cache by ``tests/material.py``).
"""

from __future__ import annotations

import json
import time

import pytest
from logitproc.compile.gguf_tokenizer import GGUFVocab, build_tokenizer
from logitproc.compile.tiny_model import make_tiny_model
from logitproc.compile.tokenizer_source import from_gguf_file, from_hf_dir, from_model
from material import llama_cpp_models, vocab_cases, vocab_metadata
from tokenizers import Tokenizer

SUPPORTED_VOCABS = ["llama-bpe", "llama-spm", "qwen2", "phi-3", "gpt-2", "gemma-4"]


@pytest.fixture(scope="module", params=SUPPORTED_VOCABS)
def vocab(request) -> tuple[str, GGUFVocab, Tokenizer]:
    parsed = GGUFVocab.from_metadata(vocab_metadata(request.param), request.param)
    return request.param, parsed, build_tokenizer(parsed)


def test_every_llama_cpp_case_encodes_to_its_ids(vocab) -> None:
    name, parsed, tokenizer = vocab
    cases = vocab_cases(name)
    assert len(cases) > 40
    wrong = [(text, tokenizer.encode(text, add_special_tokens=False).ids, ids) for text, ids in cases
             if tokenizer.encode(text, add_special_tokens=False).ids != ids]
    assert not wrong, f"{name}: {len(wrong)} of {len(cases)} differ, first {wrong[0]}"


BOS_ADDED = {"llama-bpe": True, "llama-spm": True, "phi-3": True, "qwen2": False, "gpt-2": False, "gemma-4": True}


def test_bos_is_added_as_the_gguf_says(vocab) -> None:
    name, parsed, tokenizer = vocab
    plain = tokenizer.encode("Hello world", add_special_tokens=False).ids
    full = tokenizer.encode("Hello world").ids
    assert full == ([parsed.bos_id] if BOS_ADDED[name] else []) + plain


def test_control_tokens_are_special_and_text_round_trips(vocab) -> None:
    name, parsed, tokenizer = vocab
    eos = parsed.tokens[parsed.eos_id]
    ids = tokenizer.encode(f"Hi{eos}", add_special_tokens=False).ids
    assert ids[-1] == parsed.eos_id
    text = "naïve café, 世界 🙂 x=1234\n\tend"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text


@pytest.mark.parametrize(("name", "key", "value"), [
    ("bert-bge", "tokenizer.ggml.model", "'bert'"),
    ("qwen35", "tokenizer.ggml.pre", "'qwen35'"),
])
def test_vocabularies_not_understood_are_refused_in_one_sentence(name: str, key: str, value: str) -> None:
    with pytest.raises(ValueError) as err:
        GGUFVocab.from_metadata(vocab_metadata(name), name)
    message = str(err.value)
    assert key in message and value in message and "supported" in message and "\n" not in message


def test_an_unknown_pre_tokenizer_is_refused_before_anything_compiles() -> None:
    from logitproc.compile.model_compile import compile_model

    model = make_tiny_model()
    model.metadata["tokenizer.ggml.pre"] = "falcon"
    lines: list[str] = []
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"pre-tokenizer \(tokenizer.ggml.pre\) 'falcon' is not supported"):
        compile_model(model, progress=lines.append, cache=False)
    assert time.perf_counter() - started < 10
    assert not any("kernel library" in line or "loading" in line for line in lines), lines


def test_a_bad_chat_template_is_refused_before_anything_compiles() -> None:
    model = make_tiny_model()
    model.metadata["tokenizer.chat_template"] = "{% for m in messages %}{{ m.content }"
    with pytest.raises(ValueError, match="not valid jinja"):
        from_model(model)


def _hf_folder(tmp_path, config: dict, template_file: str | None = None):
    tokenizer = build_tokenizer(make_tiny_model())
    tokenizer.post_processor = None
    (tmp_path / "tokenizer.json").write_text(tokenizer.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_text(template_file)
    return tmp_path


def test_hf_add_bos_token_rebuilds_the_post_processor(tmp_path) -> None:
    folder = _hf_folder(tmp_path, {"add_bos_token": True, "bos_token": {"content": "<|endoftext|>"},
                                   "eos_token": "<|im_end|>"})
    own = from_hf_dir(folder)
    tokenizer = own.tokenizer()
    assert tokenizer.encode("the cat").ids[0] == 0
    assert tokenizer.encode("the cat", add_special_tokens=False).ids[0] != 0
    assert (own.bos_token, own.eos_token) == ("<|endoftext|>", "<|im_end|>")


def test_hf_chat_template_sources(tmp_path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert from_hf_dir(_hf_folder(tmp_path, {"chat_template": named})).chat_template == "D"
    assert from_hf_dir(_hf_folder(tmp_path, {"chat_template": "S"}, template_file="F")).chat_template == "F"
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match=r"none named 'default'"):
        from_hf_dir(_hf_folder(tmp_path, {"chat_template": named[:1]}))
    assert from_hf_dir(_hf_folder(tmp_path, {})).chat_template is None


def test_a_gguf_file_gives_its_tokenizer_and_template_without_its_tensors() -> None:
    own = from_gguf_file(llama_cpp_models() / "ggml-vocab-phi-3.gguf")
    assert (own.bos_token, own.eos_token) == ("<s>", "<|endoftext|>")
    assert own.chat_template is not None and "<|assistant|>" in own.chat_template
    tokenizer = own.tokenizer()
    assert tokenizer.encode("Hello world").ids == [1, *tokenizer.encode("Hello world", add_special_tokens=False).ids]
