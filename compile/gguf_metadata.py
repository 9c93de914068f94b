"""A GGUF file's metadata key/values (and tensor directory) read straight from a read-only memory map, or refused
with one sentence.

``read_metadata(path)`` parses the header and key/value section of a little-endian GGUF v2/v3 file (magic ``GGUF``,
u32 version, u64 tensor count, u64 key/value count, then per key: u64 length + UTF-8 name, u32 value type, value;
a string is a u64 length + UTF-8 bytes; an array is a u32 element type + u64 count + elements) into Python values:
``str``, ``int``, ``float``, ``bool`` or a flat list of one of them, in file order. It gives what gguf-py's
``GGUFReader`` fields' ``contents()`` give (float32 values as the Python float of the same value), without building
a numpy view per element: a numeric array is one ``np.frombuffer``, a string array one loop over the strings. No
tensor information or data is read; ``read_gguf(path)`` also reads the tensor directory (what gguf-py's
``GGUFReader`` gives: ``fields`` as values, ``tensors`` over a memory map). ValueError (naming the file, the byte
offset and the key) for a truncated file, a bad magic or version, a big-endian file, an unknown or nested value
type, a length past the end of the file, a bool that is not 0 or 1, invalid UTF-8 or a duplicate key.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY, _BOOL = 8, 9, 7
#: GGUF value type -> (struct format, numpy dtype) of the fixed-size types (GGUF's ``GGUFValueType``)
_FIXED: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), _BOOL: ("<B", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
#: the fewest bytes one key/value takes: an empty name's length, the value type and a one-byte value
_MIN_KV_BYTES = 8 + 4 + 1


class _Reader:
    """A cursor over the mapped file that refuses, naming the file, offset and key, anything it cannot read."""

    def __init__(self, data: mmap.mmap | bytes, name: str) -> None:
        self.data = data
        self.size = len(data)
        self.name = name
        self.offset = 0
        self.key = "the header"

    def fail(self, what: str, offset: int | None = None) -> ValueError:
        at = self.offset if offset is None else offset
        return ValueError(f"{self.name}: {what} at byte offset {at} (reading {self.key}); refusing the file")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.offset:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.offset} remain (truncated or "
                            "malformed file)")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.data, self.offset)
        self.offset += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.data, self.offset)
        self.offset += 8
        return value

    def string(self, what: str) -> str:
        start = self.offset
        length = self.u64(f"the length of {what}")
        self.need(length, f"{what} ({length} bytes)")
        raw = self.data[self.offset:self.offset + length]
        try:
            text = str(raw, "utf-8")
        except UnicodeDecodeError as err:
            raise self.fail(f"{what} is not valid UTF-8 ({err.reason} at byte {err.start})", start) from None
        self.offset += length
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string("a string value")
        if kind == _ARRAY:
            return self.array()
        if kind not in _FIXED:
            raise self.fail(f"unknown value type {kind}", self.offset - 4)
        fmt, _ = _FIXED[kind]
        self.need(struct.calcsize(fmt), f"a value of type {kind}")
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        if kind == _BOOL:
            if value > 1:
                raise self.fail(f"a bool value is {value}, not 0 or 1")
            value = bool(value)
        self.offset += struct.calcsize(fmt)
        return value

    def array(self) -> list[Any]:
        type_at = self.offset
        kind = self.u32("an array's element type")
        count = self.u64("an array's length")
        if kind == _ARRAY:
            raise self.fail("a nested array (array of arrays) is not supported", type_at)
        if kind == _STRING:
            self.need(count * 8, f"an array of {count} strings")  # each at least its 8-byte length
            data, u64, size, offset = self.data, _U64.unpack_from, self.size, self.offset
            out: list[str] = []
            append = out.append
            for index in range(count):
                if offset + 8 > size:
                    self.offset = offset
                    raise self.fail(f"string {index} of {count} needs 8 bytes for its length but the file ends")
                (length,) = u64(data, offset)
                end = offset + 8 + length
                if end > size:
                    self.offset = offset
                    raise self.fail(f"string {index} of {count} ({length} bytes) runs past the end of the file "
                                    f"({size} bytes)")
                try:
                    append(str(data[offset + 8:end], "utf-8"))
                except UnicodeDecodeError as err:
                    self.offset = offset
                    raise self.fail(f"string {index} of {count} is not valid UTF-8 ({err.reason} at byte "
                                    f"{err.start})") from None
                offset = end
            self.offset = offset
            return out
        if kind not in _FIXED:
            raise self.fail(f"unknown array element type {kind}", type_at)
        dtype = np.dtype(_FIXED[kind][1])
        self.need(count * dtype.itemsize, f"an array of {count} values of type {kind}")
        values = np.frombuffer(self.data[self.offset:self.offset + count * dtype.itemsize], dtype=dtype)
        if kind == _BOOL:
            if count and int(values.max()) > 1:
                raise self.fail("an array of bools holds a value that is not 0 or 1")
            values = values.astype(bool)
        self.offset += count * dtype.itemsize
        return values.tolist()


def _key_values(reader: _Reader) -> tuple[int, dict[str, Any]]:
    """The tensor count and the key/values, reading from the start of the file."""
    data = reader.data
    reader.need(4, "the magic")
    magic = bytes(data[0:4])
    if magic != _MAGIC:
        raise reader.fail(f"the magic is {magic!r}, not {_MAGIC!r}: not a GGUF file")
    reader.offset = 4
    version = reader.u32("the version")
    if version not in _VERSIONS and version & 0xFFFF == 0 and (version >> 24) in _VERSIONS:
        raise reader.fail(f"the version field reads {version:#x}: a big-endian GGUF, which is not supported", 4)
    if version not in _VERSIONS:
        raise reader.fail(f"GGUF version {version} is not supported (supported: {list(_VERSIONS)})", 4)
    tensor_count = reader.u64("the tensor count")
    count_at = reader.offset
    kv_count = reader.u64("the key/value count")
    if kv_count * _MIN_KV_BYTES > reader.size - reader.offset:
        raise reader.fail(f"the key/value count {kv_count} cannot fit in the {reader.size - reader.offset} bytes "
                          "left", count_at)
    out: dict[str, Any] = {}
    for index in range(kv_count):
        reader.key = f"key {index} of {kv_count}"
        key_at = reader.offset
        key = reader.string("a key name")
        reader.key = f"key {key!r}"
        if key in out:
            raise reader.fail(f"key {key!r} appears twice", key_at)
        kind = reader.u32("the value type")
        out[key] = reader.value(kind)
    return tensor_count, out


def parse_metadata(data: mmap.mmap | bytes, name: str = "GGUF") -> dict[str, Any]:
    """The metadata key/values of the GGUF bytes ``data`` (a file's contents or memory map) as Python values, in
    file order; ``name`` starts every error. See the module doc for what is refused."""
    return _key_values(_Reader(data, name))[1]


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata key/value of the GGUF file ``path`` (see ``parse_metadata``), read from a read-only memory map;
    no tensor is read."""
    path = Path(path)
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return parse_metadata(b"", path.name)  # refused: an empty file cannot be mapped
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return parse_metadata(data, path.name)


class TensorInfo(NamedTuple):
    """One tensor of a GGUF file, with the fields of gguf-py's ``ReaderTensor`` that describe it: ``shape`` in GGUF
    order (innermost first, uint64), ``data`` a read-only view of the file (float and integer types as their numpy
    type in ``[out, in]`` order, quantised types as uint8 rows of blocks)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


#: GGML types read as their own numpy type (every other type as uint8 blocks), as gguf-py reads them
_NUMPY_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}
#: at most this many dimensions per tensor (ggml's GGML_MAX_DIMS)
_MAX_DIMS = 4


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[TensorInfo]]:
    """The metadata key/values (``read_metadata``) and the tensors of the GGUF file ``path``, the tensors' data
    memory-mapped (read-only; the map lives as long as a tensor's ``data``), in file order: what gguf-py's
    ``GGUFReader`` gives (``fields`` as values, ``tensors``) for about 1% of its CPU time. ValueError (naming the
    file, offset and key or tensor) for what ``read_metadata`` refuses, an unknown tensor type, more than 4
    dimensions, a duplicate tensor name, a row that is not whole blocks, a bad ``general.alignment``, or a
    tensor's data past the end of the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    data = np.memmap(path, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    reader = _Reader(memoryview(data).cast("B") if data.size else b"", path.name)
    tensor_count, meta = _key_values(reader)
    if tensor_count * (8 + 4 + 4 + 8) > reader.size - reader.offset:
        raise reader.fail(f"the tensor count {tensor_count} cannot fit in the {reader.size - reader.offset} bytes left")
    alignment = meta.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise reader.fail(f"general.alignment {alignment!r} is not a power of two", 0)
    infos: list[tuple[str, Any, list[int], int]] = []
    for index in range(tensor_count):
        reader.key = f"tensor {index} of {tensor_count}"
        name = reader.string("a tensor name")
        reader.key = f"tensor {name!r}"
        dims_at = reader.offset
        n_dims = reader.u32("the dimension count")
        if n_dims > _MAX_DIMS:
            raise reader.fail(f"{n_dims} dimensions (at most {_MAX_DIMS})", dims_at)
        reader.need(8 * n_dims, "the dimensions")
        dims = list(struct.unpack_from(f"<{n_dims}Q", reader.data, reader.offset))
        reader.offset += 8 * n_dims
        type_at = reader.offset
        raw_type = reader.u32("the tensor type")
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise reader.fail(f"unknown tensor type {raw_type}", type_at) from None
        infos.append((name, kind, dims, reader.u64("the data offset")))
    start = reader.offset + (-reader.offset) % alignment
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, kind, dims, offset in infos:
        reader.key = f"tensor {name!r}"
        if name in seen:
            raise reader.fail(f"tensor {name!r} appears twice")
        seen.add(name)
        n_elements = int(np.prod(dims, dtype=object)) if dims else 1
        block, block_bytes = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))
        if kind.name in _NUMPY_TYPES:
            dtype, count = np.dtype(_NUMPY_TYPES[kind.name]), n_elements
        else:
            if shape and shape[-1] % block:
                raise reader.fail(f"a row of {shape[-1]} {kind.name} values is not whole blocks of {block}")
            dtype, count = np.dtype(np.uint8), n_elements // block * block_bytes
            shape = (*shape[:-1], shape[-1] // block * block_bytes) if shape else shape
        n_bytes = n_elements * block_bytes // block
        at = start + offset
        if at + count * dtype.itemsize > reader.size:
            raise reader.fail(f"the data ({n_bytes} bytes at {at}) runs past the end of the file ({reader.size} "
                              "bytes)", at)
        view = data[at:at + count * dtype.itemsize].view(dtype).reshape(shape)
        tensors.append(TensorInfo(name, kind, np.array(dims, dtype=np.uint64), n_elements, n_bytes, at, view))
    return meta, tensors
