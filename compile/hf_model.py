"""A Hugging Face checkpoint directory of a supported family read into the same structure ``load_gguf`` produces.

A directory with ``config.json``, one or more ``*.safetensors`` and ``tokenizer.json`` (``tokenizer_config.json``
is read for the chat template and ``generation_config.json`` for more EOS ids when present). ``load_hf_dir(path)``
returns a ``GGUFModel`` whose config comes from ``hf_config.config_from_hf`` (the family from ``architectures``;
every key read or refused) and whose weights carry the GGUF names (``ModelFamily.hf_to_gguf_names``), ``[out, in]``
float32, in the canonical layout (``model_family``: Hugging Face's q/k order; a family's ``hf_norm_offset`` added to
its norm weights, as llama.cpp's converter adds it), each read from its file when looked
up (``LazyWeights``: a compile holds one tensor at a time). The tokenizer is the directory's
own: its JSON rides along in ``metadata["tokenizer.huggingface.json"]`` (the compiler saves it as is); the
vocabulary and merges are also unpacked into ``tokens``/``merges``.

Safetensors are read one tensor at a time with the ``safetensors`` library's numpy API (F32, F16 and BF16:
``ml_dtypes`` gives numpy its bfloat16); a tensor the family does not have is refused, as is a missing one. A
multimodal checkpoint (``ModelFamily.hf_multimodal``: Gemma 3's ``Gemma3ForConditionalGeneration``) gives its text
model (``hf_multimodal``: the config's ``text_config``, the tensors under the language model's prefix); the image
side's tensors are skipped with one line on stderr (their count and size).

``write_hf_dir(model, path)`` writes a ``GGUFModel`` back out in this format (used to test the loader).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .families import family_named
from .gguf_model import GGUFModel, build_tokenizer
from .gguf_tensors import LazyWeights
from .hf_config import config_from_hf
from .hf_multimodal import multimodal_of, text_tensor_name

#: the safetensors dtypes read (others are refused), and the bytes per value of every dtype (for the skipped size)
_READ_DTYPES = ("F32", "F16", "BF16")
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

GENERATION_CONFIG = "generation_config.json"


def hf_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The files a checkpoint directory's model depends on (its build's hash): config, tokenizer and chat template
    files and the safetensors."""
    path = Path(directory)
    files = [path / "config.json", path / "tokenizer.json"]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory: {file.name} is missing")
    for optional in ("tokenizer_config.json", GENERATION_CONFIG, "chat_template.jinja", "chat_template.json"):
        if (path / optional).is_file():
            files.append(path / optional)
    tensors = sorted(path.glob("*.safetensors"))
    if not tensors:
        raise FileNotFoundError(f"{path} holds no *.safetensors")
    return files + tensors


def _safetensors_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of a ``.safetensors`` file by name -> (dtype, shape), from its header."""
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), framework="np") as handle:
        for name in handle.keys():  # noqa: SIM118  (a safe_open handle is not a mapping)
            info = handle.get_slice(name)
            tensors[name] = (info.get_dtype(), tuple(info.get_shape()))
    return tensors


def read_safetensor(path: Path, name: str, rows: slice = slice(None)) -> np.ndarray:
    """One tensor of a ``.safetensors`` file (its ``rows``) as a float32 numpy array."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy API needs for BF16)
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as handle:
        return np.ascontiguousarray(handle.get_slice(name)[rows], dtype=np.float32)


def _offset(read: Callable[[], np.ndarray], offset: float) -> np.ndarray:
    """``read()`` plus ``offset`` (float32)."""
    return read() + np.float32(offset)


