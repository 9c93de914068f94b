"""The context a model is compiled for, and sliding windows, against transformers and llama.cpp on tiny
random-weight models (``family_models.py``).

* LongRoPE (Phi-3.5-mini, Phi-4-mini): the default context is the original one (``short_factor``); a longer one,
  asked for at compile time (``compile_model(context=...)``), takes ``long_factor`` for every position, which is
  what transformers computes for a sequence longer than the original context and what llama.cpp computes whenever
  its configured context is longer; a context beyond ``max_position_embeddings`` is refused before any compile.
* Sliding windows: a window that transformers applies to every layer (Mistral v0.1, Phi-3-mini-4k) is served on
  every layer (the context is no longer cut to the window); one it ignores (a Llama ``config.json``) caps the
  context, where attention is the same either way; Qwen2/Qwen3's ``use_sliding_window`` is refused; a Phi-3 GGUF's
  ``attention.sliding_window`` of 0 (the converter's "none") is none.
* Phi-3 in llama.cpp: llama.cpp's ``phi3`` vocabulary loader needs Phi-3's own special tokens, so the tiny model
  is written with Phi-3's real vocabulary (``ggml-vocab-phi-3.gguf`` of the llama-cpp-python sdist); llama.cpp's
  logits on it, with a context within and beyond the original one, agree with the numpy reference's; its
  ``<|end|>`` ends an answer, as in llama.cpp.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import family_models
import numpy as np
import pytest
from family_models import CASES, FamilyCase
from logitproc.compile.gguf_model import load_gguf
from logitproc.compile.hf_config import config_from_hf
from logitproc.compile.hf_model import load_hf_dir
from logitproc.compile.model_compile import compile_model, eos_token_ids
from logitproc.compile.rope import RopeScaling
from logitproc.serve.compiled_model import CompiledModel
from logitproc.serve.numpy_llama import NumpyLlama

pytest.importorskip("transformers")

TOL_NUMPY = 1e-4
TOL_COMPILED = 1e-2
PROMPT = [0, 1, 5, 80, 91, 7, 200, 150, 12, 260, 33, 101, 2, 45, 46, 47, 3, 270]
DECODE_STEPS = 16
#: the tiny Phi-3's original context (``family_models.CASES["phi3"]``) and its max_position_embeddings
ORIGINAL, LONGEST = 128, 512
#: a prompt longer than the original context
LONG_PROMPT = [0] + np.random.default_rng(0).integers(3, family_models.VOCAB, 149).tolist()


def _model_files(case: FamilyCase, root: Path, seed: int = 0) -> tuple[Any, Path, Path]:
    model = family_models.build_transformers_model(case, seed=seed)
    folder = family_models.write_hf_folder(model, case, root / f"hf-{case.name}")
    return model, folder, family_models.write_gguf(model, case, root / f"{case.name}.gguf")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """The tiny Phi-3 (LongRoPE: original context 128 of 512, partial rotary): transformers model, folder, GGUF."""
    return _model_files(CASES["phi3"], tmp_path_factory.mktemp("phi3"))


def _greedy(compiled: CompiledModel, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """The compiled model's logits after ``prompt`` and after each of ``steps`` greedy tokens, and the tokens."""
    compiled.add_sequence(0)
    rows = [compiled.prefill([0], [prompt])[0]]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        rows.append(compiled.decode([0], [tokens[-1]])[0])
    return np.stack(rows), tokens


# ---------------------------------------------------------------- LongRoPE's context

