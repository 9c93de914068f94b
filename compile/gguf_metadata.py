"""A GGUF file's metadata key/values read straight from a read-only memory map, or refused with one sentence.

``read_metadata(path)`` parses the header and key/value section of a little-endian GGUF v2/v3 file (magic ``GGUF``,
u32 version, u64 tensor count, u64 key/value count, then per key: u64 length + UTF-8 name, u32 value type, value;
a string is a u64 length + UTF-8 bytes; an array is a u32 element type + u64 count + elements) into Python values:
``str``, ``int``, ``float``, ``bool`` or a flat list of one of them, in file order. It gives what gguf-py's
``GGUFReader`` fields' ``contents()`` give (float32 values as the Python float of the same value), without building
a numpy view per element: a numeric array is one ``np.frombuffer``, a string array one loop over the strings. No
tensor information or data is read. ValueError (naming the file, the byte offset and the key) for a truncated file,
a bad magic or version, a big-endian file, an unknown or nested value type, a length past the end of the file, a
bool that is not 0 or 1, invalid UTF-8 or a duplicate key.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

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
            text = raw.decode("utf-8")
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
                    append(data[offset + 8:end].decode("utf-8"))
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


def parse_metadata(data: mmap.mmap | bytes, name: str = "GGUF") -> dict[str, Any]:
    """The metadata key/values of the GGUF bytes ``data`` (a file's contents or memory map) as Python values, in
    file order; ``name`` starts every error. See the module doc for what is refused."""
    reader = _Reader(data, name)
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
    reader.u64("the tensor count")
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
    return out


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata key/value of the GGUF file ``path`` (see ``parse_metadata``), read from a read-only memory map;
    no tensor is read."""
    path = Path(path)
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return parse_metadata(b"", path.name)  # refused: an empty file cannot be mapped
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return parse_metadata(data, path.name)
