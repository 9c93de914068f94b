"""A GGUF's weight tensors read one at a time into the canonical layout (``model_family``): float32 arrays by GGUF
name, or a quantised tensor's raw blocks (requantised to Q8_0 where no kernel reads its type), with a ``llama``
GGUF's q/k rows un-permuted to half-rotation order."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from .families import family_named
from .model_config import LlamaConfig
from .quant_formats import LAYOUTS, to_q8_0_blocks

#: Raw GGUF blocks of quantised tensors: name -> (GGML type name, uint8 array [rows, bytes per row]).
RawTensors = dict[str, tuple[str, np.ndarray]]
#: GGML types whose blocks the compiled model's kernels read as they are.
BLOCK_TYPES = ("Q8_0", "Q4_1", *LAYOUTS)
#: GGML types read as float (every other type is quantised)
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def unpermute_qk_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a q/k projection (any per-row data: weights, raw blocks, bias) from llama.cpp's adjacent-pair order
    (its converter's ``permute``) back to Hugging Face's half-rotation order."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qk_heads(name: str, config: LlamaConfig) -> int | None:
    """The head count to un-permute ``name``'s rows by (q/k weights and biases), else None."""
    suffix = name.split(".", 2)[-1] if name.startswith("blk.") else ""
    if suffix in ("attn_q.weight", "attn_q.bias"):
        return config.n_heads
    if suffix in ("attn_k.weight", "attn_k.bias"):
        return config.n_kv_heads
    return None


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """One GGUF tensor (``GGUFReader`` tensor) as an owned, C-contiguous float32 array, ``[out, in]`` order."""
    from gguf.quants import dequantize

    return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, order="C", copy=True)


def is_rope_tensor(name: str) -> bool:
    """Whether ``name`` is a model-level RoPE tensor (``rope_freqs``, ``rope_factors_short``, ...): config, not
    weights."""
    return name.startswith("rope_")


def read_rope_tensors(tensors: Iterable[Any]) -> dict[str, np.ndarray]:
    """The RoPE tensors' values (float32, flat) by name."""
    return {t.name: dequantize_tensor(t).reshape(-1) for t in tensors if is_rope_tensor(t.name)}


class LazyWeights(Mapping[str, np.ndarray]):
    """Weights by GGUF name, each read from its file (float32, canonical layout) when looked up and not kept: a
    compile holds one tensor at a time, never the whole model in float32."""

    def __init__(self, loaders: dict[str, Callable[[], np.ndarray]]) -> None:
        self._loaders = loaders

    def __getitem__(self, name: str) -> np.ndarray:
        return self._loaders[name]()

    def __contains__(self, name: object) -> bool:
        return name in self._loaders

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


def gguf_weights(tensors: Iterable[Any], config: LlamaConfig, *,
                 keep_blocks: bool) -> tuple[LazyWeights, RawTensors]:
    """The weights of ``tensors`` (a ``GGUFReader``'s, over its memory map): float32 by GGUF name, read when looked
    up, or with ``keep_blocks`` the quantised ones as raw blocks (copied: the stored bytes; a type without a
    kernel, ``BLOCK_TYPES``, requantised to Q8_0, one line per type saying so); q/k rows un-permuted when the
    family's GGUFs permute them."""
    family = family_named(config.architecture)
    parts_of = family.gguf_file_tensors(config.n_layers, config.tied_embeddings)
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    blocks: RawTensors = {}
    requantised: dict[str, int] = {}
    for tensor in tensors:
        if is_rope_tensor(tensor.name):
            continue
        start = 0
        for name in parts_of[tensor.name]:  # a fused tensor's canonical parts, by rows (else the tensor itself)
            rows = None if len(parts_of[tensor.name]) == 1 else config.tensor_shape(name)[0]
            span = slice(start, None if rows is None else start + rows)
            start += rows or 0
            heads = _qk_heads(name, config) if family.gguf_qk_permuted else None
            kind = tensor.tensor_type.name
            if keep_blocks and kind in BLOCK_TYPES:
                data = np.array(tensor.data[span], dtype=np.uint8)
                blocks[name] = (kind, data if heads is None else np.ascontiguousarray(unpermute_qk_rows(data, heads)))
            elif keep_blocks and kind not in FLOAT_TYPES and int(tensor.shape[0]) % 32 == 0:
                blocks[name] = ("Q8_0", to_q8_0_blocks(_dense(tensor, span, heads)))
                requantised[kind] = requantised.get(kind, 0) + 1
            else:
                loaders[name] = functools.partial(_dense, tensor, span, heads)
    for kind, count in requantised.items():
        print(f"{kind}: no kernel reads these blocks; {count} tensors requantised to Q8_0 at load", file=sys.stderr)
    return LazyWeights(loaders), blocks


def _dense(tensor: Any, rows: slice, heads: int | None) -> np.ndarray:
    array = dequantize_tensor(tensor)[rows]
    return np.ascontiguousarray(array if heads is None else unpermute_qk_rows(array, heads))
