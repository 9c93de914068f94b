"""A Hugging Face Llama-family checkpoint directory read into the same structure ``load_gguf`` produces.

A directory with ``config.json``, one or more ``*.safetensors`` and ``tokenizer.json`` (``tokenizer_config.json``
is read for the chat template when present). ``load_hf_dir(path)`` returns a ``GGUFModel`` whose weights carry the
GGUF names and layout: ``[out, in]`` float32, and the q/k rows permuted from Hugging Face's half-rotation order
into GGML's adjacent-pair order (the permutation llama.cpp's converter applies), so ``NumpyLlama`` and the compiler
treat both sources alike. The tokenizer is the directory's own: its JSON rides along in
``metadata["tokenizer.huggingface.json"]`` (the compiler saves it as is); the vocabulary and merges are also
unpacked into ``tokens``/``merges`` so ``build_tokenizer`` can rebuild it for ``gpt2``-style byte-level BPE.

Safetensors are read with the standard library and numpy (an 8-byte little-endian header size, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the raw tensors); F32, F16 and BF16 are accepted. Architectures:
``LlamaForCausalLM`` (SmolLM2, Llama) and ``Qwen2ForCausalLM`` (q/k/v biases).

``write_hf_dir(model, path)`` writes a ``GGUFModel`` back out in this format (used to test the loader).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_model import GGUFModel, LlamaConfig, build_tokenizer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_DTYPES = {"F32": np.float32, "F16": np.float16}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def hf_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The files a checkpoint directory's model depends on: config, tokenizer files and the safetensors."""
    path = Path(directory)
    files = [path / "config.json", path / "tokenizer.json"]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory: {file.name} is missing")
    if (path / "tokenizer_config.json").is_file():
        files.append(path / "tokenizer_config.json")
    tensors = sorted(path.glob("*.safetensors"))
    if not tensors:
        raise FileNotFoundError(f"{path} holds no *.safetensors")
    return files + tensors


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor of a ``.safetensors`` file as a float32 numpy array (F32, F16, BF16)."""
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
        data = handle.read()
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[begin:end]
        if info["dtype"] == "BF16":
            array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] in _DTYPES:
            array = np.frombuffer(raw, _DTYPES[info["dtype"]]).astype(np.float32)
        else:
            raise ValueError(f"{Path(path).name}: tensor {name} has dtype {info['dtype']} (F32, F16, BF16 only)")
        out[name] = array.reshape(info["shape"]).copy()
    return out


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, np.ndarray]) -> None:
    """Write float32 tensors as a ``.safetensors`` file."""
    header: dict[str, Any] = {}
    offset = 0
    blobs = []
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for blob in blobs:
            handle.write(blob)


def _to_adjacent(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q/k rows (or bias) from half-rotation order to GGML's adjacent-pair order."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _to_halves(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of ``_to_adjacent``."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocabulary(tokenizer: dict[str, Any]) -> tuple[list[str], list[int], list[str]]:
    model = tokenizer["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer model {model.get('type')!r} is not supported (byte-level BPE only)")
    vocab: dict[str, int] = dict(model["vocab"])
    special: set[int] = set()
    for added in tokenizer.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    size = max(vocab.values()) + 1
    tokens = [f"<unused_{i}>" for i in range(size)]
    for token, index in vocab.items():
        tokens[index] = token
    types = [3 if i in special else 1 for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def load_hf_dir(directory: str | os.PathLike[str]) -> GGUFModel:
    """Read a Hugging Face checkpoint directory (see the module doc)."""
    path = Path(directory)
    files = hf_files(path)
    cfg = json.loads((path / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path.name}: architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")
    tokenizer_text = (path / "tokenizer.json").read_text()
    tokens, token_types, merges = _vocabulary(json.loads(tokenizer_text))
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text()) if files[2].name == "tokenizer_config.json" \
        else {}

    raw: dict[str, np.ndarray] = {}
    for file in files:
        if file.suffix == ".safetensors":
            raw.update(read_safetensors(file))
    n_heads = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads", n_heads))
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    weights: dict[str, np.ndarray] = {}
    for name, array in raw.items():
        if name in _TOP_NAMES:
            weights[_TOP_NAMES[name]] = array
            continue
        parts = name.split(".", 3)  # model, layers, i, rest
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in _LAYER_NAMES:
            if "rotary_emb" in name:
                continue
            raise ValueError(f"{path.name}: unexpected tensor {name}")
        gguf_name = f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
        if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            array = _to_adjacent(array, n_heads)
        elif gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            array = _to_adjacent(array, n_kv)
        weights[gguf_name] = np.ascontiguousarray(array, dtype=np.float32)
    tied = bool(cfg.get("tie_word_embeddings", "output.weight" not in weights))
    if tied:
        weights.pop("output.weight", None)
    elif "output.weight" not in weights:
        raise ValueError(f"{path.name}: tie_word_embeddings is false but lm_head.weight is missing")

    eos = cfg.get("eos_token_id", 0)
    eos_id = int(eos[0] if isinstance(eos, list) else eos)
    config = LlamaConfig(
        architecture="llama",
        n_layers=int(cfg["num_hidden_layers"]),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        ffn=int(cfg["intermediate_size"]),
        vocab=int(cfg.get("vocab_size", len(tokens))),
        context=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied_embeddings=tied,
        bos_id=int(cfg.get("bos_token_id") or 0),
        eos_id=eos_id,
        head_dim=head_dim,
        rope_dim=head_dim,
        chat_template=tok_cfg.get("chat_template"),
        name=str(cfg.get("_name_or_path") or path.name),
    )
    if cfg.get("rope_scaling"):
        raise ValueError(f"{path.name}: rope_scaling {cfg['rope_scaling']} is not supported")
    if len(tokens) < config.vocab:  # embedding rows beyond the tokenizer's ids (padding)
        tokens += [f"<pad_{i}>" for i in range(len(tokens), config.vocab)]
        token_types += [5] * (config.vocab - len(token_types))
    metadata = {"general.architecture": "llama", "general.name": config.name, "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "default", "tokenizer.huggingface.json": tokenizer_text,
                "hf.architecture": arch}
    return GGUFModel(path=path, config=config, weights=weights, tensor_types={n: "F32" for n in weights},
                     tokens=tokens, token_types=token_types, merges=merges, metadata=metadata)


def write_hf_dir(model: GGUFModel, directory: str | os.PathLike[str]) -> Path:
    """Write ``model`` as a Hugging Face directory (config.json, model.safetensors, tokenizer files)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    inverse_layer = {v: k for k, v in _LAYER_NAMES.items()}
    inverse_top = {v: k for k, v in _TOP_NAMES.items()}
    tensors: dict[str, np.ndarray] = {}
    for name, array in model.weights.items():
        if name in inverse_top:
            tensors[inverse_top[name]] = array
            continue
        _, layer, rest = name.split(".", 2)
        if rest in ("attn_q.weight", "attn_q.bias"):
            array = _to_halves(array, cfg.n_heads)
        elif rest in ("attn_k.weight", "attn_k.bias"):
            array = _to_halves(array, cfg.n_kv_heads)
        tensors[f"model.layers.{layer}.{inverse_layer[rest]}"] = array
    write_safetensors(path / "model.safetensors", tensors)
    has_bias = "blk.0.attn_q.bias" in model.weights
    config = {
        "architectures": ["Qwen2ForCausalLM" if has_bias else "LlamaForCausalLM"],
        "hidden_size": cfg.hidden, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn, "vocab_size": cfg.vocab,
        "max_position_embeddings": cfg.context, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps,
        "tie_word_embeddings": cfg.tied_embeddings, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        "_name_or_path": cfg.name,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer.json").write_text(build_tokenizer(model).to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": cfg.chat_template}))
    return path