def test_longrope_default_context_is_the_original_one(phi3) -> None:
    _, folder, gguf_path = phi3
    for loaded in (load_hf_dir(folder), load_gguf(gguf_path)):
        config = loaded.config
        assert (config.context, config.context_limit, config.rope_original_context) == (ORIGINAL, LONGEST, ORIGINAL)
        assert config.rope.factors == pytest.approx(family_models.PHI3_ROPE["short_factor"])  # float32 in a GGUF
        assert config.with_context(LONGEST).rope.factors == pytest.approx(family_models.PHI3_ROPE["long_factor"])
        assert config.with_context(ORIGINAL).rope == config.rope


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_longrope_long_context_numpy_matches_transformers(phi3, fmt: str) -> None:
    """A sequence longer than the original context: transformers rotates every position by the long factors, and
    so does a model whose context is longer (from either format); the short factors are far off there."""
    model, folder, gguf_path = phi3
    loaded = load_hf_dir(folder) if fmt == "hf" else load_gguf(gguf_path)
    expected = family_models.reference_logits(model, LONG_PROMPT)
    long = dataclasses.replace(loaded, config=loaded.config.with_context(LONGEST))
    np.testing.assert_allclose(NumpyLlama(long).extend_all(LONG_PROMPT), expected, atol=TOL_NUMPY, rtol=0)
    short = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, context=LONGEST,
                                                                   rope_original_context=0))
    assert np.abs(NumpyLlama(short).extend_all(LONG_PROMPT) - expected).max() > 1e-2


def test_longrope_long_context_compiled_matches_transformers(phi3) -> None:
    """Compiled with ``context=512``: a 150-token prompt and 16 greedy steps agree with transformers' logits."""
    model, _, gguf_path = phi3
    compiled = CompiledModel.open(gguf_path, weight_dtype="float32", kv_dtype="float32", context=LONGEST,
                                  max_num_sequences=1)
    assert compiled.context_length == LONGEST
    rows, tokens = _greedy(compiled, LONG_PROMPT, DECODE_STEPS)
    expected = family_models.reference_logits(model, tokens)[len(LONG_PROMPT) - 1:]
    np.testing.assert_allclose(rows, expected, atol=TOL_COMPILED, rtol=0)


def test_context_beyond_max_position_embeddings_is_refused_before_compiling(phi3) -> None:
    _, folder, _ = phi3
    lines: list[str] = []
    with pytest.raises(ValueError, match=f"context {LONGEST + 1} .* up to {LONGEST}"):
        compile_model(folder, progress=lines.append, weight_dtype="float32", context=LONGEST + 1)
    assert not any("Relax" in line or "compil" in line for line in lines), lines
    with pytest.raises(ValueError, match="positive"):
        compile_model(folder, progress=lines.append, context=0)


