"""GGUF files in the quantisations people download, made here by llama.cpp's own quantiser: the default model
(SmolLM2-135M-Instruct Q4_1, dequantised by gguf-py to F16 first), a tiny random Llama with K-quant-sized rows and a
random Llama of Llama-3.2-1B's shape (``--base llama1b``, for benchmarks), each re-quantised by
``llama_cpp.llama_model_quantize`` to Q4_K_M, Q8_0, ... Files are built once into a cache folder and reused. Needs
llama-cpp-python (the ``oracle`` extra).

    python3 scripts/quantised_files.py [--cache DIR] [--base smollm2|tiny|llama1b] [--types Q4_K_M Q8_0]
"""

from __future__ import annotations

import argparse
import ctypes
import os
from pathlib import Path

import numpy as np

#: llama.cpp file types by name (``LLAMA_FTYPE_MOSTLY_<name>``)
FILE_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0")
#: the tiny model's sizes: every row a multiple of 256, so that K-quants apply to all of them
TINY = {"n_layers": 2, "hidden": 256, "n_heads": 4, "n_kv_heads": 2, "ffn": 512, "seed": 5}
#: Llama-3.2-1B's shape (random weights, tied embedding; the tiny vocabulary padded with unused tokens)
LLAMA_1B = {"n_layers": 16, "hidden": 2048, "n_heads": 32, "n_kv_heads": 8, "ffn": 8192, "vocab": 128256}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's adjacent-pair order (its converter's ``permute``)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_f32(path: Path) -> Path:
    """The tiny random Llama (``make_tiny_model(**TINY)``, untied head) as an F32 GGUF laid out as llama.cpp's
    converter writes it (q/k rows permuted, byte tokens typed NORMAL)."""
    import gguf
    from logitproc.compile.tiny_model import make_tiny_model

    model = make_tiny_model(**TINY, tied_embeddings=False, name="tiny-kquant")
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(cfg.name)
    writer.add_context_length(cfg.context)
    writer.add_embedding_length(cfg.hidden)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.ffn)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(model.tokens)
    writer.add_token_types([1 if t == 6 else t for t in model.token_types])
    writer.add_token_merges(model.merges)
    writer.add_bos_token_id(cfg.bos_id)
    writer.add_eos_token_id(cfg.eos_id)
    writer.add_chat_template(cfg.chat_template)
    for name, array in model.weights.items():
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            array = _permute(array, cfg.n_heads if "attn_q" in name else cfg.n_kv_heads)
        writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_1b_f16(path: Path) -> Path:
    """A random Llama of ``LLAMA_1B``'s shape as an F16 GGUF (2.5 GB), one tensor at a time; its tokenizer is the
    tiny model's byte-level BPE, padded to the vocabulary size with unused tokens."""
    import gguf
    from logitproc.compile.tiny_model import TINY_CHAT_TEMPLATE, tiny_vocabulary

    shape = LLAMA_1B
    hidden, ffn, layers = shape["hidden"], shape["ffn"], shape["n_layers"]
    head_dim = hidden // shape["n_heads"]
    tokens, types, merges = tiny_vocabulary()
    tokens += [f"<|unused_{i}|>" for i in range(shape["vocab"] - len(tokens))]
    types = [1 if t == 6 else t for t in types] + [4] * (shape["vocab"] - len(types))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("random-llama-1b")
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(shape["n_heads"])
    writer.add_head_count_kv(shape["n_kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    rng = np.random.default_rng(7)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(shape["vocab"], hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    kv = shape["n_kv_heads"] * head_dim
    for i in range(layers):
        for name, (rows, cols) in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                                   ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
                                   ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(rows, cols))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantise_to_f16(source: Path, path: Path) -> Path:
    """``source`` with every tensor dequantised by gguf-py (float16 matrices, float32 vectors), metadata copied."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).reshape([int(d) for d in reversed(tensor.shape)])
        writer.add_tensor(tensor.name, values.astype(np.float16 if values.ndim == 2 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_quantize(source: Path, path: Path, file_type: str) -> Path:
    """``source`` quantised by llama.cpp (``llama_model_quantize``) to ``file_type`` (``FILE_TYPES``)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = True
    params.nthread = 2
    tmp = path.with_suffix(".part")
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize({source.name} -> {file_type}) returned {code}")
    tmp.rename(path)
    return path


def quantised_file(cache: Path, base: str, file_type: str) -> Path:
    """``base`` ("smollm2" or "tiny") in ``file_type``, built into ``cache`` unless it is there."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{base}.{file_type}.gguf"
    if path.exists():
        return path
    f_path = cache / f"{base}.F.gguf"
    if not f_path.exists():
        if base == "tiny":
            write_tiny_f32(f_path.with_suffix(".part")).rename(f_path)
        elif base == "llama1b":
            write_1b_f16(f_path.with_suffix(".part")).rename(f_path)
        else:
            from logitproc.compile.model_fetch import fetch_default_model

            default = fetch_default_model(os.environ.get("LOGITPROC_TEST_MODEL_CACHE"))
            dequantise_to_f16(Path(default), f_path.with_suffix(".part")).rename(f_path)
    return llama_quantize(f_path, path, file_type)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("LOGITPROC_TEST_MODEL_CACHE", "/tmp"))
                        / "quantised")
    parser.add_argument("--base", choices=("smollm2", "tiny", "llama1b"), default="smollm2")
    parser.add_argument("--types", nargs="+", default=list(FILE_TYPES), choices=FILE_TYPES)
    args = parser.parse_args()
    for file_type in args.types:
        path = quantised_file(args.cache, args.base, file_type)
        print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
