# fmt: off
"""The weight loader of the compiled model: a GGUF's (or a loaded model's) tensors, in the canonical layout of
``model_family``, as the parameters of ``relax_llama.LlamaModule``, by name (q/k/v and gate/up fused, quantised
blocks split).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator

import numpy as np

from .gguf_metadata import read_gguf
from .gguf_model import GGUFModel
from .gguf_tensors import LazyWeights, RawTensors, gguf_weights
from .linear_kernels import QUANTISED
from .model_config import LlamaConfig
from .packed_matvec import pack_q8_0
from .quant_formats import pack, unpack_gguf, widen
from .relax_llama import FORMAT_TYPES, GGUF_FORMATS, SPLIT, LlamaSpec, packed_layout


def read_gguf_tensors(path: str | os.PathLike[str], config: LlamaConfig, *,
                      keep_blocks: bool) -> tuple[LazyWeights, RawTensors]:
    """A GGUF's tensors (``gguf_tensors.gguf_weights``): weights read when looked up (float32), and (with
    ``keep_blocks``) the quantised tensors as raw blocks instead: name -> (type name, uint8 ``[rows, bytes]``)."""
    return gguf_weights(read_gguf(path)[1], config, keep_blocks=keep_blocks)


def split_blocks(ggml_type: str, data: np.ndarray) -> dict[str, np.ndarray]:
    """A GGUF Q8_0 / Q4_1 tensor's raw blocks (``[rows, bytes per row]`` uint8) as the kernels' arrays."""
    fmt = GGUF_FORMATS[ggml_type]
    size = 34 if fmt == "q8_0" else 20
    rows, blocks = data.shape[0], data.shape[1] // size
    in_features = blocks * 32
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, blocks, size)

    def halves(lo: int) -> np.ndarray:  # the float16 scales and mins
        return np.ascontiguousarray(raw[:, :, lo: lo + 2]).view(np.float16).reshape(rows, blocks)

    if fmt == "q8_0":
        return {"codes": np.ascontiguousarray(raw[:, :, 2:]).view(np.int8).reshape(rows, in_features),
                "scales": halves(0)}
    return {"codes": np.ascontiguousarray(raw[:, :, 4:]).reshape(rows, in_features // 2), "scales": halves(0),
            "mins": halves(2)}


def dequantize_blocks(ggml_type: str, data: np.ndarray) -> np.ndarray:
    """Raw GGUF blocks as float32 ``[rows, in]`` (what ``load_gguf`` gives for the tensor)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.ascontiguousarray(dequantize(data, GGMLQuantizationType[ggml_type]), dtype=np.float32)