def test_the_command_line_refuses_a_context_too_long_before_compiling() -> None:
    """``logitproc compile --context``: the tiny model (context 4096) refuses 100000, naming its limit."""
    done = subprocess.run([sys.executable, "-m", "logitproc", "compile", "--model", "tiny", "--context", "100000"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode != 0
    assert "context 100000" in done.stderr and "up to 4096" in done.stderr, done.stderr
    assert "Relax" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_longrope_without_long_factors_serves_the_original_context_only() -> None:
    rope = RopeScaling(1e4, (1.0, 2.0), "longrope", 1.2, max_context=128)
    assert rope.for_context(128) is rope
    with pytest.raises(ValueError, match="no long_factor"):
        rope.for_context(129)


# ---------------------------------------------------------------- sliding windows: served or refused

SIZES = {"vocab_size": family_models.VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 512}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _config_json(model_type: str, **changes: Any) -> dict[str, Any]:
    """transformers' own ``config.json`` of a tiny model of ``model_type`` with ``changes``."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **SIZES, **changes)
    cfg.architectures = [ARCHITECTURES[model_type]]
    return json.loads(cfg.to_json_string())


#: (model_type, config changes, expected (context, context_limit, window layers, window) or the refusal's words)
WINDOW_CASES = [
    ("mistral", {"sliding_window": 6}, (512, 512, (0, 1), 6)),  # Mistral v0.1: every layer slides
    ("mistral", {"sliding_window": 4096}, (512, 512, (), 0)),  # wider than the context: never bites
    ("mistral", {"sliding_window": None}, (512, 512, (), 0)),
    ("phi3", {"sliding_window": 6}, (512, 512, (0, 1), 6)),  # Phi-3-mini-4k's 2047 of 4096
    ("llama", {"sliding_window": 6}, (6, 6, (), 0)),  # transformers' Llama ignores it: the context is capped
    ("qwen2", {"use_sliding_window": False, "sliding_window": 6}, (512, 512, (), 0)),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 6}, "use_sliding_window"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 6}, "use_sliding_window"),
]


@pytest.mark.parametrize(("model_type", "changes", "expected"), WINDOW_CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items())}" for c in WINDOW_CASES])
def test_every_sliding_window_is_served_or_refused(model_type: str, changes: dict[str, Any], expected: Any) -> None:
    cfg = _config_json(model_type, **changes)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            config_from_hf(cfg)
        return
    config = config_from_hf(cfg)
    assert (config.context, config.context_limit, config.window_layers, config.sliding_window) == expected


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """A tiny Mistral v0.1 (a window of 6 on every layer, under the 18-token prompt): model, folder, GGUF."""
    case = FamilyCase("mistral", "mistral", "llama", {"sliding_window": 6, "eos_token_id": 2})
    return _model_files(case, tmp_path_factory.mktemp("mistral"), seed=1)


def test_mistral_window_on_every_layer_matches_transformers(mistral) -> None:
    model, folder, _ = mistral
    loaded = load_hf_dir(folder)
    assert loaded.config.window_layers == (0, 1) and loaded.config.context == 512
    expected = family_models.reference_logits(model, PROMPT)
    np.testing.assert_allclose(NumpyLlama(loaded).extend_all(PROMPT), expected, atol=TOL_NUMPY, rtol=0)
    loaded.config = dataclasses.replace(loaded.config, window_layers=())
    assert np.abs(NumpyLlama(loaded).extend_all(PROMPT) - expected).max() > 1e-2  # the window bites


def test_mistral_window_compiled_matches_transformers(mistral) -> None:
    """From the Hugging Face folder: the prompt (three times the window) and 16 greedy steps."""
    model, folder, _ = mistral
    compiled = CompiledModel.open(folder, weight_dtype="float32", kv_dtype="float32", max_num_sequences=1)
    rows, tokens = _greedy(compiled, PROMPT, DECODE_STEPS)
    expected = family_models.reference_logits(model, tokens)[len(PROMPT) - 1:]
    np.testing.assert_allclose(rows, expected, atol=TOL_COMPILED, rtol=0)


def test_phi3_window_reads_from_both_formats(phi3, tmp_path: Path) -> None:
    """Phi-3's ``sliding_window`` (config.json) and ``phi3.attention.sliding_window`` (the GGUF, as llama.cpp's
    converter writes it) give a window on every layer, matching transformers; the tiny Phi-3 without one has the
    converter's 0 in its GGUF, which is none."""
    case = FamilyCase("phi3-window", "phi3", "phi3", {**copy.deepcopy(CASES["phi3"].overrides), "sliding_window": 6})
    model, folder, gguf_path = _model_files(case, tmp_path, seed=2)
    expected = family_models.reference_logits(model, PROMPT)
    for loaded in (load_hf_dir(folder), load_gguf(gguf_path)):
        assert loaded.config.window_layers == (0, 1) and loaded.config.sliding_window == 6
        np.testing.assert_allclose(NumpyLlama(loaded).extend_all(PROMPT), expected, atol=TOL_NUMPY, rtol=0)
    assert load_gguf(phi3[2]).config.window_layers == ()
    assert "phi3.attention.sliding_window" in load_gguf(phi3[2]).metadata


# ---------------------------------------------------------------- Phi-3 in llama.cpp

#: the tiny Phi-3 with Phi-3's vocabulary (32064 tokens) and an original context of 256, llama.cpp's smallest
PHI3_VOCAB_ORIGINAL = 256


@pytest.fixture(scope="module")
def phi3_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF of the tiny Phi-3 with Phi-3's vocabulary (32064 SentencePiece tokens), original context 256 of 1024."""
    from material import vocab_metadata

    vocab = vocab_metadata("phi-3")
    overrides = {**copy.deepcopy(CASES["phi3"].overrides), "vocab_size": len(vocab["tokenizer.ggml.tokens"]),
                 "original_max_position_embeddings": PHI3_VOCAB_ORIGINAL, "max_position_embeddings": 1024,
                 "bos_token_id": 1, "eos_token_id": vocab["tokenizer.ggml.eos_token_id"]}
    case = FamilyCase("phi3-vocab", "phi3", "phi3", overrides, eos_ids=(vocab["tokenizer.ggml.eos_token_id"],))
    model = family_models.build_transformers_model(case, seed=3)
    return family_models.write_gguf(model, case, tmp_path_factory.mktemp("phi3-vocab") / "phi3.gguf", vocab=vocab)


def test_llama_cpp_reads_a_phi3_gguf_as_the_numpy_reference_does(phi3_vocab: Path) -> None:
    """llama.cpp (float32 KV cache) on a tiny Phi-3 written with Phi-3's real vocabulary: with a context of 256
    (the original: short factors) and 512 (long factors for every position) its logits after every prompt token
    agree with the numpy reference's compiled for the same context. Measured 5e-6 both."""
    llama_cpp = pytest.importorskip("llama_cpp")
    loaded = load_gguf(phi3_vocab)
    prompt = [1] + np.random.default_rng(1).integers(100, 32000, 20).tolist()
    for n_ctx in (PHI3_VOCAB_ORIGINAL, 2 * PHI3_VOCAB_ORIGINAL):
        llm = llama_cpp.Llama(str(phi3_vocab), n_ctx=n_ctx, n_batch=64, logits_all=True, verbose=False, n_threads=1,
                              type_k=0, type_v=0)  # GGML_TYPE_F32
        assert llm.n_ctx() == n_ctx
        llm.eval(prompt)
        got = np.asarray(llm.scores[:len(prompt)])
        reference = dataclasses.replace(loaded, config=loaded.config.with_context(n_ctx))
        np.testing.assert_allclose(got, NumpyLlama(reference).extend_all(prompt), atol=TOL_COMPILED, rtol=0,
                                   err_msg=f"n_ctx {n_ctx}")


def test_phi3_end_of_turn_ends_an_answer_as_in_llama_cpp(phi3_vocab: Path) -> None:
    """A Phi-3 GGUF names only ``<|endoftext|>`` (32000) as its EOS; its turns end with ``<|end|>`` (32007), which
    ends an answer here as in llama.cpp: every id that ends one is an end-of-generation id of llama.cpp's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model = load_gguf(phi3_vocab, load_weights=False)
    ids = eos_token_ids(model)
    assert model.config.eos_ids == (32000,) and model.tokens[32007] == "<|end|>" and 32007 in ids
    llm = llama_cpp.Llama(str(phi3_vocab), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert all(llama_cpp.llama_vocab_is_eog(vocab, i) for i in ids), ids


#: texts with Phi-3's special tokens and whitespace around them (what its chat template renders, and worse)
PHI3_TEXTS = ["<|user|>\nHello world<|end|>\n<|assistant|>\n",
              "<|system|>\n  You are kind.<|end|>\n<|user|>\n\nHi <|end|>\n<|assistant|>\n",
              "a</s>  b<s> c<|endoftext|> d", "<|user|> x"]


def test_phi3_special_tokens_take_the_whitespace_after_them_as_in_llama_cpp(phi3_vocab: Path) -> None:
    """Phi-3's special tokens (but ``<unk>``, ``<s>``, ``<|endoftext|>``) take the whitespace after them
    (``rstrip``): the newline its chat template writes after ``<|user|>`` is not a token. Encoded as llama.cpp
    encodes them, special tokens parsed."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from logitproc.compile.tokenizer_source import from_gguf_file
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(from_gguf_file(phi3_vocab).tokenizer_json)
    llm = llama_cpp.Llama(str(phi3_vocab), vocab_only=True, verbose=False)
    for text in PHI3_TEXTS:
        want = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert tokenizer.encode(text, add_special_tokens=False).ids == want, text
    assert 13 not in tokenizer.encode(PHI3_TEXTS[0], add_special_tokens=False).ids  # "<0x0A>": no newline token
