"""The GGUF block types that ``quant_matvec`` reads (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS):
blocks unpacked into integer codes and scales, repacked 8 rows to a vector, and dequantised (numpy) exactly as gguf-py
does.

Every one of these types stores weight ``k`` of row ``o`` as ``W[o, k] = S * (q - off) + M`` with an integer code
``q`` of ``bits`` bits (IQ4: ``lut[i]``, one of 16 values plus 128, for a 4-bit index ``i``), a fixed offset ``off``
(Q4_0 8, Q5_0 16, Q6_K 32, IQ4 128, else 0) and, per sub-block of 32 weights
(Q6_K: of 16), a float32 scale ``S`` and min ``M`` (0 for types without one) that are exact products of the
stored numbers: ``S = d`` (Q4_0, Q4_1, Q5_0, Q5_1: the block's float16 scale) or ``S = d * sc`` (K-quants: the
256-weight super-block's float16 ``d`` times the sub-block's 6-bit (Q6_K: signed 8-bit) scale), ``M = m`` (Q4_1's and
Q5_1's float16 min) or ``M = -(dmin * mq)`` (Q4_K, Q5_K). gguf-py's ``dequantize`` computes the same float32
operations, so ``dequantize_packed`` equals it bit for bit.

The packed layout (``pack``; arrays by suffix, rows in groups of 8, the last group padded with zero rows, ``b`` the
block of 32 weights), given here per group ``g`` as ``[g, b, n]``; in memory the groups go in pairs, interleaved
(``PAIRED``): each array is ``[g // 2, b, 2 n]``, and each run of ``c`` elements that one 8-row vector reads (32
bytes of ``codes`` and ``high``, the 8 rows' value elsewhere) is followed by the same run of group ``g + 1``. So a
pair of groups is one stream, and a tile on both groups reads each vector of 16 rows in one load (the last group is
padded with a zero group where the count is odd):

* ``codes[g, b, 128]`` uint8: the codes' low 4 bits: byte ``32 v + 4 r + j`` of the block holds weight
  ``8 v + j`` of row ``8 g + r`` in its low nibble and ``8 v + 4 + j`` in its high nibble (nibble plane
  ``p = 2 v + half``);
* ``high[g, b, 32 h]`` uint8 (``h = bits - 4`` vectors, Q5: 1, Q6: 2): the codes' 5th (and 6th) bits. Q5: bit ``p``
  of byte ``c`` is bit 4 of the code whose low bits are at position ``c`` of nibble plane ``p``; Q6: bits
  ``2 k, 2 k + 1`` of byte ``32 u + c`` are bits 4 and 5 of that code of plane ``p = 4 u + k`` (so that one
  shift and one mask put a plane's two bits in place: ``quant_matvec._codes``);
* ``d[g, b, 8]`` float16 (Q4_0, Q4_1, Q5_0, Q5_1) or ``d[g, b // 8, 8]`` (K-quants): the rows' scales;
* ``sc[g, b, 8]`` uint8 (Q4_K, Q5_K), int8 (IQ4_XS: ``ls - 32``) or ``sc[g, b, 16]`` int8 (Q6_K: ``[half, row]``): the
  sub-block scales;
* ``m[g, b, 8]`` float16 (Q4_1, Q5_1) or ``dmin[g, b // 8, 8]`` float16 and ``mq[g, b, 8]`` uint8 (Q4_K, Q5_K): mins;
* ``lut[32]`` uint8 (IQ4): the 16 values plus 128, twice.

Sizes against the GGUF (bytes per 256 weights): Q4_0 144 (GGUF 144), Q4_1 160 (160), Q5_0 176 (176), Q5_1 192
(192), Q4_K 148 (144), Q5_K 180 (176), Q6_K 212 (210), IQ4_NL 144 (144), IQ4_XS 138 (136).

Q4_1 (``Q4_1``, Q5_1 without the high-bit plane) is not among ``LAYOUTS``: those formats are packed on every target
(they need AVX2), while a Q4_1 matrix is packed only on AVX2 targets (``relax_llama.LlamaSpec.packed``; elsewhere,
and for a Q4_1 embedding and its tied head, its GGUF blocks go to ``linear_kernels`` as they are).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROWS = 8
QBLOCK = 32
SUPER = 256
#: row groups stored interleaved (module doc)
PAIRED = 2
#: IQ4_NL / IQ4_XS's 16 weight values (GGML's ``kvalues_iq4nl``)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class QuantLayout:
    """One GGUF block type as the packed kernels read it (module doc)."""

    ggml: str        #: the GGML type name ("Q4_K")
    fmt: str         #: the weight format's name in the model spec ("q4_k")
    bits: int        #: code bits: 4, 5 or 6
    offset: int      #: subtracted from each code
    superblock: bool  #: ``d`` per 256 weights times an integer sub-block scale ``sc``
    halves: int      #: scales per block of 32: 1, or 2 (Q6_K's sub-blocks of 16)
    min: str         #: "none", "block" (float16 ``m`` per block) or "super" (``dmin`` per 256 times ``mq``)
    block_bytes: int  #: GGUF bytes per block
    block_weights: int  #: weights per GGUF block
    sc_dtype: str = "uint8"  #: the sub-block scales' type (signed for Q6_K and IQ4_XS)
    #: a non-linear type's 16 values (IQ4): a weight's 4-bit code indexes them (``lut``, plus ``offset`` 128)
    codebook: tuple[int, ...] = ()

    @property
    def high_planes(self) -> int:
        return self.bits - 4

    def group_shapes(self, out_features: int, in_features: int) -> list[tuple[str, tuple[int, ...], str]]:
        """(suffix, shape, dtype) of the packed arrays of an ``[out, in]`` weight per row group (``[groups, ...]``,
        the module doc's indexing), in the kernels' parameter order."""
        check_shape(self, out_features, in_features)
        groups, blocks = -(-out_features // ROWS), in_features // QBLOCK
        supers = blocks // 8 if self.superblock else blocks
        out = [("codes", (groups, blocks, 4 * QBLOCK), "uint8")]
        if self.high_planes:
            out.append(("high", (groups, blocks, QBLOCK * self.high_planes), "uint8"))
        out.append(("d", (groups, supers, ROWS), "float16"))
        if self.superblock:
            out.append(("sc", (groups, blocks, ROWS * self.halves), self.sc_dtype))
        if self.min == "block":
            out.append(("m", (groups, blocks, ROWS), "float16"))
        elif self.min == "super":
            out += [("dmin", (groups, supers, ROWS), "float16"), ("mq", (groups, blocks, ROWS), "uint8")]
        if self.codebook:
            out.append(("lut", (2 * len(self.codebook),), "uint8"))
        return out

    def shapes(self, out_features: int, in_features: int) -> list[tuple[str, tuple[int, ...], str]]:
        """(suffix, shape, dtype) of the packed arrays as stored (``[pairs, ..., 2 n]``: module doc), in the
        kernels' parameter order."""
        return [(suffix, _paired_shape(shape) if suffix != "lut" else shape, dtype)
                for suffix, shape, dtype in self.group_shapes(out_features, in_features)]


def _paired_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A per-group array's shape ``[groups, outer, n]`` as stored: ``[ceil(groups / 2), outer, 2 n]``."""
    return (-(-shape[0] // PAIRED), shape[1], PAIRED * shape[2])


def run_length(suffix: str) -> int:
    """Elements of array ``suffix`` that one 8-row vector reads, the unit of the pairs' interleave (module doc)."""
    return QBLOCK if suffix in ("codes", "high") else ROWS


def interleave(suffix: str, a: np.ndarray) -> np.ndarray:
    """A per-group array ``[groups, outer, n]`` as stored (module doc): groups in pairs, runs interleaved."""
    groups, outer, n = a.shape
    c = run_length(suffix)
    a = np.pad(a, ((0, -groups % PAIRED), (0, 0), (0, 0)))
    return np.ascontiguousarray(a.reshape(-1, PAIRED, outer, n // c, c).transpose(0, 2, 3, 1, 4)
                                .reshape(-1, outer, PAIRED * n))


def deinterleave(suffix: str, a: np.ndarray) -> np.ndarray:
    """``interleave``'s inverse: ``[groups, outer, n]`` (with the odd count's zero group, if any)."""
    pairs, outer, n2 = a.shape
    c, n = run_length(suffix), n2 // PAIRED
    return np.ascontiguousarray(a.reshape(pairs, outer, n // c, PAIRED, c).transpose(0, 3, 1, 2, 4)
                                .reshape(pairs * PAIRED, outer, n))


LAYOUTS: dict[str, QuantLayout] = {layout.ggml: layout for layout in (
    QuantLayout("Q4_0", "q4_0", 4, 8, False, 1, "none", 18, 32),
    QuantLayout("Q5_0", "q5_0", 5, 16, False, 1, "none", 22, 32),
    QuantLayout("Q5_1", "q5_1", 5, 0, False, 1, "block", 24, 32),
    QuantLayout("Q4_K", "q4_k", 4, 0, True, 1, "super", 144, 256),
    QuantLayout("Q5_K", "q5_k", 5, 0, True, 1, "super", 176, 256),
    QuantLayout("Q6_K", "q6_k", 6, 32, True, 2, "none", 210, 256, "int8"),
    QuantLayout("IQ4_NL", "iq4_nl", 4, 128, False, 1, "none", 18, 32, codebook=IQ4_VALUES),
    QuantLayout("IQ4_XS", "iq4_xs", 4, 128, True, 1, "none", 136, 256, "int8", codebook=IQ4_VALUES),
)}
#: the weight formats of these layouts, by name
BY_FORMAT: dict[str, QuantLayout] = {layout.fmt: layout for layout in LAYOUTS.values()}
#: Q4_1's layout: packed for ``quant_matvec`` on AVX2 targets only (module doc)
Q4_1 = QuantLayout("Q4_1", "q4_1", 4, 0, False, 1, "block", 20, 32)


def check_shape(layout: QuantLayout, out_features: int, in_features: int) -> None:
    """Raise ValueError unless an ``[out, in]`` weight can be stored in ``layout``."""
    if out_features <= 0 or in_features <= 0 or in_features % layout.block_weights:
        raise ValueError(f"{layout.ggml} weights need in_features a positive multiple of {layout.block_weights}, "
                         f"got [{out_features}, {in_features}]")


def _halves16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at: at + 2]).view(np.float16)[..., 0]


def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """A GGML 32-weight block's 16 nibble bytes ``[..., 16]`` -> codes ``[..., 32]`` (low nibbles first)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins ``[..., 12]`` -> ``sc``, ``mq`` ``[..., 8]`` (uint8)."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 2) & 48)], axis=-1)
    mq = np.concatenate([b & 63, (c >> 4) | ((b >> 2) & 48)], axis=-1)
    return sc, mq


def unpack_gguf(layout: QuantLayout, raw: np.ndarray) -> dict[str, np.ndarray]:
    """A tensor's GGUF blocks (uint8 ``[rows, bytes per row]``) as integer codes ``codes[rows, K]`` (uint8) and
    per-row scale arrays (``d``, ``sc``, ``m``, ``dmin``, ``mq`` as the layout has them, ``[rows, per row]``)."""
    rows = raw.shape[0]
    if raw.shape[1] % layout.block_bytes:
        raise ValueError(f"{layout.ggml} rows are whole blocks of {layout.block_bytes} bytes, got {raw.shape[1]}")
    blk = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, layout.block_bytes)
    out: dict[str, np.ndarray] = {}
    if layout.ggml == "IQ4_NL":
        out["d"], out["codes"] = _halves16(blk, 0), _nibbles_split(blk[..., 2:]).reshape(rows, -1)
        return out
    if layout.ggml == "IQ4_XS":  # d, scales_h (uint16), scales_l[4], qs[128]: 8 sub-blocks of 16 nibble bytes
        out["d"] = _halves16(blk, 0)
        high = np.ascontiguousarray(blk[..., 2:4]).view("<u2")  # [rows, blocks, 1]
        low = blk[..., 4:8]
        low = np.stack([low & 15, low >> 4], axis=-1).reshape(rows, -1, 8)
        high = ((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
        out["sc"] = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, -1)
        out["codes"] = _nibbles_split(blk[..., 8:].reshape(rows, -1, 8, 16)).reshape(rows, -1)
        return out
    if layout.ggml in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        out["d"] = _halves16(blk, 0)
        at = 2
        if layout.min == "block":
            out["m"] = _halves16(blk, 2)
            at = 4
        codes = _nibbles_split(blk[..., -16:])
        if layout.bits == 5:
            qh = np.ascontiguousarray(blk[..., at: at + 4]).view("<u4")  # [rows, blocks, 1]
            codes = codes | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
        out["codes"] = codes.reshape(rows, -1)
        return out
    if layout.ggml in ("Q4_K", "Q5_K"):
        out["d"], out["dmin"] = _halves16(blk, 0), _halves16(blk, 2)
        sc, mq = _k_scales(blk[..., 4:16])
        out["sc"], out["mq"] = sc.reshape(rows, -1), mq.reshape(rows, -1)
        qs = blk[..., -128:].reshape(rows, -1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
        codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 8, 32)
        if layout.bits == 5:
            qh = blk[..., 16:48]  # bit i of byte j: sub-block i, weight j
            codes = codes | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        out["codes"] = codes.reshape(rows, -1)
        return out
    # Q6_K: ql[128], qh[64], scales[16] int8, d
    ql = blk[..., 0:128].reshape(rows, -1, 2, 1, 64)
    ql = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(rows, -1, 2, 4, 32)   # [half, quarter, 32]
    qh = blk[..., 128:192].reshape(rows, -1, 2, 1, 32)
    qh = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3                      # [half, quarter, 32]
    out["codes"] = (ql | (qh << 4)).reshape(rows, -1)
    out["sc"] = np.ascontiguousarray(blk[..., 192:208]).view(np.int8).reshape(rows, -1)
    out["d"] = _halves16(blk, 208)
    return out


def dequantize_unpacked(layout: QuantLayout, parts: dict[str, np.ndarray]) -> np.ndarray:
    """``S * (q - off) + M`` (module doc) in float32, ``[rows, K]``: gguf-py's ``dequantize`` bit for bit."""
    codes = parts["codes"]
    rows, k = codes.shape
    per = QBLOCK // layout.halves  # weights per scale
    d = parts["d"].astype(np.float32)
    if layout.superblock:
        s = np.repeat(d, SUPER // per, axis=1) * parts["sc"].astype(np.float32)
    else:
        s = d
    q = np.asarray(layout.codebook, np.int16)[codes] + layout.offset if layout.codebook else codes
    w = np.repeat(s, per, axis=1) * (q.astype(np.float32) - np.float32(layout.offset))
    if layout.min == "block":
        w = w + np.repeat(parts["m"].astype(np.float32), QBLOCK, axis=1)
    elif layout.min == "super":
        dm = np.repeat(parts["dmin"].astype(np.float32), 8, axis=1) * parts["mq"].astype(np.float32)
        w = w - np.repeat(dm, QBLOCK, axis=1)
    return w.reshape(rows, k)


def _rows(a: np.ndarray, pad: int) -> np.ndarray:
    """Per-row ``[N, n]`` -> ``[groups, n, 8]`` (rows padded with zeros)."""
    a = np.pad(a, ((0, pad), (0, 0)))
    return np.ascontiguousarray(a.reshape(-1, ROWS, a.shape[1]).transpose(0, 2, 1))


def pack(layout: QuantLayout, parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``unpack_gguf``'s arrays in the packed layout (module doc), in ``layout.shapes`` order."""
    codes = parts["codes"]
    n_out, n_in = codes.shape
    check_shape(layout, n_out, n_in)
    blocks, groups = n_in // QBLOCK, -(-n_out // ROWS)
    pad = groups * ROWS - n_out
    q = np.pad(codes, ((0, pad), (0, 0))).reshape(groups, ROWS, blocks, 4, 2, 4).transpose(0, 2, 3, 1, 4, 5)
    out = {"codes": np.ascontiguousarray(
        ((q[..., 0, :] & 15) | ((q[..., 1, :] & 15) << 4)).astype(np.uint8).reshape(groups, blocks, 4 * QBLOCK))}
    if layout.high_planes:
        planes = q.transpose(0, 1, 2, 4, 3, 5).reshape(groups, blocks, 8, QBLOCK)  # [g, b, p = 2 v + half, 4 r + j]
        if layout.high_planes == 1:
            weights = (np.uint8(1) << np.arange(8, dtype=np.uint8))[:, None]
            high = (((planes >> 4) & 1) * weights).sum(axis=2, dtype=np.uint8)
        else:  # [g, b, u, k, c]: bits 4-5 of plane 4 u + k at bits 2 k of byte 32 u + c
            pairs = ((planes >> 4) & 3).reshape(groups, blocks, 2, 4, QBLOCK)
            weights = (np.uint8(1) << (2 * np.arange(4, dtype=np.uint8)))[:, None]
            high = (pairs * weights).sum(axis=3, dtype=np.uint8).reshape(groups, blocks, 2 * QBLOCK)
        out["high"] = np.ascontiguousarray(high.astype(np.uint8))
    out["d"] = _rows(parts["d"], pad)
    if layout.superblock:
        sc = parts["sc"]
        if layout.halves == 2:  # [N, 2 b + h] -> [g, b, 8 h + r]
            sc = np.pad(sc, ((0, pad), (0, 0))).reshape(groups, ROWS, blocks, 2).transpose(0, 2, 3, 1)
            out["sc"] = np.ascontiguousarray(sc.reshape(groups, blocks, 2 * ROWS))
        else:
            out["sc"] = _rows(sc, pad)
    if layout.min == "block":
        out["m"] = _rows(parts["m"], pad)
    elif layout.min == "super":
        out["dmin"], out["mq"] = _rows(parts["dmin"], pad), _rows(parts["mq"], pad)
    out = {suffix: interleave(suffix, a) for suffix, a in out.items()}
    if layout.codebook:  # the 16 values plus the offset, twice (a table per 128-bit lane of ``vpshufb``)
        out["lut"] = np.tile(np.asarray(layout.codebook, np.int16) + layout.offset, 2).astype(np.uint8)
    return out


def unpack_packed(layout: QuantLayout, packed: dict[str, np.ndarray], out_features: int) -> dict[str, np.ndarray]:
    """The inverse of ``pack``: per-row arrays as ``unpack_gguf`` gives them (the padding rows dropped)."""
    packed = {suffix: deinterleave(suffix, a) if suffix != "lut" else a for suffix, a in packed.items()}
    groups, blocks = packed["codes"].shape[:2]
    raw = packed["codes"].reshape(groups, blocks, 4, ROWS, 4)                       # [g, b, v, r, j]
    q = np.stack([raw & 15, raw >> 4], axis=4)                                       # [g, b, v, r, half, j]
    for v in range(4):
        for half in range(2):
            p = 2 * v + half
            if layout.high_planes == 1:
                bits = packed["high"].reshape(groups, blocks, ROWS, 4)  # [g, b, r, j]
                q[:, :, v, :, half, :] |= ((bits >> p) & 1) << 4
            elif layout.high_planes == 2:
                bits = packed["high"][:, :, QBLOCK * (p // 4): QBLOCK * (p // 4 + 1)].reshape(groups, blocks, ROWS, 4)
                q[:, :, v, :, half, :] |= ((bits >> (2 * (p % 4))) & 3) << 4
    out = {"codes": q.transpose(0, 3, 1, 2, 4, 5).reshape(groups * ROWS, -1)[:out_features]}

    def rows(a: np.ndarray) -> np.ndarray:
        return a.transpose(0, 2, 1).reshape(groups * ROWS, -1)[:out_features]

    out["d"] = rows(packed["d"])
    if layout.superblock:
        sc = packed["sc"]
        if layout.halves == 2:
            sc = sc.reshape(groups, blocks, 2, ROWS).transpose(0, 3, 1, 2).reshape(groups * ROWS, -1)[:out_features]
            out["sc"] = sc
        else:
            out["sc"] = rows(sc)
    if layout.min == "block":
        out["m"] = rows(packed["m"])
    elif layout.min == "super":
        out["dmin"], out["mq"] = rows(packed["dmin"]), rows(packed["mq"])
    return out


def dequantize_packed(layout: QuantLayout, packed: dict[str, np.ndarray], out_features: int) -> np.ndarray:
    """The float32 ``[out, in]`` weight a packed layout holds (``dequantize_unpacked`` of ``unpack_packed``)."""
    return dequantize_unpacked(layout, unpack_packed(layout, packed, out_features))


# ---------------------------------------------------------------- conversions between GGUF types

#: exact widenings: a tensor of the key type is stored as the value type with the same weights
_WIDER = {"Q4_0": ("Q5_0", "Q8_0"), "Q5_0": ("Q8_0",), "Q5_1": (), "Q4_K": ("Q5_K",), "Q5_K": (), "Q6_K": (),
          "Q8_0": (), "Q4_1": ("Q5_1",), "IQ4_NL": (), "IQ4_XS": ()}


def common_type(types: set[str]) -> tuple[str, bool]:
    """The GGML type that the tensors of a fused weight (``types``, each with a kernel) are stored in together, and
    whether that is exact (every type widens to it without changing a weight); otherwise Q8_0, requantised."""
    if len(types) == 1:
        return next(iter(types)), True
    for target in ("Q5_0", "Q8_0", "Q5_1", "Q5_K"):
        if all(t == target or target in _WIDER.get(t, ()) for t in types):
            return target, True
    return "Q8_0", False


def to_q8_0_blocks(weights: np.ndarray) -> np.ndarray:
    """float32 ``[rows, K]`` quantised to GGUF Q8_0 blocks (gguf-py's quantiser) ``[rows, K / 32 * 34]``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return np.ascontiguousarray(quantize(np.ascontiguousarray(weights, np.float32), GGMLQuantizationType.Q8_0))


def widen(ggml_type: str, raw: np.ndarray, target: str) -> np.ndarray:
    """GGUF blocks of ``ggml_type`` as exactly the same weights in ``target``'s blocks (``common_type``'s exact
    widenings: Q4_0 -> Q5_0 / Q8_0, Q5_0 -> Q8_0, Q4_1 -> Q5_1, Q4_K -> Q5_K); any other pair is requantised
    through float32 to Q8_0."""
    if ggml_type == target:
        return raw
    if target not in _WIDER.get(ggml_type, ()):
        if target != "Q8_0":
            raise ValueError(f"{ggml_type} blocks cannot be stored as {target}")
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return to_q8_0_blocks(dequantize(raw, GGMLQuantizationType[ggml_type]))
    rows = raw.shape[0]
    if ggml_type == "Q4_1":  # d, m, qs -> d, m, qh = 0, qs
        blk = raw.reshape(rows, -1, 20)
        qh = np.zeros((*blk.shape[:2], 4), np.uint8)
        return np.concatenate([blk[..., :4], qh, blk[..., 4:]], axis=2).reshape(rows, -1)
    if ggml_type == "Q4_K":  # d, dmin, scales, qs -> d, dmin, scales, qh = 0, qs
        blk = raw.reshape(rows, -1, 144)
        qh = np.zeros((*blk.shape[:2], 32), np.uint8)
        return np.concatenate([blk[..., :16], qh, blk[..., 16:]], axis=2).reshape(rows, -1)
    src = LAYOUTS[ggml_type]
    parts = unpack_gguf(src, raw)
    signed = parts["codes"].astype(np.int16) - src.offset           # the weights' integer values, same scale d
    d = parts["d"].reshape(rows, -1, 1).view(np.uint8)               # [rows, blocks, 2]
    codes = signed.reshape(rows, -1, 32)
    if target == "Q8_0":
        body = codes.astype(np.int8).view(np.uint8)
    else:  # Q5_0: q + 16, the high bits into qh
        q = (codes + 16).astype(np.uint8)
        qh = np.packbits(q >> 4, axis=-1, bitorder="little")
        body = np.concatenate([qh, (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)], axis=-1)
    return np.ascontiguousarray(np.concatenate([d, body], axis=2).reshape(rows, -1))
