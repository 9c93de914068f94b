# fmt: off
"""The packed Q8_0 output head (AVX512-VNNI), and what every packed integer-dot matmul shares: activations quantised
to 8-bit blocks (or 16-bit codes as two int8 planes) once per call, results 8 rows to a vector.

Activations (``quantise_activations``; ``quant_matvec``'s kernels, the Q4_1 layer matrices among them, quantise them
the same way, with ``_quantise``): per token ``t`` and block ``b`` of 32, ``xd[t, b] = max_j |x[t, 32 b + j]| / 127``,
``xq[t, 32 b + j] = nearbyint(x[t, 32 b + j] / xd[t, b])`` (int8; 0 for an all-zero block; GGML's Q8_1) and
``xs[t, b] = xd[t, b] * sum_j xq[t, 32 b + j]``; with 16-bit codes (the default, ``SPLIT_QMAX`` for 127) each code
``q = 256 h + l`` is stored as two int8 planes ``h`` and ``l``.

Q8_0 (``pack_q8_0``): rows in groups of 8 (padded with zero rows to a whole pair of groups), byte ``32 v + 4 r + j``
of group ``g``'s ``codes[g, b]`` weight ``32 b + 4 v + j`` of row ``8 g + r`` plus 128, so that ``vpdpbusd``
(unsigned bytes times signed) takes whole bytes; the offset comes off as a min of ``-128 x scale``::

    y[t, o] = sum_b scales[g, b, r] * xd[t, b] * sum_j (q[o, 32 b + j] + 128) * xq[t, 32 b + j]
                    - 128 * scales[g, b, r] * xs[t, b]

In memory the groups go in pairs, interleaved as ``quant_formats``' layouts are (``quant_formats.interleave``):
``codes[g // 2, b]`` holds each vector's 32 bytes of group ``g`` then the same vector's of group ``g + 1``, and
``scales[g // 2, b]`` group ``g``'s 8 scales then ``g + 1``'s, so that a pair of groups is one stream and a tile on
both reads each 16-row vector in one load.

Per row group, token and block: 8 vectors of 32 bytes (4 weights of each of the 8 rows), each times the token's 4
activation bytes broadcast to the 8 rows (one ``vpdpbusd`` per plane: int32 lane ``r`` is row ``r``'s sum), the
exact int32 block sum converted to float and added with one FMA by ``scale x xd`` and one by the min times ``xs``
into lane ``r`` of the token's accumulator: a lane is a row, so ``y[t, 8 g: 8 g + 8]`` is one vector store. Tokens
go in tiles of 3 (16-bit codes) or 4, then 2, then 1, each weight vector loaded once per tile; a token's operations
are the same, in the same order, whatever its tile (batch invariance). Row groups go in 64 parallel chunks, tokens
in spans of 128 so that a span's activations stay in L2 while a chunk's rows pass over them. Two whole row groups
(a pair) go through pair tiles (``_pair_q8_vnni``): their 16 rows in 512-bit vectors, each activation broadcast
serving 16 rows (the same outputs bit for bit; ``quant_matvec``'s pair tiles, docs/model.md): a span's tokens 8 at
a time, then its last 1-7 tokens in one pair tile of them all; a call of 1 to 7 tokens (decode steps, batched or
not, short verifies: ``few_pairs``) in one pair tile of all its tokens, so one pass over the pair's weights. The
first pass over a pair prefetches the pair's arrays ``PAIR_PREFETCH`` (16) blocks ahead (``llvm.prefetch``: 8 KB of
codes, past a pair's end into the next pair's). A group alone (an odd count, the last rows) runs the narrow tiles.
``packed_q8_0_embed_kernel`` looks rows up in that layout (a tied embedding is the head), giving the GGUF layout's
values exactly.

Measured on the Zen 5 VM (2026-11-28 18:12-18:30 UTC), one thread, CPU time, ms a call (load 3-5 from another
session's compiles; docs/model.md has more). Streaming 300 MB of copies, the groups apart on the narrow tiles
(before) / interleaved, pair tiles of 3, 2, 1 tokens / one pair tile of all the tokens: 2048 x 8192 at 1 token
0.678 / 0.539 / 0.525, 4 tokens 1.929 / 0.691 / 0.602, 7 tokens 2.440 / 0.983 / 0.712; 16384 x 2048 at 1 token
1.048 / 1.017 / 1.000, 7 tokens 4.887 / 1.856 / 1.364. Prefetch distances in one run (2048 x 8192, 1 / 3 tokens): 8
blocks 0.539 / 0.605, 12 0.508 / 0.538, 16 0.514 / 0.530, 24 0.536 / 0.551; in another 16 0.522 / 0.543, 32 0.549
/ 0.564, none 0.549 / 0.863. A matrix in L3 (one copy, called again and again), before / interleaved without the
wide tiles' prefetch / with it: 2048 x 8192 at 8 tokens 1.319 / 1.869 / 0.776, 79 tokens 8.261 / 7.913 / 6.746, 256
tokens 23.32 / 23.21 / 21.98; 16384 x 2048 at 8 tokens 3.870 / 3.906 / 1.462, 256 tokens 46.41 / 44.93 / 42.04: on
one stream without it the 8-token tile waited on memory, longer than on the old layout's two streams a pair. A
1B-shaped Q8_0 model (2 threads, wall time, ``scripts/compare_builds.py``, 2 runs, load 1.9-2.0, 18:31-18:33):
decode step 23.17 / 22.87 -> 21.24 / 21.04 ms, 4 sequences 70.8 / 70.5 -> 24.1 / 23.8 ms, 8 sequences 71.4 / 69.7
-> 32.6 / 32.6 ms, a 79-token prefill 255.9 / 254.0 -> 211.8 / 208.9 ms; its logits equal the old build's.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from .quant_formats import PAIRED, interleave

ROWS = 8          # rows of a group: one float32 lane each
_QBLOCK = 32
_QMAX = 127
_CHUNKS = 64
_TILE = 4         # tokens sharing each unpacked weight vector (8-bit activations)
_SPLIT_TILE = 3   # the same with 16-bit activations (two planes: twice the integer accumulators)
PAIR_TOKENS = 8   # tokens of packed Q8_0's pair tiles (``_pair_q8_vnni``): 16 accumulators with two planes
_PAIR = 2 * ROWS  # lanes of a pair tile's vectors: two row groups
#: blocks ahead that a pair tile's first pass over a pair prefetches the pair's arrays (past its end into the next
#: pair's; module doc): 8 KB of codes
PAIR_PREFETCH = 16
#: activation code bits: 8 (GGML's Q8_1, one plane) or 16 (two int8 planes, high and low bytes)
ACTIVATION_BITS = (8, 16)
DEFAULT_ACTIVATION_BITS = 16  # 8 puts SmolLM2's logits about 1.5 from the float reference's (docs/model.md)
SPLIT_QMAX = 32512  # 16-bit codes' largest magnitude: 127 * 256, so the high byte fits int8 with the low in [-128, 128)
_SPAN = 128       # tokens whose activations stay in L2 while a chunk's rows pass over them
#: bytes after each token's activation codes, so that the codes a tile reads at once (tokens x planes) fall in
#: different L1 sets where a row is a multiple of 4096 bytes (K = 8192: 8 ways per set, 16 codes in a wide tile)
ROW_PAD = 64
_MADDUBS = "llvm.x86.avx2.pmadd.ub.sw"
_DPBUSD = "llvm.x86.avx512.vpdpbusd.256"
_DPBUSD_512 = "llvm.x86.avx512.vpdpbusd.512"
#: LLVM features of the VNNI tiles (``vpdpbusd`` on 256-bit vectors: AVX512-VNNI with AVX512-VL; on 512-bit vectors
#: of bytes, ``quant_matvec``'s pair tile: AVX512-BW, which every CPU with AVX512-VNNI has)
VNNI_FEATURES = ("avx512vnni", "avx512vl", "avx512bw")
_MADDWD = "llvm.x86.avx2.pmadd.wd"
_SCALE = "float16"


def has_vnni(features: frozenset[str]) -> bool:
    """Whether code built with these LLVM features can run the VNNI tile (``VNNI_FEATURES``)."""
    return all(f in features for f in VNNI_FEATURES)


Q8_OFFSET = 128  # packed Q8_0 weights are stored as w + 128 (unsigned, for vpdpbusd), the offset folded as a min


def packed_q8_0_shapes(out_features: int, in_features: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(suffix, shape, dtype) of the arrays of a packed Q8_0 ``[out, in]`` weight as stored (``pack_q8_0``: the row
    groups in interleaved pairs)."""
    pairs, blocks = -(-out_features // (PAIRED * ROWS)), in_features // _QBLOCK
    return [("codes", (pairs, blocks, PAIRED * ROWS * _QBLOCK), "uint8"),
            ("scales", (pairs, blocks, PAIRED * ROWS), _SCALE)]


def pack_q8_0(codes: np.ndarray, scales: np.ndarray) -> dict[str, np.ndarray]:
    """The GGUF's Q8_0 arrays (``codes[N, K]`` int8, ``scales[N, K/32]`` float16) packed 8 rows to a vector, per row
    group ``g``: byte ``32 v + 4 r + j`` of ``codes[g, b]`` (``v < 8``, ``r < 8``, ``j < 4``) holds weight
    ``32 b + 4 v + j`` of row ``8 g + r`` plus ``Q8_OFFSET``; ``scales[g, b, r]`` that row's block scale (the rows
    padded with zero weights to a whole pair of groups). Stored with the groups in pairs, interleaved
    (``quant_formats.interleave``): ``codes[g // 2, b]`` holds each run of 32 bytes (one vector ``v``) of group
    ``g`` then the same of group ``g + 1``, ``scales[g // 2, b]`` group ``g``'s 8 scales then ``g + 1``'s."""
    n_out, n_in = codes.shape
    blocks, groups = n_in // _QBLOCK, -(-n_out // (PAIRED * ROWS)) * PAIRED
    pad = groups * ROWS - n_out
    q = np.pad(codes.astype(np.int16) + Q8_OFFSET, ((0, pad), (0, 0)), constant_values=Q8_OFFSET).astype(np.uint8)
    q = q.reshape(groups, ROWS, blocks, 8, 4).transpose(0, 2, 3, 1, 4)  # [g, b, v, r, j]
    sc = np.pad(scales.astype(np.float16), ((0, pad), (0, 0))).reshape(groups, ROWS, blocks).transpose(0, 2, 1)
    return {"codes": interleave("codes", q.reshape(groups, blocks, ROWS * _QBLOCK)),
            "scales": interleave("scales", sc)}


def quantise_activations(x: np.ndarray, xbits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """``(q, xd)`` of float32 ``x[n, K]`` exactly as the kernel computes them (float32 arithmetic, round half to
    even): integer codes ``[n, K]`` (int8, or int32 within +-``SPLIT_QMAX`` for 16 bits) and float32 scales
    ``[n, K/32]``."""
    qmax = _QMAX if xbits == 8 else SPLIT_QMAX
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, _QBLOCK)
    d = (np.abs(blocks).max(axis=2) / np.float32(qmax)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / np.maximum(d, np.float32(1e-30)), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int8 if xbits == 8 else np.int32)
    return q.reshape(x.shape), d


def round_activations(x: np.ndarray, xbits: int = 8) -> np.ndarray:
    """``x`` as the kernel sees it: ``q * xd`` (float32), the value its integer dot products multiply exactly."""
    q, xd = quantise_activations(x, xbits)
    return (q.reshape(x.shape[0], -1, _QBLOCK).astype(np.float32) * xd[:, :, None]).reshape(x.shape)


def _intrin(name: str, dtype: str, *args: Any) -> Any:
    return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(name), *args, dtype=dtype)


