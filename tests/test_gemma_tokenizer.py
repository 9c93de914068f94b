"""A Gemma-style SentencePiece GGUF vocabulary (``tokenizer.ggml.model = llama``, no space prefix, BOS added, control
turn markers, user-defined tokens for a blank line and a run of spaces, byte fallback) encodes as llama.cpp itself
(llama-cpp-python, vocab only) encodes it. llama-cpp-python 0.3.36 ships no Gemma 2/3 test vocabulary
(``ggml-vocab-gemma-4`` is checked in ``test_tokenizers.py``), so this one is written here with gguf-py."""

from __future__ import annotations

from pathlib import Path

import pytest
from logitproc.compile.tokenizer_source import from_gguf_file

llama_cpp = pytest.importorskip("llama_cpp")

TEXTS = ["the cat sat", " the cat", "hello\n\nthe  cat", "é 😀 x", "  ", "\n\n\n", "the   cat\n\n\nsat  "]
#: Control markers parse in logitproc's ``encode`` (message text is kept from them by ``serve/chat_tokens.py``):
#: compared with llama.cpp's parsing of special tokens.
SPECIAL_TEXTS = ["<start_of_turn>user\nthe cat<end_of_turn>\n<start_of_turn>model\n"]


@pytest.fixture(scope="module")
def gemma_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gguf

    path = tmp_path_factory.mktemp("gemma-vocab") / "gemma-spm.gguf"
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n\n", "▁▁"]
    types = [3, 3, 3, 2, 3, 3, 4, 4]  # control, unknown, user-defined
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256  # byte
    words = ["▁", "▁the", "▁cat", "he", "th", "▁c", "at", "t", "h", "e", "c", "a", "▁sat"]
    tokens += words
    types += [1] * len(words)
    writer = gguf.GGUFWriter(str(path), "gemma2")
    for add, value in ((writer.add_context_length, 512), (writer.add_embedding_length, 64),
                       (writer.add_block_count, 2), (writer.add_feed_forward_length, 128), (writer.add_head_count, 4),
                       (writer.add_head_count_kv, 2), (writer.add_key_length, 32), (writer.add_value_length, 32),
                       (writer.add_sliding_window, 6)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_attn_logit_softcapping(50.0)
    writer.add_final_logit_softcapping(30.0)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * 264 + [-float(i) for i in range(len(words))])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)  # llama.cpp's Gemma converters write false
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS)
def test_gemma_sentencepiece_encodes_as_llama_cpp(gemma_vocab: Path, text: str) -> None:
    llm = llama_cpp.Llama(str(gemma_vocab), vocab_only=True, verbose=False)
    want = llm.tokenize(text.encode(), add_bos=True, special=text in SPECIAL_TEXTS)
    tokenizer = from_gguf_file(gemma_vocab).tokenizer()
    assert tokenizer.encode(text).ids == want
    assert tokenizer.decode(want, skip_special_tokens=text not in SPECIAL_TEXTS) == (
        text if text not in SPECIAL_TEXTS else "<bos>" + text)