def _vocabulary(tokenizer: dict[str, Any]) -> tuple[list[str], list[int], list[str]]:
    """Tokens by id, their types (3: special added tokens, 1: the others) and the merges (a Unigram model has
    none) of a ``tokenizer.json`` whose model is ``BPE`` (byte-level or SentencePiece-style) or ``Unigram``
    (``[piece, score]`` pairs in id order)."""
    model = tokenizer["model"]
    kind = model.get("type")
    if kind == "BPE":
        vocab: dict[str, int] = dict(model["vocab"])
    elif kind == "Unigram":
        vocab = {}
        for index, entry in enumerate(model["vocab"]):
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
                raise ValueError(f"tokenizer.json: Unigram vocab entry {index} must be [piece, score], got "
                                 f"{entry!r:.60}")
            vocab.setdefault(entry[0], index)
    else:
        raise ValueError(f"tokenizer model {kind!r} is not supported (BPE or Unigram)")
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
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text()) \
        if (path / "tokenizer_config.json").is_file() else {}
    generation = json.loads((path / GENERATION_CONFIG).read_text()) if (path / GENERATION_CONFIG).is_file() else None
    config = config_from_hf(cfg, generation, name=str(cfg.get("_name_or_path") or path.name),
                            chat_template=tok_cfg.get("chat_template"))
    family = family_named(config.architecture)
    tokenizer_text = (path / "tokenizer.json").read_text()
    tokens, token_types, merges = _vocabulary(json.loads(tokenizer_text))

    names = family.hf_to_gguf_names(config.n_layers)
    wrapper = multimodal_of(cfg, family)
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    skipped: list[int] = []  # the image side's tensors (a multimodal checkpoint): their sizes in bytes
    for file in files:
        if file.suffix != ".safetensors":
            continue
        for stored, (dtype, shape) in _safetensors_tensors(file).items():
            name = stored if wrapper is None else text_tensor_name(stored, wrapper)
            if name is None:
                skipped.append(int(np.prod(shape)) * _DTYPE_BYTES.get(dtype, 0))
                continue
            if name not in names:
                raise ValueError(f"{path.name}: tensor {stored} is not part of the {family.name} family")
            if dtype not in _READ_DTYPES:
                raise ValueError(f"{file.name}: tensor {stored} has dtype {dtype} (F32, F16, BF16 only)")
            config.check_shape(name, names[name], shape, file.name)
            if names[name] == ("output.weight",) and config.tied_embeddings:
                continue  # a copy of the embedding
            start = 0
            for part in names[name]:  # a fused tensor's canonical parts, by rows (else the tensor itself)
                rows = None if len(names[name]) == 1 else config.tensor_shape(part)[0]
                loaders[part] = functools.partial(read_safetensor, file, stored,
                                                  slice(start, None if rows is None else start + rows))
                if family.hf_norm_offset and part.endswith("norm.weight"):  # Gemma's (1 + w): canonical w + 1
                    loaders[part] = functools.partial(_offset, loaders[part], family.hf_norm_offset)
                start += rows or 0
    if wrapper is not None:
        print(f"{path.name}: {wrapper.architecture}: its text model only; {len(skipped)} image-side tensors "
              f"({sum(skipped) / 1e6:.1f} MB) skipped (images are not supported)", file=sys.stderr)
    weights = LazyWeights(loaders)
    expected = set(family.tensor_names(config.n_layers, config.tied_embeddings))
    if set(weights) != expected:
        missing = sorted(expected - set(weights))
        raise ValueError(f"{path.name}: tensor(s) {missing[:5]} are missing (tie_word_embeddings is "
                         f"{config.tied_embeddings})")
    if len(tokens) < config.vocab:  # embedding rows beyond the tokenizer's ids (padding)
        tokens += [f"<pad_{i}>" for i in range(len(tokens), config.vocab)]
        token_types += [5] * (config.vocab - len(token_types))
    metadata = {"general.architecture": config.architecture, "general.name": config.name,
                "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
                "tokenizer.huggingface.json": tokenizer_text, "hf.architecture": cfg["architectures"][0]}
    return GGUFModel(path=path, config=config, weights=weights, tensor_types={n: "F32" for n in weights},
                     tokens=tokens, token_types=token_types, merges=merges, metadata=metadata)


def write_hf_dir(model: GGUFModel, directory: str | os.PathLike[str]) -> Path:
    """Write ``model`` as a Hugging Face directory (config.json, model.safetensors, tokenizer files)."""
    from safetensors.numpy import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    family = family_named(cfg.architecture)
    if cfg.rope_factors:
        raise ValueError("write_hf_dir writes unscaled RoPE only")
    if family.hf_fused:
        raise ValueError(f"write_hf_dir does not fuse tensors ({family.name})")
    if family.hf_norm_offset or family.window_pattern or family.embed_scaled:
        raise ValueError(f"write_hf_dir writes Llama-like families only, not {family.name}")
    to_hf = {gguf[0]: hf for hf, gguf in family.hf_to_gguf_names(cfg.n_layers).items()}
    save_file({to_hf[name]: np.ascontiguousarray(array, dtype=np.float32) for name, array in model.weights.items()},
              str(path / "model.safetensors"))
    config = {
        "architectures": [family.hf_architectures[0]],
        "hidden_size": cfg.hidden, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn,
        "vocab_size": cfg.vocab, "max_position_embeddings": cfg.context, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tied_embeddings, "bos_token_id": cfg.bos_id,
        "eos_token_id": list(cfg.eos_ids) if len(cfg.eos_ids) > 1 else cfg.eos_id, "_name_or_path": cfg.name,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer.json").write_text(build_tokenizer(model).to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": cfg.chat_template}))
    return path