def _run(buf: Any, g: Any, b: Any, at: int, lanes: int, dtype: str, pair: bool = False) -> Any:
    """Row group ``g``'s run of ``lanes`` elements at ``[b, at]`` (per-group indexing, ``at`` a multiple of
    ``lanes``; ``pack_q8_0``'s and ``quant_formats``' layouts) as a ``dtype`` vector, or with ``pair`` (``g`` even)
    group ``g``'s then group ``g + 1``'s, which the interleaved layout stores side by side: one load of twice the
    lanes (a 512-bit vector)."""
    if pair:
        return buf.vload([g // 2, b, at * 2], f"{dtype}x{2 * lanes}")
    return buf.vload([g // 2, b, at * 2 + g % 2 * lanes], f"{dtype}x{lanes}")


def _elem(buf: Any, g: Any, b: Any, at: Any, run: int = ROWS) -> Any:
    """Row group ``g``'s element ``[b, at]`` (per-group indexing) of an array whose pairs of groups interleave runs
    of ``run`` elements (``pack_q8_0``)."""
    return buf[g // 2, b, at // run * 2 * run + g % 2 * run + at % run]


def _prefetch(buf: Any, pair: Any, b: Any, at: int) -> Any:
    """Ask for the cache line holding ``buf[pair, b, at]`` (stored indexing; ``llvm.prefetch``: a read, kept in every
    cache level)."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(buf[pair, b, at]), T.int32(0), T.int32(3),
                              T.int32(1))


def _code(x: Any, t: Any, k: Any, inv: Any) -> Any:
    """The activation code of ``x[t, k]`` as float32 (an integer): ``nearbyint(x * inv)``."""
    return T.nearbyint(T.Cast("float32", x[t, k]) * inv)


def _high(q: Any) -> Any:
    """The high byte ``h`` of a 16-bit code ``q = 256 h + l`` with ``l`` in [-128, 128), as float32."""
    return T.floor((q + T.float32(128)) * T.float32(1 / 256))


@T.macro
def _quantise(x, xq, xd, xs, t, blocks, amax, qmax):
    """xq, xd, xs of token ``t`` (module doc; ``qmax`` 127: one plane of int8 codes, ``SPLIT_QMAX``: each code
    ``q = 256 h + l`` as the planes ``h`` (0) and ``l`` (1), ``l`` in [-128, 128)); ``amax``: a local float32
    scratch of 16 (the maxima, then the codes' sums). In three passes over the blocks, each a stream of independent
    blocks (in one pass, a block's maximum, two divisions and codes made one dependent chain a block): ``d`` into
    ``xd``, ``inv`` into ``xs`` (overwritten by the third pass), then the codes; the same operations on the same
    values, so the same codes and scales."""
    for b in range(blocks):
        for lane in T.vectorized(8):
            amax[lane] = T.max(T.max(T.abs(T.Cast("float32", x[t, b * _QBLOCK + lane])),
                                     T.abs(T.Cast("float32", x[t, b * _QBLOCK + 8 + lane]))),
                               T.max(T.abs(T.Cast("float32", x[t, b * _QBLOCK + 16 + lane])),
                                     T.abs(T.Cast("float32", x[t, b * _QBLOCK + 24 + lane]))))
        xd[t, b] = T.max(T.max(T.max(amax[0], amax[1]), T.max(amax[2], amax[3])),
                         T.max(T.max(amax[4], amax[5]), T.max(amax[6], amax[7]))) / T.float32(qmax)
    for b in range(blocks):
        xs[t, b] = T.Select(xd[t, b] > T.float32(0), T.float32(1) / T.max(xd[t, b], T.float32(1e-30)), T.float32(0))
    for b in range(blocks):
        d: T.let = xd[t, b]
        inv: T.let = xs[t, b]
        for lane in T.vectorized(8):
            amax[8 + lane] = T.float32(0)
        for j in T.unroll(4):  # no T.let inside: TVM's vectorizer kept one lane of a let-bound vector
            for lane in T.vectorized(8):
                amax[8 + lane] = amax[8 + lane] + _code(x, t, b * _QBLOCK + j * 8 + lane, inv)
                if qmax == _QMAX:
                    xq[0, t, b * _QBLOCK + j * 8 + lane] = T.Cast("int8", _code(x, t, b * _QBLOCK + j * 8 + lane, inv))
                else:  # q = 256 h + l, exact in float32 (|q| <= SPLIT_QMAX)
                    xq[0, t, b * _QBLOCK + j * 8 + lane] = T.Cast("int8", _high(_code(x, t, b * _QBLOCK + j * 8 + lane,
                                                                                      inv)))
                    xq[1, t, b * _QBLOCK + j * 8 + lane] = T.Cast("int8", _code(
                        x, t, b * _QBLOCK + j * 8 + lane, inv) - _high(_code(x, t, b * _QBLOCK + j * 8 + lane, inv))
                                                                  * T.float32(256))
        xs[t, b] = d * (((amax[8] + amax[9]) + (amax[10] + amax[11])) + ((amax[12] + amax[13]) + (amax[14] + amax[15])))


@T.macro
def _add_block(facc, s, sums, sv, mv, xd, xs, t0, b):
    """Token ``s``'s 8 rows, block ``b``: ``facc += float(sums) * (scale * xd) + min * xs`` (``sums`` the int32
    block sums, ``sv`` / ``mv`` the rows' scales and mins as float32x8)."""
    facc[T.ramp(s * ROWS, 1, ROWS)] = (facc[T.ramp(s * ROWS, 1, ROWS)]
                                       + T.Cast("float32x8", sums) * (sv * T.broadcast(xd[t0 + s, b], ROWS))
                                       + mv * T.broadcast(xs[t0 + s, b], ROWS))


@T.macro
def _store(y, facc, t0, size, g, out_features):
    """The tile's ``size`` tokens' outputs for row group ``g`` (one vector store each; the last group's real rows)."""
    for s in T.unroll(size):
        if g * ROWS + ROWS <= out_features:
            y[t0 + s, T.ramp(g * ROWS, 1, ROWS)] = T.Cast(f"{y.dtype}x{ROWS}", facc[T.ramp(s * ROWS, 1, ROWS)])
        else:
            for r in range(out_features - g * ROWS):
                y[t0 + s, g * ROWS + r] = T.Cast(y.dtype, facc[s * ROWS + r])


def _plane_sum(iacc: Any, s: Any, size: int, p: int) -> Any:
    """int32x8 block sums of token ``s``'s plane ``p`` in ``_tile_q8_vnni``: its even and odd vectors'
    accumulators."""
    at = (p * size + s) * 2 * ROWS
    return iacc[T.ramp(at, 1, ROWS)] + iacc[T.ramp(at + ROWS, 1, ROWS)]


@T.macro
def _tile_q8_vnni(y, xq4, xd, xs, t0, size, g, blocks, out_features, codes, scales, mins, iacc, facc, planes):
    """``y[t0 + s, 8 g: 8 g + 8]`` for the ``size`` tokens of a tile (module doc): 8 vectors of whole bytes a block,
    each the next 4 weights of the 8 rows, one ``vpdpbusd`` per vector, plane and token; the weights' offset of 128
    comes off as a min of ``-128 x scale`` times the token's ``xs`` (``mins`` is not read). The vectors go round two
    accumulators per plane and token (even and odd ``v``: shorter dependency chains); ``iacc``: int32, 8 lanes per
    (plane, token, accumulator)."""
    for s in T.unroll(size):
        facc[T.ramp(s * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
    for b in range(blocks):
        for a in T.unroll(planes * size * 2):
            iacc[T.ramp(a * ROWS, 1, ROWS)] = T.broadcast(T.int32(0), ROWS)
        for v in T.unroll(8):
            raw: T.let = _run(codes, g, b, v * 32, 32, "uint8")
            for p in T.unroll(planes):
                for s in T.unroll(size):
                    at: T.let = ((p * size + s) * 2 + v % 2) * ROWS
                    xv: T.let = T.reinterpret("int8x32", T.broadcast(xq4[p, t0 + s, b * 8 + v], ROWS))
                    iacc[T.ramp(at, 1, ROWS)] = _intrin(_DPBUSD, "int32x8", iacc[T.ramp(at, 1, ROWS)], raw, xv)
        sv: T.let = T.Cast("float32x8", _run(scales, g, b, 0, ROWS, _SCALE))
        for s in T.unroll(size):
            sums: T.let = _plane_sum(iacc, s, size, 0) if planes == 1 else T.shift_left(
                _plane_sum(iacc, s, size, 0), T.broadcast(T.int32(8), ROWS)) + _plane_sum(iacc, s, size, 1)
            _add_block(facc, s, sums, sv, sv * T.broadcast(T.float32(-Q8_OFFSET), ROWS), xd, xs, t0, b)
    _store(y, facc, t0, size, g, out_features)


@T.macro
def _pair_q8_vnni(y, xq4, xd, xs, t0, size, g, blocks, codes, scales, pacc, pfacc, planes, ahead):
    """``_tile_q8_vnni`` for ``size`` tokens on the 16 rows of row groups ``g`` and ``g + 1`` (``g`` even, both
    whole) in 512-bit vectors (lanes 0-7 group ``g``, 8-15 group ``g + 1``; each one load, the layout's pairs being
    interleaved): one accumulator per plane and token, started by the block's first ``vpdpbusd``, each activation
    broadcast serving 16 rows. The same exact int32 block sums and, lane by lane, the same float operations as
    ``_add_block``, so a row's output is bitwise the narrow tile's. ``ahead`` > 0: each block first prefetches the
    pair's arrays that many blocks on (past the pair's end into the next pair's, clamped at the last)."""
    for s in T.unroll(size):
        pfacc[T.ramp(s * _PAIR, 1, _PAIR)] = T.broadcast(T.float32(0), _PAIR)
    for b in range(blocks):
        if ahead > 0:
            fetch_at: T.let = g // 2 * blocks + b + ahead  # the block ``ahead`` on along the pairs' stream
            pp: T.let = T.min(fetch_at // blocks, codes.shape[0] - 1)
            pb: T.let = fetch_at % blocks
            for line in T.unroll(PAIRED * ROWS * _QBLOCK // 64):  # a block's codes of two groups: 512 bytes
                T.evaluate(_prefetch(codes, pp, pb, line * 64))
            if pb % 2 == 0:  # the scales (32 bytes a block) once a cache line
                T.evaluate(_prefetch(scales, pp, pb, 0))
        for v in T.unroll(8):
            raw: T.let = _run(codes, g, b, v * 32, 32, "uint8", True)
            for p in T.unroll(planes):
                for s in T.unroll(size):
                    pacc[T.ramp((p * size + s) * _PAIR, 1, _PAIR)] = _intrin(
                        _DPBUSD_512, "int32x16", T.if_then_else(v == 0, T.broadcast(T.int32(0), _PAIR), pacc[
                            T.ramp((p * size + s) * _PAIR, 1, _PAIR)]), raw, T.reinterpret(
                            "int8x64", T.broadcast(xq4[p, t0 + s, b * 8 + v], _PAIR)))
        sv: T.let = T.Cast("float32x16", _run(scales, g, b, 0, ROWS, _SCALE, True))
        for s in T.unroll(size):
            sums: T.let = pacc[T.ramp(s * _PAIR, 1, _PAIR)] if planes == 1 else T.shift_left(
                pacc[T.ramp(s * _PAIR, 1, _PAIR)], T.broadcast(T.int32(8), _PAIR)) + pacc[
                T.ramp((size + s) * _PAIR, 1, _PAIR)]
            pfacc[T.ramp(s * _PAIR, 1, _PAIR)] = (
                pfacc[T.ramp(s * _PAIR, 1, _PAIR)] + T.Cast("float32x16", sums) * (sv * T.broadcast(
                    xd[t0 + s, b], _PAIR)) + sv * T.broadcast(T.float32(-Q8_OFFSET), _PAIR) * T.broadcast(
                    xs[t0 + s, b], _PAIR))
    for s in T.unroll(size):
        y[t0 + s, T.ramp(g * ROWS, 1, _PAIR)] = T.Cast(f"{y.dtype}x{_PAIR}", pfacc[T.ramp(s * _PAIR, 1, _PAIR)])


def _matmul_body() -> Any:
    """The packed Q8_0 kernel's body: each token's activations quantised once (tokens in parallel from 16 on), then
    row groups in parallel chunks, tokens in spans of ``_SPAN`` and tiles of ``tile`` (then 2, then 1) of
    ``_tile_q8_vnni``, so that a token's operations are the same in any tile; from ``PAIR_TOKENS`` tokens on, the
    whole row groups go in pairs, ``PAIR_TOKENS`` tokens at a time through ``_pair_q8_vnni`` (the first tile
    prefetching ``ahead`` blocks), then the span's last 1-7 tokens in one pair tile; under ``PAIR_TOKENS`` tokens
    (``few_pairs``), each pair in one pair tile of all the tokens, prefetching; then the groups alone in the narrow
    tiles."""

    @T.macro
    def rest(y, xq4, xd, xs, t0, t1, g, blocks, codes, scales, mins, iacc, facc, planes, tile, N):
        """Row group ``g``'s tokens ``t0`` to ``t1``: tiles of ``tile``, 2 and 1."""
        for tt in range((t1 - t0) // tile):
            _tile_q8_vnni(y, xq4, xd, xs, t0 + tt * tile, tile, g, blocks, N, codes, scales, mins, iacc, facc,
                          planes)
        if (t1 - t0) % tile >= 2:
            _tile_q8_vnni(y, xq4, xd, xs, t1 - (t1 - t0) % tile, 2, g, blocks, N, codes, scales, mins, iacc,
                          facc, planes)
        if (t1 - t0) % tile % 2 == 1:
            _tile_q8_vnni(y, xq4, xd, xs, t1 - 1, 1, g, blocks, N, codes, scales, mins, iacc, facc, planes)

    @T.macro
    def pair_rest(y, t0, n, xq4, xd, xs, g, blocks, codes, scales, pacc, pfacc, planes, ahead):
        """Row groups ``g`` and ``g + 1``'s ``n`` tokens from ``t0`` (0 to ``PAIR_TOKENS - 1``) in one pair tile of
        ``n`` tokens (one pass over the pair's weights), prefetching ``ahead`` blocks."""
        if n == 1:
            _pair_q8_vnni(y, xq4, xd, xs, t0, 1, g, blocks, codes, scales, pacc, pfacc, planes, ahead)
        elif n == 2:
            _pair_q8_vnni(y, xq4, xd, xs, t0, 2, g, blocks, codes, scales, pacc, pfacc, planes, ahead)
        elif n == 3:
            _pair_q8_vnni(y, xq4, xd, xs, t0, 3, g, blocks, codes, scales, pacc, pfacc, planes, ahead)
        elif n == 4:
            _pair_q8_vnni(y, xq4, xd, xs, t0, 4, g, blocks, codes, scales, pacc, pfacc, planes, ahead)
        elif n == 5:
            _pair_q8_vnni(y, xq4, xd, xs, t0, 5, g, blocks, codes, scales, pacc, pfacc, planes, ahead)
        elif n == 6:
            _pair_q8_vnni(y, xq4, xd, xs, t0, 6, g, blocks, codes, scales, pacc, pfacc, planes, ahead)
        elif n == 7:
            _pair_q8_vnni(y, xq4, xd, xs, t0, 7, g, blocks, codes, scales, pacc, pfacc, planes, ahead)

    @T.macro
    def groupwise(y, n, xq4, xd, xs, blocks, codes, scales, mins, planes, tile, lanes, acc_dtype, N, groups, chunks):
        """Every row group's tokens span by span in the narrow tiles."""
        for chunk in T.parallel(chunks):
            iacc = T.alloc_buffer((planes * tile * lanes,), acc_dtype, scope="local")
            facc = T.alloc_buffer((tile * ROWS,), "float32", scope="local")
            for span in range((n + _SPAN - 1) // _SPAN):
                t1: T.let = T.min(n, span * _SPAN + _SPAN)
                for g in range(chunk * groups // chunks, (chunk + 1) * groups // chunks):
                    rest(y, xq4, xd, xs, span * _SPAN, t1, g, blocks, codes, scales, mins, iacc, facc, planes, tile,
                         N)

    @T.macro
    def body(x, y, n, codes, scales, mins, planes, qmax, tile, lanes, acc_dtype, K, N, blocks, groups, chunks,
             few_pairs, ahead):
        xq = T.alloc_buffer((planes, n, K + ROW_PAD), "int8")
        xq4 = T.decl_buffer((planes, n, (K + ROW_PAD) // 4), "int32", data=xq.data)
        xd = T.alloc_buffer((n, blocks), "float32")
        xs = T.alloc_buffer((n, blocks), "float32")
        if n >= 16:
            for t in T.parallel(n):
                amax = T.alloc_buffer((16,), "float32", scope="local")
                _quantise(x, xq, xd, xs, t, blocks, amax, qmax)
        else:
            amax = T.alloc_buffer((16,), "float32", scope="local")
            for t in range(n):
                _quantise(x, xq, xd, xs, t, blocks, amax, qmax)
        # with pairs, two parallel loops, so two functions: the few tokens' one keeps its registers (in one function
        # with the pair tiles, LLVM spilled pointers and constants in the narrow tiles' loops)
        if n >= PAIR_TOKENS:
            for chunk in T.parallel(chunks):
                iacc = T.alloc_buffer((planes * tile * lanes,), acc_dtype, scope="local")
                facc = T.alloc_buffer((tile * ROWS,), "float32", scope="local")
                pacc = T.alloc_buffer((planes * PAIR_TOKENS * _PAIR,), "int32", scope="local")
                pfacc = T.alloc_buffer((PAIR_TOKENS * _PAIR,), "float32", scope="local")
                for span in range((n + _SPAN - 1) // _SPAN):
                    t1: T.let = T.min(n, span * _SPAN + _SPAN)
                    t0: T.let = span * _SPAN + (t1 - span * _SPAN) // PAIR_TOKENS * PAIR_TOKENS
                    for u in range(chunk * (groups - N // ROWS // 2) // chunks,
                                   (chunk + 1) * (groups - N // ROWS // 2) // chunks):
                        if u < N // ROWS // 2:
                            # the first pass over the pair streams it (prefetching), the others find it in L2
                            if t1 - span * _SPAN >= PAIR_TOKENS:
                                _pair_q8_vnni(y, xq4, xd, xs, span * _SPAN, PAIR_TOKENS, 2 * u, blocks, codes, scales,
                                              pacc, pfacc, planes, ahead)
                            for tt in range(1, (t1 - span * _SPAN) // PAIR_TOKENS):
                                _pair_q8_vnni(y, xq4, xd, xs, span * _SPAN + tt * PAIR_TOKENS, PAIR_TOKENS, 2 * u,
                                              blocks, codes, scales, pacc, pfacc, planes, 0)
                            pair_rest(y, t0, t1 - t0, xq4, xd, xs, 2 * u, blocks, codes, scales, pacc, pfacc,
                                      planes, ahead)
                        else:
                            rest(y, xq4, xd, xs, span * _SPAN, t1, u + N // ROWS // 2, blocks, codes, scales,
                                 mins, iacc, facc, planes, tile, N)
        elif few_pairs and N // ROWS // 2 > 0:  # 1 to 7 tokens: the pairs in prefetching pair tiles (module doc)
            for chunk in T.parallel(chunks):
                iacc = T.alloc_buffer((planes * tile * lanes,), acc_dtype, scope="local")
                facc = T.alloc_buffer((tile * ROWS,), "float32", scope="local")
                pacc = T.alloc_buffer((planes * PAIR_TOKENS * _PAIR,), "int32", scope="local")
                pfacc = T.alloc_buffer((PAIR_TOKENS * _PAIR,), "float32", scope="local")
                for u in range(chunk * (groups - N // ROWS // 2) // chunks,
                               (chunk + 1) * (groups - N // ROWS // 2) // chunks):
                    if u < N // ROWS // 2:
                        pair_rest(y, 0, n, xq4, xd, xs, 2 * u, blocks, codes, scales, pacc, pfacc, planes, ahead)
                    else:
                        rest(y, xq4, xd, xs, 0, n, u + N // ROWS // 2, blocks, codes, scales, mins, iacc, facc,
                             planes, tile, N)
        else:
            groupwise(y, n, xq4, xd, xs, blocks, codes, scales, mins, planes, tile, lanes, acc_dtype, N, groups,
                      chunks)

    return body


def _check(kind: str, in_features: int, out_features: int, x_dtype: str, y_dtype: str, xbits: int) -> None:
    if in_features % _QBLOCK or in_features <= 0 or out_features <= 0:
        raise ValueError(f"packed {kind} weights need in_features a positive multiple of {_QBLOCK}, got {in_features}")
    for name, dtype in (("x_dtype", x_dtype), ("y_dtype", y_dtype)):
        if dtype not in ("float32", "float16"):
            raise ValueError(f"{name} must be float32 or float16, got {dtype!r}")
    if xbits not in ACTIVATION_BITS:
        raise ValueError(f"activation bits must be one of {ACTIVATION_BITS}, got {xbits}")


@functools.cache
def packed_q8_0_kernel(out_features: int, in_features: int, x_dtype: str = "float32", y_dtype: str = "float32",
                       xbits: int = DEFAULT_ACTIVATION_BITS, few_pairs: bool = True,
                       prefetch: int = PAIR_PREFETCH) -> tirx.PrimFunc:
    """``y[t, o] = sum_k x[t, k] * W[o, k]`` for Q8_0 weights packed by ``pack_q8_0`` (parameters ``x``, ``codes``,
    ``scales``, ``y``), on AVX512-VNNI only (``has_vnni``): the activations quantised once per call (module doc),
    each block's sum ``scale * xd * (sum_j (w_j + 128) q_j) - 128 * scale * xs``; tokens in tiles, spans and
    chunks, so a token's row is the same whatever the other tokens. ``few_pairs``: calls of 1 to ``PAIR_TOKENS - 1``
    tokens run one pair tile of all their tokens on each pair of whole row groups instead of the narrow tiles on
    each group (the same outputs); ``prefetch``: the blocks ahead that the pair tiles prefetch in their first pass
    over a pair (0: none; the same outputs)."""
    _check("Q8_0", in_features, out_features, x_dtype, y_dtype, xbits)
    if prefetch < 0:
        raise ValueError(f"prefetch must be 0 or more blocks, got {prefetch}")
    N, K, blocks, groups = out_features, in_features, in_features // _QBLOCK, -(-out_features // ROWS)
    (_, codes_shape, _), (_, scales_shape, _) = packed_q8_0_shapes(N, K)
    chunks = min(_CHUNKS, groups)
    planes, qmax, tile = (1, _QMAX, _TILE) if xbits == 8 else (2, SPLIT_QMAX, _SPLIT_TILE)
    body = _matmul_body()

    @T.prim_func(private=True)
    def packed_q8_0(var_x: T.handle, codes: T.Buffer(codes_shape, "uint8"), scales: T.Buffer(scales_shape, _SCALE),
                    var_y: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, K), x_dtype)
        y = T.match_buffer(var_y, (n, N), y_dtype)
        body(x, y, n, codes, scales, None, planes, qmax, tile, 2 * ROWS, "int32", K, N, blocks, groups, chunks,
             few_pairs, prefetch)
    return packed_q8_0


@functools.cache
def packed_q8_0_embed_kernel(vocab: int, hidden: int) -> tirx.PrimFunc:
    """``out[t, h] = W[ids[t], h]`` (float32: ``scale * w``, the GGUF layout's lookup exactly) from packed Q8_0
    (``pack_q8_0``, its interleaved pairs of row groups); parameters ``ids`` int32 ``[n]``, ``codes``, ``scales``,
    ``out``."""
    (_, codes_shape, _), (_, scales_shape, _) = packed_q8_0_shapes(vocab, hidden)

    @T.prim_func(private=True)
    def embed_packed_q8_0(var_ids: T.handle, codes: T.Buffer(codes_shape, "uint8"),
                          scales: T.Buffer(scales_shape, _SCALE), var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        ids = T.match_buffer(var_ids, (n,), "int32")
        out = T.match_buffer(var_out, (n, hidden), "float32")
        for t in range(n):
            for h in range(hidden):
                g: T.let = ids[t] // ROWS
                out[t, h] = T.Cast("float32", _elem(scales, g, h // _QBLOCK, ids[t] % ROWS, ROWS)) * T.Cast(
                    "float32", T.Cast("int32", _elem(codes, g, h // _QBLOCK, (h % _QBLOCK) // 4 * 32
                                                     + ids[t] % ROWS * 4 + h % 4, 32)) - Q8_OFFSET)
    return embed_packed_q8_0