def iter_relax_weights(model: GGUFModel, spec: LlamaSpec,
                       raw: RawTensors | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """The module's parameters, one at a time, from the model's weights: q/k/v and gate/up fused, float kinds cast,
    quantised kinds taken from ``raw`` (the GGUF's blocks, bit for bit). Each weight is looked up once, so with
    ``LazyWeights`` only the tensors of one parameter are in memory at a time (float32, then the stored type)."""
    w = model.weights

    def blocks(fmt: str, names: list[str], packed: bool) -> dict[str, np.ndarray]:
        """The parts' GGUF blocks in ``fmt``'s type (widened exactly, or requantised: ``relax_llama``'s choice),
        rows joined, as the kernel's arrays (``quant_formats`` layouts packed; Q8_0 / unpacked Q4_1 split)."""
        target = FORMAT_TYPES[fmt]
        for name in names:
            if raw is None or name not in raw:
                raise ValueError(f"{name} is stored as {fmt} but its GGUF blocks are not given")
        assert raw is not None
        data = np.concatenate([widen(*raw[name], target) for name in names])
        layout = packed_layout(fmt, packed)
        if layout:
            return pack(layout, unpack_gguf(layout, data))
        return split_blocks(target, data)

    def arrays(kind: str, names: list[str], layer: int | None, fmt: str) -> dict[str, np.ndarray]:
        packed = spec.packed(kind, layer, fmt)
        if packed_layout(fmt, packed):
            return blocks(fmt, names, packed)
        if fmt in QUANTISED and raw is not None and len({raw[n][0] for n in names if n in raw}) > 1:
            joined = blocks(fmt, names, packed)  # parts of different types, widened to one (Q8_0)
            return pack_q8_0(**joined) if packed else joined
        parts: list[dict[str, np.ndarray]] = []
        for name in names:
            if fmt in QUANTISED:
                if raw is None or name not in raw:
                    raise ValueError(f"{kind} is stored as {fmt} but the GGUF blocks of {name} are not given")
                part = split_blocks(*raw[name])
            elif name in w:
                part = {"weight": np.asarray(w[name], dtype=fmt)}
            elif raw is not None and name in raw:  # kept as blocks by the loader, needed dense here
                part = {"weight": dequantize_blocks(*raw[name]).astype(fmt)}
            else:
                raise ValueError(f"the model has no weight {name}")
            parts.append(part)
        joined = {k: np.ascontiguousarray(np.concatenate([p[k] for p in parts])) for k in parts[0]}
        return pack_q8_0(**joined) if packed else joined

    def put(prefix: str, kind: str, names: list[str], layer: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
        fmt = spec.fmt(kind, layer)
        if SPLIT in fmt:  # each part in its own format (``relax_llama._SplitWeights``)
            for j, (name, part_fmt) in enumerate(zip(names, fmt.split(SPLIT), strict=True)):
                for suffix, array in arrays(kind, [name], layer, part_fmt).items():
                    yield f"{prefix}.parts.{j}.{suffix}", array
            return
        for suffix, array in arrays(kind, names, layer, fmt).items():
            yield f"{prefix}.{suffix}", array

    def vector(name: str) -> np.ndarray:
        return np.asarray(w[name], dtype=np.float32)

    yield "norm.weight", vector("output_norm.weight")
    yield from put("embed_tokens", "embed", ["token_embd.weight"])
    if not spec.tied_embeddings:
        yield from put("lm_head.w", "lm_head", ["output.weight"])
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        yield from put(f"layers.{i}.attn.qkv.w", "qkv",
                       [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], i)
        if spec.qkv_bias:
            yield f"layers.{i}.attn.qkv.bias", np.concatenate([vector(p + f"attn_{x}.bias") for x in "qkv"])
        if spec.qk_norm:
            yield f"layers.{i}.attn.q_norm.weight", vector(p + "attn_q_norm.weight")
            yield f"layers.{i}.attn.k_norm.weight", vector(p + "attn_k_norm.weight")
        yield from put(f"layers.{i}.attn.o.w", "o", [p + "attn_output.weight"], i)
        yield from put(f"layers.{i}.mlp.gate_up.w", "gate_up", [p + "ffn_gate.weight", p + "ffn_up.weight"], i)
        yield from put(f"layers.{i}.mlp.down.w", "down", [p + "ffn_down.weight"], i)
        yield f"layers.{i}.attn_norm.weight", vector(p + "attn_norm.weight")
        yield f"layers.{i}.ffn_norm.weight", vector(p + "ffn_norm.weight")
        if spec.sandwich_norms:
            yield f"layers.{i}.post_attn_norm.weight", vector(p + "post_attention_norm.weight")
            yield f"layers.{i}.post_ffn_norm.weight", vector(p + "post_ffw_norm.weight")


def relax_weights(model: GGUFModel, spec: LlamaSpec, raw: RawTensors | None = None) -> dict[str, np.ndarray]:
    """Every parameter of ``iter_relax_weights`` at once, by name."""
    return dict(iter_relax_weights(model, spec, raw))


def save_params(path: str | os.PathLike[str], params: Iterator[tuple[str, np.ndarray]], names: list[str]) -> int:
    """Write ``params`` (only those in ``names``, each exactly once) as an uncompressed ``.npz`` as ``np.savez``
    writes it, one array at a time (none is kept); the bytes written. Raises ValueError naming missing ones."""
    wanted, written, size = set(names), set(), 0
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in params:
            if name not in wanted:
                continue
            with archive.open(f"{name}.npy", "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.ascontiguousarray(array), allow_pickle=False)
            written.add(name)
            size += array.nbytes
    missing = sorted(wanted - written)
    if missing:
        raise ValueError(f"no weights for parameters {missing[:5]}")
    return size
