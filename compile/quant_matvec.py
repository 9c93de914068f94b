# fmt: off
"""Matmuls over the packed layouts of ``quant_formats`` (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): one kernel for every
token count, activations quantised once per call, integer dot products 8 rows to a vector, as ``packed_matvec``.

The activations are quantised exactly as for packed Q4_1 (``packed_matvec.quantise_activations``: per token and
block of 32, ``xd``, codes ``xq`` of 16 bits as two int8 planes by default, ``xs = xd * sum(xq)``), plus, for types
with an offset, ``-off`` times the codes' integer sums, ``xc[t, b h]``, per scale's sub-block (32 weights; Q6_K 16).
Then, with the weights ``W = S * (q - off) + M`` (``quant_formats``)::

    for t in range(n):
        for o in range(N):                                   # o = 8 g + r
            y[t, o] = sum_b sum_h S[o, b, h] * xd[t, b] * (sum_j q[o, 32 b + j] * xq[t, 32 b + j] + xc[t, b h])
                            + M[o, b] * xs[t, b]             # j over sub-block h (h < 2 for Q6_K, else 1)

Per row group, block and nibble-plane vector: the codes are rebuilt from the low nibbles and the high-bit planes
(``(high >> p) & 1`` moved to bit 4 or 5: two or four vector operations a vector, shared by the tile's tokens),
then, per plane of activation codes and token, AVX512-VNNI's ``vpdpbusd`` adds each row's 4 products into its int32
lane (on AVX2: ``vpmaddubsw`` for the low and the high nibbles, added, then ``vpmaddwd`` with ones: the same exact
int32 sums, so both tiles give the same outputs bit for bit; at most 2 x 2 x 63 x 128 < 2^15 per int16 lane; IQ4's
looked-up codes, up to 241, as ``16 x (code >> 4) + (code & 15)``: two such products, the first shifted by 4). The
offset comes off the int32 sums (exact), then one FMA per sub-block with ``S x xd`` (``S`` rebuilt from ``d`` and
``sc`` for the 8 rows: one convert and multiply per block, not per token) and one with ``M x xs``. Tokens in tiles of
3 (16-bit codes) or 4, then 2, then 1; row groups in 64 parallel chunks, tokens in spans of 128: a token's
operations are the same, in the same order, whatever its tile (batch invariance). With the VNNI tile, wide tiles of
8 tokens (Q6_K: 4) come first (``_wide_tile``: one accumulator per plane and token, the codes rebuilt once for 8
tokens instead of 3, the offset put in the accumulator before the block): the same int32 sums, so the same outputs.
Where two whole row groups follow each other, the wide tile takes both at once in 512-bit vectors (``_pair_tile``:
16 rows a vector, so each activation broadcast from memory serves 16 rows instead of 8; row groups then go to the
parallel chunks in pairs), again with the same int32 sums and the same float operations lane by lane; Q6_K's pair
tiles take 8 tokens, a block's two sub-blocks one after the other through the same accumulators (``serial``).
Where registers are short (Q6_K's serial tiles, and Q5_K, whose 8 rebuilt code vectors a block and super-block
mins made LLVM spill 35 times a block), a pair tile keeps one accumulator a token instead of one a plane: the high
plane's products first, then the sum shifted by 8 bits, the offset added and the low plane's products on top, which
is the joined sum exactly (``_serial_sub_block``, ``_one_acc_block``); the other types keep two (one dependent chain
a token measured 0-6% slower where nothing spilled: Q4_0, Q4_K, Q5_0, Q5_1, IQ4_XS). Q6_K has no min, so ``xs``
holds a copy of ``xd`` that its second sub-block reads: two loads LLVM cannot merge, so each product ``S x xd``
takes ``xd`` straight from memory instead of one broadcast kept (spilled) across the sub-blocks.

Calls of 1 to 7 tokens (decode steps, batched or not, short verifies: fewer than a wide tile) run one pair tile of
all their tokens on the pairs of whole row groups too (``few_pairs``; one pass over a pair's weights, as a wide
call's last 1-7 tokens of a span do), the same outputs bit for bit, and those tiles prefetch the pair's arrays
``PAIR_PREFETCH`` (32) blocks ahead (``llvm.prefetch``: 8 KB of codes; past a pair's end into the next pair's). The
layout stores a pair's two groups interleaved (``quant_formats``), so a pair tile reads one stream, as the narrow
tile on one group does, and each of its vectors in one load; a wide call's first tile of a span on a pair
prefetches too (it reads the pair from memory; the later ones find it in cache, where prefetching cost 9% at 512
tokens). Where a kernel has no pair tiles (AVX2), one token runs
the narrow tile on both groups of a pair block by block (``_tile_both``: the same operations per group, so the same
outputs, the integer accumulators shared), prefetching as the pair tiles do, so that it too reads the pair's stream
once: on the same VM, AVX2 tiles, one token, two threads streaming 16 copies (2026-11-28 18:35-18:37, quiet, 6
runs), Q4_K 16384 x 2048 36.8-41.6 -> 43.5-44.8 GB/s in 5 runs of 6 (31.8 in one), Q6_K 2048 x 8192 34.6-38.6 ->
42.9-49.7 GB/s (the same walk without the prefetch: Q4_K 34.1-38.1, Q6_K 36.2-38.3).

Measured on the Zen 5 VM (2026-11-28 18:30-18:50 UTC, load about 1, 2 threads, ``scripts/compare_builds.py``, best of
5 interleaved rounds), a 1B-shaped Q4_K_M's decode step: with the groups apart (before), on the narrow tiles 18.3-20.7
ms; interleaved, on the prefetching pair tiles 13.5-13.9 ms while the VM's memory was fast and 19.1-19.4 ms while it
was slow (its bare read of the 775 MiB of weights 15-19 ms: the host's load moves it within minutes), and against
the old build in the same runs always the faster (20.6 -> 19.1, 18.5 -> 13.5, 18.3 -> 13.6 ms); without the prefetch
18.9-19.5 ms in the fast state (the prefetch's gain); 16 or 64 blocks ahead instead of 32 no better. The narrow tile
on the interleaved layout one group at a time took 24.9-25.2 ms (each group's pass reads half of every line); block
by block on both groups (``_tile_both``) 18.6-21.6, as before. Before the interleave, the prefetching pair tiles (two
streams a thread) were 25% faster in some windows and 10-11% slower in others, so one token had stayed on the narrow
tiles.
"""

from __future__ import annotations

import functools
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from .packed_matvec import (
    _DPBUSD,
    _MADDUBS,
    _MADDWD,
    _QMAX,
    _SPAN,
    _SPLIT_TILE,
    _TILE,
    DEFAULT_ACTIVATION_BITS,
    ROW_PAD,
    ROWS,
    SPLIT_QMAX,
    _check,
    _elem,
    _intrin,
    _prefetch,
    _quantise,
    _run,
    _store,
)
from .quant_formats import QBLOCK, QuantLayout

_CHUNKS = 64
#: tokens of a wide tile (``wide_tile``; half as many with two sub-blocks a block): each vector's codes rebuilt once
#: for them all
WIDE_TILE = 8
#: blocks ahead that the pair tiles of calls under a wide tile (``few_pairs``) prefetch the pair's arrays (past
#: its end into the next pair's): without it one token streamed the weights no faster than the 8-row tiles (module
#: doc)
PAIR_PREFETCH = 32
_PSHUFB = "llvm.x86.avx2.pshuf.b"
_PSHUFB_512 = "llvm.x86.avx512.pshuf.b.512"
_DPBUSD_512 = "llvm.x86.avx512.vpdpbusd.512"
_PAIR = 2 * ROWS  # lanes of a pair tile's vectors: two row groups
_MIN_KINDS = {"none": 0, "block": 1, "super": 2}
_ARRAYS = ("codes", "high", "d", "sc", "m", "dmin", "mq", "lut")  # every layout's arrays in parameter order


