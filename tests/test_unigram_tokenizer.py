"""A Hugging Face folder whose ``tokenizer.json`` is a Unigram model (SentencePiece's other kind: Metaspace spaces,
``<0xNN>`` byte fallback), read by the HF tokenizers library as is: the folder loads (``load_hf_dir``), text
round-trips through encode and decode, the incremental detokenizer never shows half a character of a byte-fallback
emoji, and the grammar engines' token bytes are the pieces' text. The model weights are the tiny Llama of
``family_models.py`` (277 logits: the tokenizer's 272 ids plus padding)."""

from __future__ import annotations

import json
from pathlib import Path

import family_models
import pytest
from logitproc.compile.hf_model import load_hf_dir
from logitproc.compile.tokenizer_source import from_model
from logitproc.runtime.grammar.tokenizer_adapter import TokenizerAdapter
from logitproc.serve.detokenizer import IncrementalDetokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

pytest.importorskip("transformers")

WORDS = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁a", "▁", "t", "h", "e", "c", "a", "s"]
TEXT = "the cat sat on a mat é 😀 zq"


def unigram_tokenizer() -> Tokenizer:
    """Three specials, the 256 byte pieces, a few words (scores: longer pieces likelier)."""
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    vocab += [(w, -1.0 - 5.0 / len(w)) for w in WORDS]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    case = family_models.FamilyCase("unigram", "llama", "llama", {"eos_token_id": 2, "bos_token_id": 1})
    model = family_models.build_transformers_model(case)
    directory = family_models.write_hf_folder(model, case, tmp_path_factory.mktemp("unigram") / "hf")
    (directory / "tokenizer.json").write_text(unigram_tokenizer().to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": "{{ messages }}"}))
    return directory


def test_a_unigram_folder_loads_and_round_trips_text(folder: Path) -> None:
    model = load_hf_dir(folder)
    assert model.tokens[:3] == ["<unk>", "<s>", "</s>"] and model.tokens[259] == WORDS[0]
    assert len(model.tokens) == model.config.vocab == 277  # the tokenizer's 272 ids plus padding
    tokenizer = from_model(model).tokenizer()
    ids = tokenizer.encode(TEXT).ids
    assert ids[0] == 1  # <s>, as tokenizer_config.json's add_bos_token says
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert 259 in ids and tokenizer.token_to_id("<0xF0>") in ids  # words and byte-fallback pieces


def test_the_detokenizer_emits_whole_characters_of_a_unigram_vocabulary(folder: Path) -> None:
    tokenizer = from_model(load_hf_dir(folder)).tokenizer()
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add_tokens([token]) for token in tokenizer.encode(TEXT).ids]
    assert "".join(deltas) + detok.flush() == TEXT
    assert not any("\ufffd" in delta for delta in deltas)


def test_grammar_token_bytes_of_a_unigram_vocabulary(folder: Path) -> None:
    model = load_hf_dir(folder)
    adapter = TokenizerAdapter(from_model(model).tokenizer(), model.config.vocab, [2])
    assert adapter.token_bytes[259] == b" the" and adapter.token_bytes[3 + 0xF0] == b"\xf0"
    assert adapter.token_bytes[1] == b"" and adapter.token_bytes[276] == b""  # special, padding
