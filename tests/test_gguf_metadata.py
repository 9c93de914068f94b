"""Reading a GGUF's metadata (``gguf_metadata.read_metadata``): the values gguf-py's ``GGUFReader`` gives, for every
value type and for real vocabularies, in a fraction of its CPU time; malformed and hostile files refused by name."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
from logitproc.compile.gguf_metadata import parse_metadata, read_gguf, read_metadata
from logitproc.compile.gguf_tokenizer import read_gguf_metadata
from material import llama_cpp_models


def _gguf_py(path) -> dict:
    """What gguf-py gives: every field's ``contents()`` but its ``GGUF.*`` pseudo-fields."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _same(a, b) -> bool:
    """Equal values of the same Python types (``True == 1`` is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        assert _same(got[key], want[key]), key


def _every_type_file(path) -> None:
    """A GGUF written by gguf-py with every scalar and array value type, awkward values and an empty array."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 255)
    writer.add_int8("t.i8", -128)
    writer.add_uint16("t.u16", 65535)
    writer.add_int16("t.i16", -32768)
    writer.add_uint32("t.u32", 2**32 - 1)
    writer.add_int32("t.i32", -(2**31))
    writer.add_float32("t.f32", 0.1)  # not exact in float32: read as the Python float of the float32 value
    writer.add_uint64("t.u64", 2**64 - 1)
    writer.add_int64("t.i64", -(2**63))
    writer.add_float64("t.f64", -1e300)
    writer.add_bool("t.true", True)
    writer.add_bool("t.false", False)
    writer.add_string("t.str", "héllo ▁ 🙂 <|im_end|>")
    writer.add_string("t.empty", "")
    writer.add_array("t.strings", ["a", "", "Ġthe", "▁", "🙂", "x" * 1000])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25, 1e-3])
    writer.add_array("t.bools", [True, False, True])
    writer.add_token_types([1, 3, 6, 2])  # INT32 array
    writer.add_token_scores([-1.5, 0.0, float("inf")])  # FLOAT32 array
    writer.add_tensor("w", np.arange(8, dtype=np.float32))
    writer.add_tensor("half", np.arange(64, dtype=np.float16).reshape(2, 32))
    q8 = np.arange(3 * 2 * 34, dtype=np.uint8).reshape(3, 68)  # 3 rows of two Q8_0 blocks (64 values)
    writer.add_tensor("quan", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("ids", np.arange(5, dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_value_type_reads_as_gguf_py_reads_it(tmp_path) -> None:
    path = tmp_path / "every.gguf"
    _every_type_file(path)
    got = read_metadata(path)
    _assert_same(got, _gguf_py(path))
    assert got["t.f32"] == float(np.float32(0.1)) and got["t.true"] is True
    _assert_same(read_gguf_metadata(path), got)


def test_tensors_read_as_gguf_py_reads_them(tmp_path) -> None:
    """Float, integer and quantised tensors: the same names, types, shapes, offsets and data views as gguf-py's."""
    from gguf import GGUFReader

    path = tmp_path / "every.gguf"
    _every_type_file(path)
    meta, tensors = read_gguf(path)
    _assert_same(meta, _gguf_py(path))
    want = GGUFReader(path).tensors
    assert [t.name for t in tensors] == ["w", "half", "quan", "ids"] == [t.name for t in want]
    for got, ref in zip(tensors, want, strict=True):
        assert got.tensor_type == ref.tensor_type and got.shape.tolist() == ref.shape.tolist()
        assert (got.n_elements, got.n_bytes, got.data_offset) == (ref.n_elements, ref.n_bytes, ref.data_offset)
        assert got.data.dtype == ref.data.dtype and got.data.shape == ref.data.shape
        assert np.array_equal(got.data, ref.data) and not got.data.flags.writeable
    assert tensors[2].data.shape == (3, 68)


@pytest.mark.parametrize("damage, says", [
    (lambda b, at: b[:-16], "runs past the end of the file"),  # into the last tensor, not its padding
    (lambda b, at: b[:at["quan.type"]] + struct.pack("<I", 99) + b[at["quan.type"] + 4:], "unknown tensor type 99"),
    (lambda b, at: b[:at["quan.dims"]] + struct.pack("<I", 5) + b[at["quan.dims"] + 4:], "5 dimensions"),
    (lambda b, at: b[:at["half.name"]] + b"quan" + b[at["half.name"] + 4:], "tensor 'quan' appears twice"),
    (lambda b, at: b[:8] + struct.pack("<Q", 2**63) + b[16:], f"the tensor count {2**63} cannot fit"),
])
def test_damaged_tensor_directories_are_refused(tmp_path, damage, says: str) -> None:
    path = tmp_path / "every.gguf"
    _every_type_file(path)
    data = path.read_bytes()
    at = {}
    for name in ("half", "quan"):  # where each tensor's name, dimension count and type are
        key = _s(name.encode())
        at[f"{name}.name"] = data.index(key) + 8
        at[f"{name}.dims"] = data.index(key) + len(key)
    at["quan.type"] = at["quan.dims"] + 4 + 2 * 8
    path.write_bytes(damage(data, at))
    with pytest.raises(ValueError, match="^every.gguf: ") as err:
        read_gguf(path)
    assert says in str(err.value) and "byte offset" in str(err.value)


def test_empty_arrays_read_as_gguf_py_reads_them(tmp_path) -> None:
    """Empty arrays (gguf-py's writer leaves them out; a file may hold them) of strings, numbers and bools."""
    path = tmp_path / "empty.gguf"
    path.write_bytes(_header(3) + _kv(b"no.strings", 9, struct.pack("<IQ", 8, 0)) +
                     _kv(b"no.ints", 9, struct.pack("<IQ", 5, 0)) + _kv(b"no.bools", 9, struct.pack("<IQ", 7, 0)))
    got = read_metadata(path)
    assert got == {"no.strings": [], "no.ints": [], "no.bools": []}
    _assert_same(got, _gguf_py(path))


@pytest.mark.parametrize("name", ["llama-spm", "deepseek-coder"])
def test_real_vocabularies_read_as_gguf_py_reads_them(name: str) -> None:
    """SentencePiece (float scores) and byte-level BPE (merges) vocabularies of llama.cpp's test files."""
    path = llama_cpp_models() / f"ggml-vocab-{name}.gguf"
    _assert_same(read_metadata(path), _gguf_py(path))


def test_a_128k_vocabulary_reads_in_well_under_a_second_of_cpu() -> None:
    """gguf-py took 7.3 s of CPU for this file (AMD EPYC Zen 4, 2026-11-28); the memory-map parser about 0.09 s."""
    path = llama_cpp_models() / "ggml-vocab-llama-bpe.gguf"
    start = time.process_time()
    meta = read_metadata(path)
    spent = time.process_time() - start
    assert len(meta["tokenizer.ggml.tokens"]) == 128256 and len(meta["tokenizer.ggml.merges"]) > 200000
    assert spent < 1.0, f"{spent:.2f} s of CPU"


# --- malformed and hostile files, built byte by byte -----------------------------------------------------------------

def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _header(kv_count: int, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, 0, kv_count)


def _kv(key: bytes, kind: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", kind) + payload


def _refused(data: bytes, *says: str) -> str:
    with pytest.raises(ValueError) as err:
        parse_metadata(data, "hostile.gguf")
    message = str(err.value)
    assert message.startswith("hostile.gguf: ") and "byte offset" in message, message
    for part in says:
        assert part in message, message
    return message


def test_truncation_anywhere_in_the_key_values_is_refused_naming_file_and_offset(tmp_path) -> None:
    path = tmp_path / "every.gguf"
    _every_type_file(path)
    data = path.read_bytes()
    full = parse_metadata(data)
    end = next(n for n in range(len(data)) if _parses(data[:n]))  # where the key/value section ends
    assert parse_metadata(data[:end]) == full
    for n in range(end):  # every cut: in the header, a key, a type, a value, a string array, a numeric array
        with pytest.raises(ValueError, match=r"^cut\.gguf: .* at byte offset \d+ \(reading "):
            parse_metadata(data[:n], "cut.gguf")
    for n in (0, 3, 24, end // 2, end - 1):  # and from files, the empty one included
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match=rf"^cut{n}\.gguf: "):
            read_metadata(cut)


def _parses(data: bytes) -> bool:
    try:
        parse_metadata(data)
    except ValueError:
        return False
    return True


def test_bad_magic_version_and_byte_order_are_refused() -> None:
    body = _kv(b"a", 4, struct.pack("<I", 1))
    _refused(_header(1, magic=b"GGML") + body, "not a GGUF file")
    _refused(_header(1, version=1) + body, "version 1 is not supported")
    _refused(_header(1, version=4) + body, "version 4 is not supported")
    big = b"GGUF" + struct.pack(">IQQ", 3, 0, 1) + body
    _refused(big, "big-endian")


@pytest.mark.parametrize("kind, payload, says", [
    (13, b"\0" * 8, "unknown value type 13"),
    (2**32 - 1, b"\0" * 8, "unknown value type 4294967295"),
    (9, struct.pack("<IQ", 13, 1) + b"\0" * 8, "unknown array element type 13"),
    (9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1) + b"\0" * 4, "nested array"),
    (7, b"\x02", "not 0 or 1"),
    (9, struct.pack("<IQ", 7, 3) + b"\x00\x01\x05", "not 0 or 1"),
    (8, _s(b"\xff\xfe"), "not valid UTF-8"),
    (9, struct.pack("<IQ", 8, 2) + _s(b"ok") + _s(b"\xc3"), "string 1 of 2 is not valid UTF-8"),
])
def test_bad_values_are_refused_naming_the_key(kind: int, payload: bytes, says: str) -> None:
    _refused(_header(2) + _kv(b"good", 4, struct.pack("<I", 7)) + _kv(b"the.key", kind, payload),
             says, "'the.key'")


@pytest.mark.parametrize("body, says", [
    (_s(b"\xff") + struct.pack("<I", 4) + b"\0" * 4, "a key name is not valid UTF-8"),
    (_kv(b"k", 4, b"\0" * 4) + _kv(b"k", 4, b"\0" * 4), "key 'k' appears twice"),
])
def test_bad_keys_are_refused(body: bytes, says: str) -> None:
    _refused(_header(2) + body + b"\0" * 64, says)


@pytest.mark.parametrize("header_count, body, says", [
    (2**64 - 1, _kv(b"k", 4, b"\0" * 4), "key/value count 18446744073709551615 cannot fit"),
    (1, struct.pack("<Q", 2**63) + b"k" * 16, "needs 9223372036854775808 bytes"),
    (1, _kv(b"k", 8, struct.pack("<Q", 2**64 - 1) + b"abc"), "needs 18446744073709551615 bytes"),
    (1, _kv(b"k", 9, struct.pack("<IQ", 8, 2**60) + _s(b"a")), f"an array of {2**60} strings"),
    (1, _kv(b"k", 9, struct.pack("<IQ", 4, 2**62) + b"\0" * 16), f"an array of {2**62} values"),
    (1, _kv(b"k", 9, struct.pack("<IQ", 8, 2) + _s(b"a") + struct.pack("<Q", 2**63) + b"xy"),
     "string 1 of 2 (9223372036854775808 bytes) runs past the end"),
])
def test_absurd_lengths_are_refused_before_reading_or_allocating(header_count: int, body: bytes, says: str) -> None:
    start = time.process_time()
    _refused(_header(header_count) + body, says)
    assert time.process_time() - start < 0.5