def _codes(raw: Any, high: Any, lut: Any, g: Any, b: Any, v: Any, half: int, planes: int, codebook: bool,
           pair: bool = False) -> Any:
    """uint8x32 codes of nibble plane ``p = 2 v + half``: the nibbles plus ``planes`` high bits (``quant_formats``'s
    ``high``: Q5's bit ``p`` of each byte, Q6's bits ``2 k, 2 k + 1`` of vector ``u``, ``p = 4 u + k``, moved to bits
    4 and 5), or with ``codebook`` the ``lut`` values the nibbles index (``vpshufb``); with ``pair`` uint8x64, row
    groups ``g`` and ``g + 1`` (``raw`` the two groups' bytes)."""
    width = 64 if pair else 32
    if half == 0:
        out = T.bitwise_and(raw, T.broadcast(T.uint8(15), width))
    else:  # the 256-bit tiles as before: LLVM's byte shift measured no slower there at one token
        out = _high_nibbles(raw, width) if pair else T.shift_right(raw, T.broadcast(T.uint8(4), width))
    if planes:  # in 16-bit lanes (x86 has no byte shifts): the mask keeps each byte's own bits
        words = T.reinterpret(f"uint16x{width // 2}", _run(high, g, b, QBLOCK * (v // 2 if planes == 2 else 0), 32,
                                                           "uint8", pair))
        at = 2 * (v % 2 * 2 + half) if planes == 2 else 2 * v + half  # the plane's lowest bit in its byte
        moved = T.shift_left(T.shift_right(words, T.broadcast(T.Cast("uint16", at), width // 2)),
                             T.broadcast(T.uint16(4), width // 2))
        out = T.bitwise_or(out, T.reinterpret(f"uint8x{width}", T.bitwise_and(moved, T.broadcast(
            T.uint16(0x1010 if planes == 1 else 0x3030), width // 2))))
    if codebook:
        table = T.reinterpret("int8x32", lut.vload([0], "uint8x32"))
        if pair:
            table = T.Shuffle([table, table], list(range(64)))
        out = T.reinterpret(f"uint8x{width}", _intrin(_PSHUFB_512 if pair else _PSHUFB, f"int8x{width}", table,
                                                      T.reinterpret(f"int8x{width}", out)))
    return out


def _high_nibbles(raw: Any, width: int = 32) -> Any:
    """The high nibble of each byte of uint8 vector ``raw``, shifted in 16-bit lanes and masked (x86 has no byte
    shift: LLVM's byte shift is a ``vgf2p8affineqb``, which issues on the pipes that ``vpdpbusd`` needs)."""
    return T.bitwise_and(T.reinterpret(f"uint8x{width}", T.shift_right(T.reinterpret(
        f"uint16x{width // 2}", raw), T.broadcast(T.uint16(4), width // 2))), T.broadcast(T.uint8(15), width))


def _nibble(codes: Any, high: int) -> Any:
    """The low (``high`` 0) or high nibble of each byte of uint8x32 ``codes``."""
    if high:
        return T.shift_right(codes, T.broadcast(T.uint8(4), 32))
    return T.bitwise_and(codes, T.broadcast(T.uint8(15), 32))


def _scale(dd: Any, sc: Any, g: Any, b: Any, h: int, superblock: bool, sc_type: str, pair: bool = False) -> Any:
    """float32x8 ``S`` of the 8 rows, block ``b``, sub-block ``h`` (``pair``: float32x16, groups ``g`` and
    ``g + 1``)."""
    lanes = 2 * ROWS if pair else ROWS
    if not superblock:
        return T.Cast(f"float32x{lanes}", _run(dd, g, b, 0, ROWS, "float16", pair))
    return T.Cast(f"float32x{lanes}", _run(dd, g, b // 8, 0, ROWS, "float16", pair)) * T.Cast(
        f"float32x{lanes}", _run(sc, g, b, h * ROWS, ROWS, sc_type, pair))


def _min(mm: Any, dmin: Any, mq: Any, g: Any, b: Any, kind: int, pair: bool = False) -> Any:
    """float32x8 ``M`` of the 8 rows, block ``b`` (``kind`` 1: float16 ``m``; 2: ``-(dmin * mq)``; ``pair``:
    float32x16, groups ``g`` and ``g + 1``)."""
    lanes = 2 * ROWS if pair else ROWS
    if kind == 1:
        return T.Cast(f"float32x{lanes}", _run(mm, g, b, 0, ROWS, "float16", pair))
    return T.Cast(f"float32x{lanes}", _run(dmin, g, b // 8, 0, ROWS, "float16", pair)) * T.Cast(
        f"float32x{lanes}", _run(mq, g, b, 0, ROWS, "uint8", pair)) * T.broadcast(T.float32(-1), lanes)


def _sums(iacc: Any, s: Any, size: int, h: Any, planes: int) -> Any:
    """int32x8 block sums of token ``s``, accumulator ``h``, the planes joined (high plane times 256)."""
    at = (s * 2 + h) * ROWS
    if planes == 1:
        return iacc[T.ramp(at, 1, ROWS)]
    return T.shift_left(iacc[T.ramp(at, 1, ROWS)], T.broadcast(T.int32(8), ROWS)) + iacc[
        T.ramp(at + size * 2 * ROWS, 1, ROWS)]


def _block_sum(facc: Any, s: Any, totals: tuple[Any, Any], sv: tuple[Any, Any], xdv: Any, xs: Any, xc: Any,
               t0: Any, b: Any, off: int, halves: int, min_kind: int, mm: Any, dmin: Any, mq: Any, g: Any,
               pair: bool = False) -> Any:
    """Token ``s``'s accumulator plus block ``b``, from its exact int32 block sums (``totals``: per sub-block with
    two scales a block, else the whole block's and nothing): the offset off the integers, one FMA per sub-block with
    ``S x xd`` (``sv``), one with ``M x xs``. Every tile ends its blocks here, so equal integer sums give a token
    the same floats in any tile (``pair``: 16 lanes, two row groups, the same operations per lane)."""
    lanes = 2 * ROWS if pair else ROWS
    acc = facc[T.ramp(s * lanes, 1, lanes)]
    fl = f"float32x{lanes}"

    def less(total: Any, bh: Any) -> Any:  # the offset off the integer sums (already off where ``off`` is 0)
        return total + T.broadcast(xc[t0 + s, bh], lanes) if off else total

    if halves == 2:
        return (acc + T.Cast(fl, less(totals[0], b * 2)) * (sv[0] * xdv)
                + T.Cast(fl, less(totals[1], b * 2 + 1)) * (sv[1] * xdv))
    if min_kind == 0:
        return acc + T.Cast(fl, less(totals[0], b)) * (sv[0] * xdv)
    return (acc + T.Cast(fl, totals[0]) * (sv[0] * xdv)
            + _min(mm, dmin, mq, g, b, min_kind, pair) * T.broadcast(xs[t0 + s, b], lanes))


@T.macro
def _pair_prefetch(g, b, blocks, ahead, codes, high, dd, sc, mm, dmin, mq, hb, halves, superblock, min_kind):
    """Prefetch the arrays of row groups ``g`` and ``g + 1`` (a pair: one stream) ``ahead`` blocks on from block
    ``b``, past the pair's end into the next pair's (the module doc's ``PAIR_PREFETCH``)."""
    fetch_at: T.let = g // 2 * blocks + b + ahead  # the block ``ahead`` on along the pairs' stream
    pp: T.let = T.min(fetch_at // blocks, codes.shape[0] - 1)
    pb: T.let = fetch_at % blocks
    for line in T.unroll(4):  # a block's codes of two groups: 256 bytes
        T.evaluate(_prefetch(codes, pp, pb, line * 64))
    # the small arrays once a cache line (of 64 bytes): where ``pb`` starts one
    if hb > 0:
        for line in T.unroll(hb):
            T.evaluate(_prefetch(high, pp, pb, line * 64))
    if superblock:
        if pb % (4 // halves) == 0:
            T.evaluate(_prefetch(sc, pp, pb, 0))
        if pb % 16 == 0:
            T.evaluate(_prefetch(dd, pp, pb // 8, 0))
    else:
        if pb % 2 == 0:
            T.evaluate(_prefetch(dd, pp, pb, 0))
    if min_kind == 1:
        if pb % 2 == 0:
            T.evaluate(_prefetch(mm, pp, pb, 0))
    if min_kind == 2:
        if pb % 4 == 0:
            T.evaluate(_prefetch(mq, pp, pb, 0))
        if pb % 16 == 0:
            T.evaluate(_prefetch(dmin, pp, pb // 8, 0))


@T.macro
def _tile_block(xq4, xd, xs, xc, t0, size, g, b, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc, planes, hb,
                halves, off, superblock, sc_type, min_kind, vnni, codebook):
    """Block ``b`` of row group ``g`` into the ``size`` tokens' float sums ``facc`` (``_tile``)."""
    for a in T.unroll(planes * size * 2):
        iacc[T.ramp(a * ROWS, 1, ROWS)] = T.broadcast(T.int32(0), ROWS)
    for v in T.unroll(4):
        raw: T.let = _run(codes, g, b, v * 32, 32, "uint8", False)
        low: T.let = _codes(raw, high, lut, g, b, v, 0, hb, codebook)
        hig: T.let = _codes(raw, high, lut, g, b, v, 1, hb, codebook)
        for p in T.unroll(planes):
            for s in T.unroll(size):
                xlo: T.let = T.reinterpret("int8x32", T.broadcast(xq4[p, t0 + s, b * 8 + v * 2], ROWS))
                xhi: T.let = T.reinterpret("int8x32", T.broadcast(xq4[p, t0 + s, b * 8 + v * 2 + 1], ROWS))
                at: T.let = ((p * size + s) * 2 + (v // 2 if halves == 2 else 0)) * ROWS
                if vnni:
                    if halves == 2:
                        iacc[T.ramp(at, 1, ROWS)] = _intrin(_DPBUSD, "int32x8", _intrin(
                            _DPBUSD, "int32x8", iacc[T.ramp(at, 1, ROWS)], low, xlo), hig, xhi)
                    else:
                        iacc[T.ramp(at, 1, ROWS)] = _intrin(_DPBUSD, "int32x8", iacc[T.ramp(at, 1, ROWS)],
                                                            low, xlo)
                        iacc[T.ramp(at + ROWS, 1, ROWS)] = _intrin(_DPBUSD, "int32x8",
                                                                   iacc[T.ramp(at + ROWS, 1, ROWS)], hig, xhi)
                elif codebook:  # codes up to 241: as 16 x (code >> 4) + (code & 15), each within int16
                    a3: T.let = at + v % 2 * ROWS
                    iacc[T.ramp(a3, 1, ROWS)] = iacc[T.ramp(a3, 1, ROWS)] + T.shift_left(_intrin(
                        _MADDWD, "int32x8", _intrin(_MADDUBS, "int16x16", _nibble(low, 1), xlo)
                        + _intrin(_MADDUBS, "int16x16", _nibble(hig, 1), xhi), T.broadcast(T.int16(1), 16)),
                        T.broadcast(T.int32(4), ROWS)) + _intrin(
                        _MADDWD, "int32x8", _intrin(_MADDUBS, "int16x16", _nibble(low, 0), xlo)
                        + _intrin(_MADDUBS, "int16x16", _nibble(hig, 0), xhi), T.broadcast(T.int16(1), 16))
                else:
                    a2: T.let = at + (0 if halves == 2 else v % 2 * ROWS)
                    iacc[T.ramp(a2, 1, ROWS)] = iacc[T.ramp(a2, 1, ROWS)] + _intrin(
                        _MADDWD, "int32x8", _intrin(_MADDUBS, "int16x16", low, xlo)
                        + _intrin(_MADDUBS, "int16x16", hig, xhi), T.broadcast(T.int16(1), 16))
    sv0: T.let = _scale(dd, sc, g, b, 0, superblock, sc_type)
    sv1: T.let = _scale(dd, sc, g, b, halves - 1, superblock, sc_type)
    for s in T.unroll(size):
        xdv: T.let = T.broadcast(xd[t0 + s, b], ROWS)
        facc[T.ramp(s * ROWS, 1, ROWS)] = _block_sum(
            facc, s, (_sums(iacc, s, size, 0, planes), _sums(iacc, s, size, 1, planes)) if halves == 2 else (
                _sums(iacc, s, size, 0, planes) + _sums(iacc, s, size, 1, planes), None), (sv0, sv1), xdv, xs,
            xc, t0, b, off, halves, min_kind, mm, dmin, mq, g)


@T.macro
def _tile(y, xq4, xd, xs, xc, t0, size, g, blocks, out_features, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc,
          planes, hb, halves, off, superblock, sc_type, min_kind, vnni, codebook):
    """``y[t0 + s, 8 g: 8 g + 8]`` for the ``size`` tokens of a tile (module doc). ``iacc``: int32, 8 lanes per
    (plane, token, accumulator); accumulator ``h`` is the sub-block (Q6_K) or, with one scale a block, the low
    (high) nibbles with VNNI, the even (odd) vectors on AVX2."""
    for s in T.unroll(size):
        facc[T.ramp(s * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
    for b in range(blocks):
        _tile_block(xq4, xd, xs, xc, t0, size, g, b, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc, planes, hb,
                    halves, off, superblock, sc_type, min_kind, vnni, codebook)
    _store(y, facc, t0, size, g, out_features)


@T.macro
def _tile_both(y, xq4, xd, xs, xc, t0, size, g, blocks, out_features, codes, high, dd, sc, mm, dmin, mq, lut, iacc,
               facc, facc2, planes, hb, halves, off, superblock, sc_type, min_kind, vnni, codebook, ahead=0):
    """``_tile`` on row groups ``g`` and ``g + 1`` (a pair: one stream in the interleaved layout), block by block
    (group ``g``'s block, then ``g + 1``'s): each group's operations are ``_tile``'s, in its order, so its outputs
    are bitwise ``_tile``'s. ``facc2``: group ``g + 1``'s float sums; the integer ones (``iacc``, zeroed at each
    block's start and added to the float sums at its end) are shared, which keeps AVX2's 16 registers enough."""
    for s in T.unroll(size):
        facc[T.ramp(s * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
        facc2[T.ramp(s * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
    for b in range(blocks):
        if ahead > 0:
            _pair_prefetch(g, b, blocks, ahead, codes, high, dd, sc, mm, dmin, mq, hb, halves, superblock, min_kind)
        _tile_block(xq4, xd, xs, xc, t0, size, g, b, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc, planes, hb,
                    halves, off, superblock, sc_type, min_kind, vnni, codebook)
        _tile_block(xq4, xd, xs, xc, t0, size, g + 1, b, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc2,
                    planes, hb, halves, off, superblock, sc_type, min_kind, vnni, codebook)
    _store(y, facc, t0, size, g, out_features)
    _store(y, facc2, t0, size, g + 1, out_features)


def _offset_sum(xc: Any, t: Any, bh: Any, off: int) -> Any:
    """int32 ``-off x`` token ``t``'s code sum over sub-block ``bh`` (``xc``; 0 without an offset)."""
    return xc[t, bh] if off else T.int32(0)


def _wide_sum(iacc: Any, s: Any, h: int, size: int, planes: int, halves: int, lanes: int = ROWS) -> Any:
    """int32x8 block sums of token ``s`` of a wide tile, sub-block ``h`` (the planes joined; with one scale a block,
    ``h`` 1 is nothing; ``lanes`` 16: a pair tile's two row groups)."""
    if h >= halves:
        return None
    at = (s * halves + h) * lanes
    if planes == 1:
        return iacc[T.ramp(at, 1, lanes)]
    return T.shift_left(iacc[T.ramp(at, 1, lanes)], T.broadcast(T.int32(8), lanes)) + iacc[
        T.ramp(at + size * halves * lanes, 1, lanes)]


@T.macro
def _wide_tile(y, xq4, xd, xs, xc, t0, size, g, blocks, out_features, codes, high, dd, sc, mm, dmin, mq, lut, iacc,
               facc, planes, hb, halves, off, superblock, sc_type, min_kind, codebook):
    """``_tile``'s VNNI tile for more tokens (``wide_tile``): one accumulator per plane, token and sub-block (the low
    and the high nibbles into the same one: 16 of the 32 vector registers for 8 tokens and two planes), the codes
    rebuilt once for all the tile's tokens, and the offset put in the low plane's accumulator before the block (its
    ``-off x`` code sum) instead of taken off after it. The int32 block sums are ``_tile``'s exactly and the float
    operations after them the same (``_block_sum``), so a token's row is bitwise the same in either tile."""
    for s in T.unroll(size):
        facc[T.ramp(s * ROWS, 1, ROWS)] = T.broadcast(T.float32(0), ROWS)
    for b in range(blocks):
        for a in T.unroll((planes - 1) * size * halves):
            iacc[T.ramp(a * ROWS, 1, ROWS)] = T.broadcast(T.int32(0), ROWS)
        for a in T.unroll(size * halves):  # the low plane's (the only one with 8-bit codes)
            iacc[T.ramp(((planes - 1) * size * halves + a) * ROWS, 1, ROWS)] = T.broadcast(
                _offset_sum(xc, t0 + a // halves, b * halves + a % halves, off), ROWS)
        for v in T.unroll(4):
            raw: T.let = _run(codes, g, b, v * 32, 32, "uint8", False)
            low: T.let = _codes(raw, high, lut, g, b, v, 0, hb, codebook)
            hig: T.let = _codes(raw, high, lut, g, b, v, 1, hb, codebook)
            for p in T.unroll(planes):
                for s in T.unroll(size):
                    at: T.let = ((p * size + s) * halves + (v // 2 if halves == 2 else 0)) * ROWS
                    iacc[T.ramp(at, 1, ROWS)] = _intrin(_DPBUSD, "int32x8", _intrin(
                        _DPBUSD, "int32x8", iacc[T.ramp(at, 1, ROWS)], low, T.reinterpret(
                            "int8x32", T.broadcast(xq4[p, t0 + s, b * 8 + v * 2], ROWS))), hig, T.reinterpret(
                        "int8x32", T.broadcast(xq4[p, t0 + s, b * 8 + v * 2 + 1], ROWS)))
        sv0: T.let = _scale(dd, sc, g, b, 0, superblock, sc_type)
        sv1: T.let = _scale(dd, sc, g, b, halves - 1, superblock, sc_type)
        for s in T.unroll(size):
            facc[T.ramp(s * ROWS, 1, ROWS)] = _block_sum(
                facc, s, (_wide_sum(iacc, s, 0, size, planes, halves), _wide_sum(iacc, s, 1, size, planes, halves)),
                (sv0, sv1), T.broadcast(xd[t0 + s, b], ROWS), xs, xc, t0, b, 0, halves, min_kind, mm, dmin, mq, g)
    _store(y, facc, t0, size, g, out_features)


@T.macro
def _pair_vector(xq4, xc, t0, size, g, b, v, codes, high, lut, iacc, planes, hb, halves, off, codebook, first, bh):
    """A pair tile's ``vpdpbusd``s for vector ``v`` of block ``b``: its codes rebuilt once, then per activation
    plane and token the low and the high nibbles' products into the token's accumulator for the vector's
    sub-block (``halves`` accumulators a token), which the ``first`` vector of a sub-block starts from the low
    plane's ``-off x`` code sum of sub-block ``bh`` (0 for the high plane)."""
    raw: T.let = _run(codes, g, b, v * 32, 32, "uint8", True)
    low: T.let = _codes(raw, high, lut, g, b, v, 0, hb, codebook, True)
    hig: T.let = _codes(raw, high, lut, g, b, v, 1, hb, codebook, True)
    for p in T.unroll(planes):
        for s in T.unroll(size):
            at: T.let = ((p * size + s) * halves + (v // 2 if halves == 2 else 0)) * _PAIR
            iacc[T.ramp(at, 1, _PAIR)] = _intrin(_DPBUSD_512, "int32x16", _intrin(
                _DPBUSD_512, "int32x16", T.if_then_else(
                    first, T.broadcast(T.Select(p == planes - 1, _offset_sum(xc, t0 + s, bh, off), 0), _PAIR),
                    iacc[T.ramp(at, 1, _PAIR)]), low, T.reinterpret(
                    "int8x64", T.broadcast(xq4[p, t0 + s, b * 8 + v * 2], _PAIR))), hig, T.reinterpret(
                "int8x64", T.broadcast(xq4[p, t0 + s, b * 8 + v * 2 + 1], _PAIR)))


def _dot4(acc: Any, xq4: Any, p: int, t: Any, at: Any, *codes: Any) -> Any:
    """``acc`` plus the ``vpdpbusd`` products of the four code vectors ``codes`` (16 lanes) with token ``t``'s
    activation plane ``p``, 4 bytes each from ``xq4[p, t, at]`` on."""
    for i, code in enumerate(codes):
        acc = _intrin(_DPBUSD_512, "int32x16", acc, code, T.reinterpret("int8x64", T.broadcast(
            xq4[p, t, at + i], _PAIR)))
    return acc


@T.macro
def _serial_sub_block(xq4, xc, t0, size, g, b, h, codes, high, lut, iacc, planes, hb, off, codebook):
    """A serial pair tile's sub-block ``h`` of block ``b`` (vectors ``2 h`` and ``2 h + 1``, their codes rebuilt
    once) into one accumulator a token: with two planes the high plane's products first, then the sum shifted by 8
    bits, the offset's ``-off x`` code sum added and the low plane's products on top: the same exact int32 sum as
    ``_wide_sum``'s joined planes, in half the registers."""
    raw0: T.let = _run(codes, g, b, 2 * h * 32, 32, "uint8", True)
    low0: T.let = _codes(raw0, high, lut, g, b, 2 * h, 0, hb, codebook, True)
    hig0: T.let = _codes(raw0, high, lut, g, b, 2 * h, 1, hb, codebook, True)
    raw1: T.let = _run(codes, g, b, (2 * h + 1) * 32, 32, "uint8", True)
    low1: T.let = _codes(raw1, high, lut, g, b, 2 * h + 1, 0, hb, codebook, True)
    hig1: T.let = _codes(raw1, high, lut, g, b, 2 * h + 1, 1, hb, codebook, True)
    if planes == 2:
        for s in T.unroll(size):
            iacc[T.ramp(s * _PAIR, 1, _PAIR)] = _dot4(T.broadcast(T.int32(0), _PAIR), xq4, 0, t0 + s, b * 8 + h * 4,
                                                      low0, hig0, low1, hig1)
    for s in T.unroll(size):
        start: T.let = T.broadcast(_offset_sum(xc, t0 + s, b * 2 + h, off), _PAIR)
        iacc[T.ramp(s * _PAIR, 1, _PAIR)] = _dot4(start + T.shift_left(iacc[T.ramp(s * _PAIR, 1, _PAIR)], T.broadcast(
            T.int32(8), _PAIR)) if planes == 2 else start, xq4, planes - 1, t0 + s, b * 8 + h * 4, low0, hig0, low1,
            hig1)


@T.macro
def _one_acc_block(xq4, xc, t0, size, g, b, codes, high, lut, iacc, hb, off, codebook):
    """``_serial_sub_block`` for a whole block of one scale (16-bit codes): its 4 vectors' codes rebuilt once, the
    high plane's products of every token first, then each token's sum shifted by 8 bits, its offset added and the
    low plane's products on top: ``_wide_sum``'s joined int32 sums, in one accumulator a token."""
    raw0: T.let = _run(codes, g, b, 0, 32, "uint8", True)
    low0: T.let = _codes(raw0, high, lut, g, b, 0, 0, hb, codebook, True)
    hig0: T.let = _codes(raw0, high, lut, g, b, 0, 1, hb, codebook, True)
    raw1: T.let = _run(codes, g, b, 32, 32, "uint8", True)
    low1: T.let = _codes(raw1, high, lut, g, b, 1, 0, hb, codebook, True)
    hig1: T.let = _codes(raw1, high, lut, g, b, 1, 1, hb, codebook, True)
    raw2: T.let = _run(codes, g, b, 64, 32, "uint8", True)
    low2: T.let = _codes(raw2, high, lut, g, b, 2, 0, hb, codebook, True)
    hig2: T.let = _codes(raw2, high, lut, g, b, 2, 1, hb, codebook, True)
    raw3: T.let = _run(codes, g, b, 96, 32, "uint8", True)
    low3: T.let = _codes(raw3, high, lut, g, b, 3, 0, hb, codebook, True)
    hig3: T.let = _codes(raw3, high, lut, g, b, 3, 1, hb, codebook, True)
    for s in T.unroll(size):
        iacc[T.ramp(s * _PAIR, 1, _PAIR)] = _dot4(_dot4(T.broadcast(T.int32(0), _PAIR), xq4, 0, t0 + s, b * 8,
                                                        low0, hig0, low1, hig1), xq4, 0, t0 + s, b * 8 + 4,
                                                  low2, hig2, low3, hig3)
    for s in T.unroll(size):
        start: T.let = T.broadcast(_offset_sum(xc, t0 + s, b, off), _PAIR) + T.shift_left(
            iacc[T.ramp(s * _PAIR, 1, _PAIR)], T.broadcast(T.int32(8), _PAIR))
        iacc[T.ramp(s * _PAIR, 1, _PAIR)] = _dot4(_dot4(start, xq4, 1, t0 + s, b * 8, low0, hig0, low1, hig1), xq4, 1,
                                                  t0 + s, b * 8 + 4, low2, hig2, low3, hig3)


@T.macro
def _pair_tile(y, xq4, xd, xs, xc, t0, size, g, blocks, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc, planes,
               hb, halves, off, superblock, sc_type, min_kind, codebook, serial, ahead=0):
    """``_wide_tile`` for the 16 rows of row groups ``g`` and ``g + 1`` (both whole) in 512-bit vectors: lanes 0-7
    group ``g``'s rows, 8-15 group ``g + 1``'s; each ``vpdpbusd`` takes a token's 4 activation bytes broadcast from
    memory to 16 rows instead of 8, so a block's loads are about half the 256-bit tile's (on Zen 4 the broadcast
    loads, two a cycle, were as much a limit as the multiply pipes). The same exact int32 sums and, lane by lane,
    the same float operations (``_block_sum``), so a row's output is bitwise that of the 8-row tiles. ``serial``
    (two scales a block: Q6_K): the block's sub-blocks one after the other through the same accumulators, each
    added to the float sums as it ends (the same two additions in the same order as ``_block_sum``'s), so that
    the tile holds twice the tokens and each vector's codes are rebuilt once for all of them."""
    for s in T.unroll(size):
        facc[T.ramp(s * _PAIR, 1, _PAIR)] = T.broadcast(T.float32(0), _PAIR)
    for b in range(blocks):
        if ahead > 0:
            _pair_prefetch(g, b, blocks, ahead, codes, high, dd, sc, mm, dmin, mq, hb, halves, superblock, min_kind)
        if serial:
            for h in T.unroll(2):
                _serial_sub_block(xq4, xc, t0, size, g, b, h, codes, high, lut, iacc, planes, hb, off, codebook)
                sv: T.let = _scale(dd, sc, g, b, h, superblock, sc_type, True)
                for s in T.unroll(size):  # xd of the second sub-block from its copy in xs (no min: module doc)
                    facc[T.ramp(s * _PAIR, 1, _PAIR)] = facc[T.ramp(s * _PAIR, 1, _PAIR)] + T.Cast(
                        f"float32x{_PAIR}", iacc[T.ramp(s * _PAIR, 1, _PAIR)]) * (sv * T.broadcast(
                            T.if_then_else(h == 0, xd[t0 + s, b], xs[t0 + s, b]), _PAIR))
        elif planes == 2 and hb == 1 and min_kind == 2:  # Q5_K only (module doc)
            _one_acc_block(xq4, xc, t0, size, g, b, codes, high, lut, iacc, hb, off, codebook)
            sv: T.let = _scale(dd, sc, g, b, 0, superblock, sc_type, True)
            for s in T.unroll(size):
                facc[T.ramp(s * _PAIR, 1, _PAIR)] = _block_sum(
                    facc, s, (iacc[T.ramp(s * _PAIR, 1, _PAIR)], None), (sv, sv), T.broadcast(xd[t0 + s, b], _PAIR),
                    xs, xc, t0, b, 0, halves, min_kind, mm, dmin, mq, g, True)
        else:
            for v in T.unroll(4):
                _pair_vector(xq4, xc, t0, size, g, b, v, codes, high, lut, iacc, planes, hb, halves, off, codebook,
                             v % 2 == 0 if halves == 2 else v == 0, b * halves + v // 2)
            sv0: T.let = _scale(dd, sc, g, b, 0, superblock, sc_type, True)
            sv1: T.let = _scale(dd, sc, g, b, halves - 1, superblock, sc_type, True)
            for s in T.unroll(size):
                facc[T.ramp(s * _PAIR, 1, _PAIR)] = _block_sum(
                    facc, s, (_wide_sum(iacc, s, 0, size, planes, halves, _PAIR),
                              _wide_sum(iacc, s, 1, size, planes, halves, _PAIR)),
                    (sv0, sv1), T.broadcast(xd[t0 + s, b], _PAIR), xs, xc, t0, b, 0, halves, min_kind, mm, dmin, mq,
                    g, True)
    for s in T.unroll(size):
        y[t0 + s, T.ramp(g * ROWS, 1, _PAIR)] = T.Cast(f"{y.dtype}x{_PAIR}", facc[T.ramp(s * _PAIR, 1, _PAIR)])


def wide_tile(vnni: bool) -> bool:
    """Whether ``quant_matmul_kernel`` runs wide tiles (``_wide_tile``): with the VNNI tile (32 vector registers)."""
    return vnni


def _wide_span(wide_tokens: int, halves: int, vnni: bool) -> int:
    """The tokens of a kernel's wide tiles, or, where it has none, ``_SPAN + 1`` (more than a span holds); raises
    ValueError unless ``wide_tokens`` is 0 (none) to ``_SPAN``."""
    if not 0 <= wide_tokens <= _SPAN:
        raise ValueError(f"wide_tokens must be 0 to {_SPAN}, got {wide_tokens}")
    return wide_tokens // halves if wide_tile(vnni) and wide_tokens // halves else _SPAN + 1


@T.macro
def _code_sums(xq, xc, t, blocks, halves, planes, off):
    """``xc[t, b h]``: ``-off x`` token ``t``'s integer codes summed per sub-block (32 / ``halves`` codes): what
    the offset takes off the sub-block's integer sums, ready to be broadcast from memory (no integer work per
    tile and token)."""
    for bh in range(blocks * halves):
        xc[t, bh] = 0
        for j in range(QBLOCK // halves):
            if planes == 1:
                xc[t, bh] = xc[t, bh] + T.Cast("int32", xq[0, t, bh * (QBLOCK // halves) + j])
            else:
                xc[t, bh] = xc[t, bh] + T.Cast("int32", xq[0, t, bh * (QBLOCK // halves) + j]) * 256 + T.Cast(
                    "int32", xq[1, t, bh * (QBLOCK // halves) + j])
        xc[t, bh] = xc[t, bh] * -off


def _validate(layout: QuantLayout, out_features: int, in_features: int, x_dtype: str, y_dtype: str,
              xbits: int) -> None:
    layout.shapes(out_features, in_features)  # raises on a bad shape
    _check(layout.ggml, in_features, out_features, x_dtype, y_dtype, xbits)


@functools.cache
def quant_matmul_kernel(layout: QuantLayout, out_features: int, in_features: int, x_dtype: str = "float32",
                        y_dtype: str = "float32", xbits: int = DEFAULT_ACTIVATION_BITS,
                        vnni: bool = False, wide_tokens: int = WIDE_TILE,
                        serial_pairs: bool = True, few_pairs: bool = True,
                        prefetch: int = PAIR_PREFETCH) -> tirx.PrimFunc:
    """``y[t, o] = sum_k x[t, k] * W[o, k]`` (module doc) for ``x[n, K]`` of ``x_dtype`` and ``y[n, N]`` of
    ``y_dtype`` (float32 or float16); parameters ``x``, the packed arrays (``layout.shapes``), ``y``. ``xbits``:
    the activation codes' bits (8 or 16); ``vnni``: the AVX512-VNNI tile (else AVX2; the same outputs);
    ``wide_tokens``: the tokens of a ``_wide_tile`` where the kernel has them (``wide_tile``; 0: none; the same
    outputs); ``serial_pairs``: with two scales a block (Q6_K), pair tiles of ``wide_tokens`` tokens taking a
    block's sub-blocks one after the other (``_pair_tile``'s ``serial``) instead of half as many tokens (the same
    outputs); ``few_pairs``: calls of 1 to ``wide_tokens - 1`` tokens run pair tiles of 3 (or 4), 2 and 1 tokens on
    the pairs of whole row groups, as wider calls do after their wide tiles run out, instead of the narrow tiles on
    each group (the same outputs); ``prefetch``: the blocks ahead that those pair tiles prefetch (0: none; the same
    outputs)."""
    _validate(layout, out_features, in_features, x_dtype, y_dtype, xbits)
    if prefetch < 0:
        raise ValueError(f"prefetch must be 0 or more blocks, got {prefetch}")
    # past a span where the kernel has none; half as many tokens with two sub-blocks a block (as many accumulators)
    wtile = _wide_span(wide_tokens, layout.halves, vnni)
    N, K, blocks, groups = out_features, in_features, in_features // QBLOCK, -(-out_features // ROWS)
    planes, qmax, tile = (1, _QMAX, _TILE) if xbits == 8 else (2, SPLIT_QMAX, _SPLIT_TILE)
    hb, halves, off, superblock = layout.high_planes, layout.halves, layout.offset, layout.superblock
    sc_type, min_kind, codebook = layout.sc_dtype, _MIN_KINDS[layout.min], bool(layout.codebook)
    xc_width = blocks * halves if off else 1
    wide = wtile <= _SPAN
    # the work in units of two whole row groups (``_pair_tile``, where the kernel has wide tiles), then one each
    pairs = N // ROWS // 2 if wide else 0
    both = N // ROWS // 2  # pairs of whole row groups (``_tile_both`` for one token where it has no pair tiles)
    units = groups - pairs
    chunks = min(_CHUNKS, groups)  # some idle in the pair tiles where there are fewer than 64 units
    iacc_len = max(planes * tile * 2, planes * wtile * halves if wide else 0) * ROWS
    facc_len = max(tile, wtile if wide else 0) * ROWS
    # a pair tile's tokens: twice the wide tile's where the sub-blocks go one after the other (then as many
    # accumulators), then at most one tile of ``wtile`` side by side
    serial = serial_pairs and halves == 2 and pairs > 0
    ptile = 2 * wtile if serial else wtile
    pacc_len, pfacc_len = (planes * wtile * halves * _PAIR, ptile * _PAIR) if pairs else (_PAIR, _PAIR)

    @T.macro
    def quantise(x, xq, xd, xs, xc, t, amax):
        _quantise(x, xq, xd, xs, t, blocks, amax, qmax)
        if halves == 2:  # no min (Q6_K): xs a copy of xd for the serial pair tiles (module doc)
            for b in range(blocks):
                xs[t, b] = xd[t, b]
        if off != 0:
            _code_sums(xq, xc, t, blocks, halves, planes, off)

    @T.macro
    def narrow(y, xq4, xd, xs, xc, t0, size, g, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc):
        _tile(y, xq4, xd, xs, xc, t0, size, g, blocks, N, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc,
              planes, hb, halves, off, superblock, sc_type, min_kind, vnni, codebook)

    @T.macro
    def rest(y, xq4, xd, xs, xc, t0, t1, g, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc):
        """Row group ``g``'s tokens ``t0`` to ``t1`` (those after the wide tiles): tiles of ``tile``, 2 and 1."""
        for tt in range((t1 - t0) // tile):
            narrow(y, xq4, xd, xs, xc, t0 + tt * tile, tile, g, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc)
        if (t1 - t0) % tile >= 2:
            narrow(y, xq4, xd, xs, xc, t1 - (t1 - t0) % tile, 2, g, codes, high, dd, sc, mm, dmin, mq, lut, iacc,
                   facc)
        if (t1 - t0) % tile % 2 == 1:
            narrow(y, xq4, xd, xs, xc, t1 - 1, 1, g, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc)

    @T.macro
    def pair_tile(y, xq4, xd, xs, xc, t0, size, g, codes, high, dd, sc, mm, dmin, mq, lut, pacc, pfacc):
        _pair_tile(y, xq4, xd, xs, xc, t0, size, g, blocks, codes, high, dd, sc, mm, dmin, mq, lut, pacc, pfacc,
                   planes, hb, halves, off, superblock, sc_type, min_kind, codebook, False, prefetch)

    @T.macro
    def pair_rest(y, xq4, xd, xs, xc, t0, n, g, codes, high, dd, sc, mm, dmin, mq, lut, pacc, pfacc):
        """Row groups ``g`` and ``g + 1``'s ``n`` tokens from ``t0`` on (fewer than a wide tile): up to 7 in one
        pair tile of them all (one pass over the pair's weights), more (a kernel with wider wide tiles) in tiles of
        ``tile``, 2 and 1."""
        if n == 1:
            pair_tile(y, xq4, xd, xs, xc, t0, 1, g, codes, high, dd, sc, mm, dmin, mq, lut, pacc, pfacc)
        if wtile > 2:
            if n == 2:
                pair_tile(y, xq4, xd, xs, xc, t0, 2, g, codes, high, dd, sc, mm, dmin, mq, lut, pacc, pfacc)
        if wtile > 3:
            if n == 3:
                pair_tile(y, xq4, xd, xs, xc, t0, 3, g, codes, high, dd, sc, mm, dmin, mq, lut, pacc, pfacc)
        if wtile > 4:
            if n == 4:
                pair_tile(y, xq4, xd, xs, xc, t0, 4, g, codes, high, dd, sc, mm, dmin, mq, lut, pacc, pfacc)
        if wtile > 5:
            if n == 5:
                pair_tile(y, xq4, xd, xs, xc, t0, 5, g, codes, high, dd, sc, mm, dmin, mq, lut, pacc, pfacc)
        if wtile > 6:
            if n == 6:
                pair_tile(y, xq4, xd, xs, xc, t0, 6, g, codes, high, dd, sc, mm, dmin, mq, lut, pacc, pfacc)
        if wtile > 7:
            if n == 7:
                pair_tile(y, xq4, xd, xs, xc, t0, 7, g, codes, high, dd, sc, mm, dmin, mq, lut, pacc, pfacc)
        if wtile > 8:
            if n >= 8:
                for tt in range(n // tile):
                    pair_tile(y, xq4, xd, xs, xc, t0 + tt * tile, tile, g, codes, high, dd, sc, mm, dmin, mq, lut,
                              pacc, pfacc)
                if n % tile >= 2:
                    pair_tile(y, xq4, xd, xs, xc, t0 + n - n % tile, 2, g, codes, high, dd, sc, mm, dmin, mq, lut,
                              pacc, pfacc)
                if n % tile % 2 == 1:
                    pair_tile(y, xq4, xd, xs, xc, t0 + n - 1, 1, g, codes, high, dd, sc, mm, dmin, mq, lut, pacc,
                              pfacc)

    @T.macro
    def spans(y, n, xq4, xd, xs, xc, chunk, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc, pacc, pfacc):
        """Chunk ``chunk``'s units, span by span: the wide tiles first (on a pair of row groups where the kernel
        has pairs), then tiles of ``tile``, 2 and 1 on each group."""
        for span in range((n + _SPAN - 1) // _SPAN):
            t1: T.let = T.min(n, span * _SPAN + _SPAN)
            t0: T.let = span * _SPAN + (t1 - span * _SPAN) // wtile * wtile
            for u in range(chunk * units // chunks, (chunk + 1) * units // chunks):
                if u < pairs:
                    # the first tile of a span reads the pair from memory: it prefetches (the others find it in
                    # cache, where the prefetches cost time: module doc)
                    if t1 - span * _SPAN >= ptile:
                        _pair_tile(y, xq4, xd, xs, xc, span * _SPAN, ptile, 2 * u, blocks, codes, high, dd, sc, mm,
                                   dmin, mq, lut, pacc, pfacc, planes, hb, halves, off, superblock, sc_type, min_kind,
                                   codebook, serial, prefetch)
                    for tt in range(1, (t1 - span * _SPAN) // ptile):
                        _pair_tile(y, xq4, xd, xs, xc, span * _SPAN + tt * ptile, ptile, 2 * u, blocks, codes, high,
                                   dd, sc, mm, dmin, mq, lut, pacc, pfacc, planes, hb, halves, off, superblock,
                                   sc_type, min_kind, codebook, serial)
                    if serial:
                        if (t1 - span * _SPAN) % ptile >= wtile:
                            _pair_tile(y, xq4, xd, xs, xc, t0 - wtile, wtile, 2 * u, blocks, codes, high, dd, sc, mm,
                                       dmin, mq, lut, pacc, pfacc, planes, hb, halves, off, superblock, sc_type,
                                       min_kind, codebook, False)
                    pair_rest(y, xq4, xd, xs, xc, t0, t1 - t0, 2 * u, codes, high, dd, sc, mm, dmin, mq, lut, pacc,
                              pfacc)
                else:
                    if wide:
                        for tt in range((t1 - span * _SPAN) // wtile):
                            _wide_tile(y, xq4, xd, xs, xc, span * _SPAN + tt * wtile, wtile, u + pairs, blocks, N,
                                       codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc, planes, hb, halves, off,
                                       superblock, sc_type, min_kind, codebook)
                    rest(y, xq4, xd, xs, xc, t0, t1, u + pairs, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc)

    @T.macro
    def body(x, y, n, codes, high, dd, sc, mm, dmin, mq, lut):
        xq = T.alloc_buffer((planes, n, K + ROW_PAD), "int8")
        xq4 = T.decl_buffer((planes, n, (K + ROW_PAD) // 4), "int32", data=xq.data)
        xd = T.alloc_buffer((n, blocks), "float32")
        xs = T.alloc_buffer((n, blocks), "float32")
        xc = T.alloc_buffer((n, xc_width), "int32")
        if n >= 16:
            for t in T.parallel(n):
                amax = T.alloc_buffer((16,), "float32", scope="local")
                quantise(x, xq, xd, xs, xc, t, amax)
        else:
            amax = T.alloc_buffer((16,), "float32", scope="local")
            for t in range(n):
                quantise(x, xq, xd, xs, xc, t, amax)
        # two parallel loops, so two functions: the few tokens' one keeps its registers (in one function with the
        # pair tiles, LLVM spilled pointers and constants in its loops: one token 10-20% slower)
        if n >= wtile:
            for chunk in T.parallel(chunks):
                iacc = T.alloc_buffer((iacc_len,), "int32", scope="local")
                facc = T.alloc_buffer((facc_len,), "float32", scope="local")
                # the pair tiles' own (16-lane vectors only: LLVM keeps them in registers)
                pacc = T.alloc_buffer((pacc_len,), "int32", scope="local")
                pfacc = T.alloc_buffer((pfacc_len,), "float32", scope="local")
                spans(y, n, xq4, xd, xs, xc, chunk, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc, pacc, pfacc)
        elif pairs > 0 and few_pairs:
            # 1 to wtile - 1 tokens: pair tiles of few tokens, prefetching (module doc), then the groups alone
            for chunk in T.parallel(chunks):
                iacc = T.alloc_buffer((iacc_len,), "int32", scope="local")
                facc = T.alloc_buffer((facc_len,), "float32", scope="local")
                pacc = T.alloc_buffer((pacc_len,), "int32", scope="local")
                pfacc = T.alloc_buffer((pfacc_len,), "float32", scope="local")
                for u in range(chunk * units // chunks, (chunk + 1) * units // chunks):
                    if u < pairs:
                        pair_rest(y, xq4, xd, xs, xc, 0, n, 2 * u, codes, high, dd, sc, mm, dmin, mq, lut, pacc,
                                  pfacc)
                    else:
                        rest(y, xq4, xd, xs, xc, 0, n, u + pairs, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc)
        elif n == 1 and both > 0:  # one token on the narrow tiles: a pair of groups at a time (one stream)
            for chunk in T.parallel(chunks):
                iacc = T.alloc_buffer((iacc_len,), "int32", scope="local")
                facc = T.alloc_buffer((facc_len,), "float32", scope="local")
                facc2 = T.alloc_buffer((facc_len,), "float32", scope="local")
                for u in range(chunk * (groups - both) // chunks, (chunk + 1) * (groups - both) // chunks):
                    if u < both:
                        _tile_both(y, xq4, xd, xs, xc, 0, 1, 2 * u, blocks, N, codes, high, dd, sc, mm, dmin, mq, lut,
                                   iacc, facc, facc2, planes, hb, halves, off, superblock, sc_type, min_kind,
                                   vnni, codebook, prefetch)
                    else:
                        narrow(y, xq4, xd, xs, xc, 0, 1, u + both, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc)
        else:  # fewer tokens than a wide tile: each chunk's row groups one by one
            for chunk in T.parallel(chunks):
                iacc = T.alloc_buffer((iacc_len,), "int32", scope="local")
                facc = T.alloc_buffer((facc_len,), "float32", scope="local")
                for g in range(chunk * groups // chunks, (chunk + 1) * groups // chunks):
                    rest(y, xq4, xd, xs, xc, 0, n, g, codes, high, dd, sc, mm, dmin, mq, lut, iacc, facc)

    _codes_, _high, _d, _sc, _m, _dmin, _mq, _lut = _param_shapes(layout, N, K)

    @T.prim_func(private=True)
    def quant_matmul(var_x: T.handle, codes: T.Buffer(*_codes_), high: T.Buffer(*_high),
                     d: T.Buffer(*_d), sc: T.Buffer(*_sc), m: T.Buffer(*_m),
                     dmin: T.Buffer(*_dmin), mq: T.Buffer(*_mq), lut: T.Buffer(*_lut), var_y: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, K), x_dtype)
        y = T.match_buffer(var_y, (n, N), y_dtype)
        body(x, y, n, codes, high, d, sc, m, dmin, mq, lut)

    return _drop_unused(quant_matmul, layout)


def _param_shapes(layout: QuantLayout, out_features: int, in_features: int) -> list[tuple[Any, str]]:
    """(shape, dtype) of each of ``_ARRAYS``; a layout's absent arrays get a placeholder (``_drop_unused``)."""
    shapes = {suffix: (shape, dtype) for suffix, shape, dtype in layout.shapes(out_features, in_features)}
    return [shapes.get(suffix, ((1,), "uint8")) for suffix in _ARRAYS]


def _drop_unused(func: tirx.PrimFunc, layout: QuantLayout) -> tirx.PrimFunc:
    """``func`` (parameters: the input, ``_ARRAYS``, the output) without the arrays ``layout`` does not have (never
    read by its body)."""
    present = {suffix for suffix, _, _ in layout.shapes(ROWS, layout.block_weights)}
    params = list(func.params)
    keep = [params[0], *(p for p, suffix in zip(params[1:-1], _ARRAYS, strict=True) if suffix in present),
            params[-1]]
    return tirx.PrimFunc(keep, func.body, func.ret_type, func.attrs)


@functools.cache
def quant_embed_kernel(layout: QuantLayout, vocab: int, hidden: int) -> tirx.PrimFunc:
    """``out[t, h] = W[ids[t], h]`` (float32, ``S * (q - off) + M``) from the packed layout: parameters ``ids``
    int32 ``[n]``, the packed arrays, ``out``."""
    _codes_, _high, _d, _sc, _m, _dmin, _mq, _lut = _param_shapes(layout, vocab, hidden)
    hb, halves, off, superblock = layout.high_planes, layout.halves, layout.offset, layout.superblock
    min_kind = _MIN_KINDS[layout.min]

    def code(codes: Any, high: Any, lut: Any, g: Any, r: Any, h: Any) -> Any:
        b, j = h // QBLOCK, h % QBLOCK
        v, half, jj = j // 8, j % 8 // 4, j % 4
        q = T.bitwise_and(T.shift_right(_elem(codes, g, b, v * 32 + r * 4 + jj, 32), T.Cast("uint8", half * 4)),
                          T.uint8(15))
        p = 2 * v + half
        if hb == 1:
            q = T.bitwise_or(q, T.shift_left(T.bitwise_and(T.shift_right(
                _elem(high, g, b, r * 4 + jj, 32), T.Cast("uint8", p)), T.uint8(1)), T.uint8(4)))
        elif hb == 2:
            q = T.bitwise_or(q, T.shift_left(T.bitwise_and(T.shift_right(
                _elem(high, g, b, QBLOCK * (p // 4) + r * 4 + jj, 32), T.Cast("uint8", 2 * (p % 4))), T.uint8(3)),
                T.uint8(4)))
        return T.Cast("float32", lut[q] if layout.codebook else q)

    def weight(codes: Any, high: Any, dd: Any, sc: Any, mm: Any, dmin: Any, mq: Any, lut: Any, row: Any,
               h: Any) -> Any:
        g, r, b = row // ROWS, row % ROWS, h // QBLOCK
        s = (T.Cast("float32", _elem(dd, g, b // 8, r)) * T.Cast(
            "float32", _elem(sc, g, b, (h % QBLOCK) // 16 * ROWS + r) if halves == 2 else _elem(sc, g, b, r))
             if superblock else T.Cast("float32", _elem(dd, g, b, r)))
        w = s * (code(codes, high, lut, g, r, h) - T.float32(off))
        if min_kind == 1:
            return w + T.Cast("float32", _elem(mm, g, b, r))
        if min_kind == 2:
            return w - T.Cast("float32", _elem(dmin, g, b // 8, r)) * T.Cast("float32", _elem(mq, g, b, r))
        return w

    @T.prim_func(private=True)
    def quant_embed(var_ids: T.handle, codes: T.Buffer(*_codes_), high: T.Buffer(*_high),
                    d: T.Buffer(*_d), sc: T.Buffer(*_sc), m: T.Buffer(*_m),
                    dmin: T.Buffer(*_dmin), mq: T.Buffer(*_mq), lut: T.Buffer(*_lut), var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        ids = T.match_buffer(var_ids, (n,), "int32")
        out = T.match_buffer(var_out, (n, hidden), "float32")
        for t in range(n):
            for h in range(hidden):
                out[t, h] = weight(codes, high, d, sc, m, dmin, mq, lut, ids[t], h)

    return _drop_unused(quant_embed, layout)
