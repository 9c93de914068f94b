# fmt: off
"""CPU kernels for the model's matmuls and embedding lookups, for float and GGUF-quantised weight storage.

Every weight matrix ``W`` ``[N, K]`` is stored in one of four formats (``FORMATS``):

* ``float32`` / ``float16``: ``w[N, K]``; ``W = float32(w)``.
* ``q8_0`` (GGUF Q8_0, kept as the GGUF stores it): ``codes[N, K]`` int8 and ``scales[N, K/32]`` (the GGUF's float16
  scales); ``W[o, k] = scales[o, k // 32] * codes[o, k]`` (1.06 bytes a weight, as in the GGUF).
* ``q4_1`` (GGUF Q4_1): ``codes[N, K/2]`` uint8, ``scales``/``mins[N, K/32]`` (float16 likewise); in block ``b``
  of 32 weights, byte ``j`` of ``codes[o, 16 b: 16 b + 16]`` holds weight ``32 b + j`` in its low nibble and
  ``32 b + 16 + j`` in its high nibble; ``W[o, k] = scales[o, b] * q + mins[o, b]`` (0.625 bytes a weight).

These are exactly the values ``gguf.quants.dequantize`` gives, so the compiled model computes with the GGUF's own
weights (only the summation order differs from the numpy reference).

``linear_kernel(N, K, fmt)`` computes ``y[t, o] = sum_k x[t, k] * W[o, k]`` for float32 ``x[n, K]``, ``y[n, N]``
(``n`` dynamic), with two schedules:

* **GEMM, from 8 tokens on** (prefill): ``x`` is transposed into tiles of 96 tokens, ``xt[tile, k, j]`` (zero-padded
  to whole vectors of 16 tokens). The output rows go in groups of 8, the groups in 64 balanced parallel chunks; per
  token tile and group, the 8 rows are decoded once into ``wd[8, K]`` float32 (L1), then register tiles of 8 rows x
  3 (or 2, or 1) vectors of 16 tokens run over k: per k one vector load of ``xt`` per token vector, one broadcast of
  ``wd[r, k]`` per row, 24 FMAs into 24 zmm accumulators (``vfmadd231ps`` with the broadcast, checked in the
  assembly); the accumulators are then stored transposed into ``y``. Measured 90-100 GFLOP/s on two cores at 79
  tokens (the dot-product schedule below: 32).
* **dot products, below 8 tokens** (decode): the output rows in 64 parallel chunks (a buffer allocated inside a
  parallel loop is a heap allocation per iteration, so the accumulators are allocated once per chunk); per row,
  tokens in blocks of 4 (four accumulators of 16 float32 lanes; each weight vector loaded once for the block), then
  the remaining tokens one by one (two accumulators: even and odd steps). Quantised rows are decoded inside the dot
  products below 4 tokens, and once per row into a float32 row in L1 from 4 to 7 tokens. Accumulators are summed by
  halving (16 -> 8 -> 4 -> 2 -> 1). For q4_1 the term ``mins * sum(x)`` uses the pair sums ``xp[t, 16 b + j] =
  x[t, 32 b + j] + x[t, 32 b + 16 + j]``, computed first.

``embed_kernel(V, H, fmt)`` gathers rows: ``out[t, :] = W[ids[t], :]`` as float32. ``swiglu_kernel(F)`` is the
MLP's activation on the fused gate/up projection, vectorised (a polynomial exp instead of scalar ``expf`` calls).
"""

from __future__ import annotations

import functools
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from ..tir_kernels._common import fast_exp
from .integer_matvec import block_dot, integer_matvec

FORMATS = ("float32", "float16", "q8_0", "q4_1")
QUANTISED = ("q8_0", "q4_1")
_LANES = 16          # float32 lanes of an accumulator (one AVX-512 register)
_TOKEN_BLOCK = 4     # tokens sharing one decode of a weight row
_CHUNKS = 64         # parallel chunks of output rows
_TOKEN_TILE = 64     # tokens whose inputs stay in L2 while a chunk's rows pass over them
_QBLOCK = 32         # weights per quantisation block
_SCALE = "float16"   # block scales and mins: the GGUF's own float16 values (widened in the loops: F16C)
_GEMM_MIN_TOKENS = 8  # from this many tokens on, the register-tiled GEMM (below, the dot-product kernels)
_INT_GEMM_MIN_TOKENS = 16  # the same with the integer-dot kernels (they stay faster up to batch 8 and beyond)
_GEMM_ROWS = 8       # output rows of a GEMM register tile (a row group)
_GEMM_VECS = 3       # token vectors (of 16) of the widest register tile: 8 x 3 accumulators of 16 lanes
_GEMM_TILE = 96      # tokens per tile of the transposed x (6 vectors; K x 96 float32 stays in L2)


def check_shape(out_features: int, in_features: int, fmt: str) -> None:
    """Raise ValueError unless ``fmt`` is known and ``in_features`` divides into its blocks."""
    if fmt not in FORMATS:
        raise ValueError(f"weight format {fmt!r} is not supported ({', '.join(FORMATS)})")
    step = _QBLOCK if fmt in QUANTISED else _LANES
    if in_features % step:
        raise ValueError(f"{fmt} weights need in_features divisible by {step}, got {in_features}")


def param_shapes(out_features: int, in_features: int, fmt: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(suffix, shape, dtype) of the arrays that store a ``[out, in]`` weight in ``fmt``."""
    check_shape(out_features, in_features, fmt)
    blocks = in_features // _QBLOCK
    if fmt == "q8_0":
        return [("codes", (out_features, in_features), "int8"), ("scales", (out_features, blocks), _SCALE)]
    if fmt == "q4_1":
        return [("codes", (out_features, in_features // 2), "uint8"), ("scales", (out_features, blocks), _SCALE),
                ("mins", (out_features, blocks), _SCALE)]
    return [("weight", (out_features, in_features), fmt)]


@T.macro
def _halve(acc, b):
    """acc[b, 0] + acc[b, 1] becomes the sum of the 16 lanes (vector adds of halves)."""
    for lane in T.vectorized(8):
        acc[b, lane] = acc[b, lane] + acc[b, lane + 8]
    for lane in T.vectorized(4):
        acc[b, lane] = acc[b, lane] + acc[b, lane + 4]
    for lane in T.vectorized(2):
        acc[b, lane] = acc[b, lane] + acc[b, lane + 2]


@T.macro
def _blocks(y, first, count, o, steps, acc, term):
    """y[t, o] for tokens first .. first+count-1 in whole blocks of 4, each weight vector loaded once per block. Per
    token two accumulators (even and odd steps), summed exactly as ``_singles`` sums them: a token's result does not
    depend on whether it was computed in a block or alone (batch invariance)."""
    for tb in range(count // _TOKEN_BLOCK):
        for b in range(2 * _TOKEN_BLOCK):
            for lane in T.vectorized(_LANES):
                acc[b, lane] = T.float32(0)
        for s2 in range(steps // 2):
            for b in range(_TOKEN_BLOCK):
                for e in range(2):
                    for lane in T.vectorized(_LANES):
                        acc[2 * b + e, lane] = acc[2 * b + e, lane] + term(first + tb * _TOKEN_BLOCK + b, o,
                                                                           s2 * 2 + e, lane)
        if steps % 2 == 1:
            for b in range(_TOKEN_BLOCK):
                for lane in T.vectorized(_LANES):
                    acc[2 * b, lane] = acc[2 * b, lane] + term(first + tb * _TOKEN_BLOCK + b, o, steps - 1, lane)
        for b in range(_TOKEN_BLOCK):
            for lane in T.vectorized(_LANES):
                acc[2 * b, lane] = acc[2 * b, lane] + acc[2 * b + 1, lane]
            _halve(acc, 2 * b)
            y[first + tb * _TOKEN_BLOCK + b, o] = acc[2 * b, 0] + acc[2 * b, 1]


@T.macro
def _singles(y, first, count, o, steps, acc, term):
    """y[t, o] for tokens first .. first+count-1 one by one: two accumulators (even and odd steps)."""
    for t0 in range(count):
        t: T.let = first + t0
        for b in range(2):
            for lane in T.vectorized(_LANES):
                acc[b, lane] = T.float32(0)
        for s2 in range(steps // 2):
            for b in range(2):
                for lane in T.vectorized(_LANES):
                    acc[b, lane] = acc[b, lane] + term(t, o, s2 * 2 + b, lane)
        if steps % 2 == 1:
            for lane in T.vectorized(_LANES):
                acc[0, lane] = acc[0, lane] + term(t, o, steps - 1, lane)
        for lane in T.vectorized(_LANES):
            acc[0, lane] = acc[0, lane] + acc[1, lane]
        _halve(acc, 0)
        y[t, o] = acc[0, 0] + acc[0, 1]


@T.macro
def _tile(y, first, count, o, steps, acc, term):
    """Tokens first .. first+count-1 of row o: blocks of 4, then the rest one by one."""
    _blocks(y, first, count, o, steps, acc, term)
    _singles(y, first + count // _TOKEN_BLOCK * _TOKEN_BLOCK, count % _TOKEN_BLOCK, o, steps, acc, term)


@T.macro
def _rows(y, n, out_features, steps, acc, chunk, rows_per_chunk, term):
    """y[t, o] = sum over steps s and lanes l of term(t, o, s, l), for the rows o of this chunk (float weights);
    tokens in tiles of 64 so that a tile of x stays in L2 while the chunk's rows pass over it."""
    for tile in range((n + _TOKEN_TILE - 1) // _TOKEN_TILE):
        for row in range(rows_per_chunk):
            if chunk * rows_per_chunk + row < out_features:
                o: T.let = chunk * rows_per_chunk + row
                _tile(y, tile * _TOKEN_TILE, T.min(_TOKEN_TILE, n - tile * _TOKEN_TILE), o, steps, acc, term)


@T.macro
def _quantised_rows(y, x, n, out_features, in_features, blocks, acc, wrow, chunk, rows_per_chunk, term, decode,
                    wrow_from):
    """As ``_rows`` for quantised weights: below ``wrow_from`` tokens the blocks are decoded inside the dot products;
    from there on, a row is decoded once per tile into ``wrow`` (float32, in L1) and the tokens run the float loop."""
    if n < wrow_from:
        for row in range(rows_per_chunk):
            if chunk * rows_per_chunk + row < out_features:
                _singles(y, 0, n, chunk * rows_per_chunk + row, blocks, acc, term)
    else:
        for tile in range((n + _TOKEN_TILE - 1) // _TOKEN_TILE):
            for row in range(rows_per_chunk):
                if chunk * rows_per_chunk + row < out_features:
                    o: T.let = chunk * rows_per_chunk + row
                    for s in range(blocks):
                        for lane in T.vectorized(_LANES):
                            wrow[s * 32 + lane] = decode(o, s, lane, 0)
                            wrow[s * 32 + 16 + lane] = decode(o, s, lane, 1)
                    _tile(y, tile * _TOKEN_TILE, T.min(_TOKEN_TILE, n - tile * _TOKEN_TILE), o,
                          in_features // _LANES, acc,
                          lambda t, o_, s, lane: x[t, s * _LANES + lane] * wrow[s * _LANES + lane])


# ---------------------------------------------------------------- GEMM (from _GEMM_MIN_TOKENS tokens on)


@T.macro
def _transpose(xt, x, n, in_features, chunks):
    """xt[tile, k, j] = x[96 tile + j, k] for tokens below n, 0 for the padding up to a whole vector of 16 tokens
    (xt: [tiles, K, 96] float32); the k range in parallel chunks."""
    padded: T.let = (n + _LANES - 1) // _LANES * _LANES
    for chunk in T.parallel(chunks):
        for k in range(chunk * in_features // chunks, (chunk + 1) * in_features // chunks):
            for t in range(padded):
                xt[t // _GEMM_TILE, k, t % _GEMM_TILE] = T.if_then_else(t < n, x[T.min(t, n - 1), k], T.float32(0))


@T.macro
def _micro(y, xt, wd, acc, n, out_features, in_features, o0, tile, t0, vecs):
    """One register tile: ``acc[r, 16 v + l] = sum_k wd[r, k] * xt[tile, k, t0 + 16 v + l]`` for r < 8, v < vecs
    (at most 8 x 3 accumulators of 16 lanes, kept in registers; per k one vector load of x per v and one broadcast
    of wd per r), then ``y[96 tile + t0 + j, o0 + r] = acc[r, j]`` for the tokens and rows that exist."""
    for r in T.unroll(_GEMM_ROWS):
        for v in T.unroll(vecs):
            for lane in T.vectorized(_LANES):
                acc[r, v * _LANES + lane] = T.float32(0)
    for k in range(in_features):
        for r in T.unroll(_GEMM_ROWS):
            for v in T.unroll(vecs):
                for lane in T.vectorized(_LANES):
                    acc[r, v * _LANES + lane] = acc[r, v * _LANES + lane] + wd[r, k] * xt[
                        tile, k, t0 + v * _LANES + lane]
    for j in range(T.min(vecs * _LANES, n - tile * _GEMM_TILE - t0)):
        for r in range(T.min(_GEMM_ROWS, out_features - o0)):
            y[tile * _GEMM_TILE + t0 + j, o0 + r] = acc[r, j]


@T.macro
def _micros(y, xt, wd, acc, n, out_features, in_features, o0, tile, vectors):
    """The ``vectors`` token vectors of a tile against one row group, in register tiles of 3 vectors, then 2s (a
    remainder of 1 becomes 2 + 2 where it can; a lone vector is a tile of 1)."""
    ones: T.let = T.Select(vectors == 1, 1, 0)
    twos: T.let = T.Select(vectors % 3 == 2, 1, T.Select(vectors % 3 == 1 and vectors > 1, 2, 0))
    threes: T.let = (vectors - ones - 2 * twos) // 3
    for m in range(threes):
        _micro(y, xt, wd, acc, n, out_features, in_features, o0, tile, m * 48, 3)
    for m in range(twos):
        _micro(y, xt, wd, acc, n, out_features, in_features, o0, tile, threes * 48 + m * 32, 2)
    if ones == 1:
        _micro(y, xt, wd, acc, n, out_features, in_features, o0, tile, 0, 1)


@T.macro
def _fill(wd, o0, out_features, in_features, elem):
    """wd[r, 16 c + l] = elem(min(o0 + r, N - 1), c, l) (the decoded weight W[o, 16 c + l]) for r < 8."""
    for r in range(_GEMM_ROWS):
        o: T.let = T.min(o0 + r, out_features - 1)
        for c in range(in_features // _LANES):
            for lane in T.vectorized(_LANES):
                wd[r, c * _LANES + lane] = elem(o, c, lane)


@T.macro
def _gemm(y, x, n, out_features, in_features, elem):
    """``y[t, o] = sum_k x[t, k] * W[o, k]`` as a register-tiled GEMM: x transposed into tiles of 96 tokens
    (``_transpose``); the output rows in groups of 8, the groups in balanced parallel chunks; per token tile and
    group, rows o0 .. o0+7 (clamped to the last row) are decoded into ``wd[8, K]`` float32 once (``_fill``), and
    the tile's token vectors run against it in register tiles (``_micros``)."""
    tiles: T.let = (n + _GEMM_TILE - 1) // _GEMM_TILE
    groups: T.let = (out_features + _GEMM_ROWS - 1) // _GEMM_ROWS
    xt = T.alloc_buffer((tiles, in_features, _GEMM_TILE), "float32")
    _transpose(xt, x, n, in_features, _CHUNKS)
    for chunk in T.parallel(T.min(_CHUNKS, groups)):
        acc = T.alloc_buffer((_GEMM_ROWS, _GEMM_VECS * _LANES), "float32", scope="local")
        wd = T.alloc_buffer((_GEMM_ROWS, in_features), "float32", scope="local")
        for tile in range(tiles):
            for g in range(chunk * groups // T.min(_CHUNKS, groups), (chunk + 1) * groups // T.min(_CHUNKS, groups)):
                _fill(wd, g * _GEMM_ROWS, out_features, in_features, elem)
                _micros(y, xt, wd, acc, n, out_features, in_features, g * _GEMM_ROWS, tile,
                        (T.min(_GEMM_TILE, n - tile * _GEMM_TILE) + _LANES - 1) // _LANES)


def _f32(value: Any) -> Any:
    return T.Cast("float32", value)


def _low(byte: Any) -> Any:
    return _f32(T.bitwise_and(byte, T.uint8(15)))


def _high(byte: Any) -> Any:
    return _f32(T.shift_right(byte, T.uint8(4)))


#: ``linear_kernel`` modes: which schedule runs at which token count.
MODES = ("auto", "decode", "prefill")
_NEVER = 2**62  # a token count never reached


@functools.cache
def integer_linear_kernel(out_features: int, in_features: int, fmt: str, x_dtype: str = "float32",
                          y_dtype: str = "float32", xbits: int = 16) -> tirx.PrimFunc:
    """``linear_kernel(..., int8_dot=True, mode="decode")``'s integer dot products alone, with ``x`` and ``y`` of
    their own types (float32 or float16: a float16 KV cache's q/k/v come out of the qkv projection and its
    attention output goes into the o projection as they are, without a cast kernel each); the same sums in the same
    order as ``linear_kernel``'s, one rounding of ``y`` at the end."""
    check_shape(out_features, in_features, fmt)
    if fmt not in QUANTISED:
        raise ValueError(f"the integer dot products take q4_1 or q8_0 weights, got {fmt!r}")
    for name, dtype in (("x_dtype", x_dtype), ("y_dtype", y_dtype)):
        if dtype not in ("float32", "float16"):
            raise ValueError(f"{name} must be float32 or float16, got {dtype!r}")
    N, K, blocks = out_features, in_features, in_features // _QBLOCK
    xtype, qmax = f"int{xbits}", 2 ** (xbits - 1) - 1
    block = block_dot(fmt, xbits)

    if fmt == "q8_0":
        @T.prim_func(private=True)
        def linear_q8_0(var_x: T.handle, codes: T.Buffer((N, K), "int8"), scales: T.Buffer((N, blocks), _SCALE),
                        var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), x_dtype)
            y = T.match_buffer(var_y, (n, N), y_dtype)
            integer_matvec(y, x, n, N, K, scales, None, codes, block, xtype, qmax)
        return linear_q8_0

    @T.prim_func(private=True)
    def linear_q4_1(var_x: T.handle, codes: T.Buffer((N, K // 2), "uint8"), scales: T.Buffer((N, blocks), _SCALE),
                    mins: T.Buffer((N, blocks), _SCALE), var_y: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, K), x_dtype)
        y = T.match_buffer(var_y, (n, N), y_dtype)
        integer_matvec(y, x, n, N, K, scales, mins, codes, block, xtype, qmax)
    return linear_q4_1


@functools.cache
def linear_kernel(out_features: int, in_features: int, fmt: str, int8_dot: bool = False,
                  xbits: int = 16, mode: str = "auto") -> tirx.PrimFunc:
    """``y[t, o] = sum_k x[t, k] * W[o, k]``: parameters ``x``, the weight arrays of ``fmt``, ``y`` (module doc).
    ``int8_dot``: below ``_INT_GEMM_MIN_TOKENS`` tokens, quantised formats use ``integer_matvec``'s integer dot products
    (AVX2) with x quantised to ``xbits``-bit blocks (16: logits within about 1e-3 of float; 8: GGML's Q8 blocks,
    no faster here and about 0.7 off) instead of float dot products.

    ``mode``: "auto" picks the schedule by the token count (the GEMM from 8 or 16 tokens on). The model is
    batch-invariant with the two others: "decode" runs the dot products at every token count (and quantised rows
    decoded inside them), "prefill" the GEMM at every token count; each reduces a token's row in one fixed order
    whatever the other tokens, so a sequence's logits do not depend on what else is in the batch."""
    check_shape(out_features, in_features, fmt)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    N, K = out_features, in_features
    chunks = min(_CHUNKS, N)
    rows_per_chunk = -(-N // chunks)
    blocks, half = K // _QBLOCK, K // 2
    xtype, qmax = f"int{xbits}", 2 ** (xbits - 1) - 1
    auto_from = _INT_GEMM_MIN_TOKENS if int8_dot else _GEMM_MIN_TOKENS
    gemm_from = {"auto": auto_from, "decode": _NEVER, "prefill": 0}[mode]
    float_gemm_from = {"auto": _GEMM_MIN_TOKENS, "decode": _NEVER, "prefill": 0}[mode]
    wrow_from = _NEVER if mode == "decode" else _TOKEN_BLOCK

    if fmt in ("float32", "float16"):
        def float_term(x, w):
            return lambda t, o, s, lane: x[t, s * _LANES + lane] * _f32(w[o, s * _LANES + lane])

        @T.prim_func(private=True)
        def linear(var_x: T.handle, w: T.Buffer((N, K), fmt), var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), "float32")
            y = T.match_buffer(var_y, (n, N), "float32")
            if n >= float_gemm_from:
                _gemm(y, x, n, N, K, lambda o, c, lane: _f32(w[o, c * _LANES + lane]))
            else:
                for chunk in T.parallel(chunks):
                    acc = T.alloc_buffer((2 * _TOKEN_BLOCK, _LANES), "float32", scope="local")
                    _rows(y, n, N, K // _LANES, acc, chunk, rows_per_chunk, float_term(x, w))
        return linear

    if fmt == "q8_0":
        def q8_term(x, codes, scales):
            return lambda t, o, s, lane: _f32(scales[o, s]) * (
                x[t, s * 32 + lane] * _f32(codes[o, s * 32 + lane])
                + x[t, s * 32 + 16 + lane] * _f32(codes[o, s * 32 + 16 + lane]))

        @T.prim_func(private=True)
        def linear_q8_0(var_x: T.handle, codes: T.Buffer((N, K), "int8"), scales: T.Buffer((N, blocks), _SCALE),
                        var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), "float32")
            y = T.match_buffer(var_y, (n, N), "float32")
            if n >= gemm_from:
                _gemm(y, x, n, N, K, lambda o, c, lane: _f32(scales[o, c // 2]) * _f32(codes[o, c * _LANES + lane]))
            elif int8_dot:
                integer_matvec(y, x, n, N, K, scales, None, codes, block_dot(fmt, xbits), xtype, qmax)
            else:
                for chunk in T.parallel(chunks):
                    acc = T.alloc_buffer((2 * _TOKEN_BLOCK, _LANES), "float32", scope="local")
                    wrow = T.alloc_buffer((K,), "float32", scope="local")
                    _quantised_rows(y, x, n, N, K, blocks, acc, wrow, chunk, rows_per_chunk,
                                    q8_term(x, codes, scales), lambda o, s, lane, half: _f32(scales[o, s]) * _f32(
                                        codes[o, s * 32 + half * 16 + lane]), wrow_from)
        return linear_q8_0

    def q4_term(x, xp, codes, scales, mins):
        return lambda t, o, s, lane: _f32(scales[o, s]) * (
            x[t, s * 32 + lane] * _low(codes[o, s * 16 + lane])
            + x[t, s * 32 + 16 + lane] * _high(codes[o, s * 16 + lane])) + _f32(mins[o, s]) * xp[t, s * 16 + lane]

    def q4_decode(codes, scales, mins):
        return lambda o, s, lane, half: _f32(scales[o, s]) * (_high if half else _low)(codes[o, s * 16 + lane]) + _f32(
            mins[o, s])

    def q4_elem(codes, scales, mins):  # weight 16 c + lane: nibble c % 2 of byte 16 (c // 2) + lane
        return lambda o, c, lane: _f32(scales[o, c // 2]) * _f32(T.bitwise_and(T.shift_right(
            codes[o, c // 2 * 16 + lane], T.Cast("uint8", c % 2 * 4)), T.uint8(15))) + _f32(mins[o, c // 2])

    @T.prim_func(private=True)
    def linear_q4_1(var_x: T.handle, codes: T.Buffer((N, half), "uint8"), scales: T.Buffer((N, blocks), _SCALE),
                    mins: T.Buffer((N, blocks), _SCALE), var_y: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, K), "float32")
        y = T.match_buffer(var_y, (n, N), "float32")
        if n >= gemm_from:
            _gemm(y, x, n, N, K, q4_elem(codes, scales, mins))
        elif int8_dot:
            integer_matvec(y, x, n, N, K, scales, mins, codes, block_dot(fmt, xbits), xtype, qmax)
        else:
            xp = T.alloc_buffer((n, half), "float32")
            for t in range(n):
                for s in range(blocks):
                    for lane in T.vectorized(16):
                        xp[t, s * 16 + lane] = x[t, s * 32 + lane] + x[t, s * 32 + 16 + lane]
            for chunk in T.parallel(chunks):
                acc = T.alloc_buffer((2 * _TOKEN_BLOCK, _LANES), "float32", scope="local")
                wrow = T.alloc_buffer((K,), "float32", scope="local")
                _quantised_rows(y, x, n, N, K, blocks, acc, wrow, chunk, rows_per_chunk,
                                q4_term(x, xp, codes, scales, mins), q4_decode(codes, scales, mins), wrow_from)
    return linear_q4_1


@functools.cache
def embed_kernel(vocab: int, hidden: int, fmt: str) -> tirx.PrimFunc:
    """``out[t, h] = W[ids[t], h]`` (float32) for int32 ``ids[n]``: parameters ``ids``, the weight arrays, ``out``."""
    check_shape(vocab, hidden, fmt)
    V, H, blocks = vocab, hidden, hidden // _QBLOCK
    if fmt in ("float32", "float16"):
        @T.prim_func(private=True)
        def embed(var_ids: T.handle, w: T.Buffer((V, H), fmt), var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            ids = T.match_buffer(var_ids, (n,), "int32")
            out = T.match_buffer(var_out, (n, H), "float32")
            for t in range(n):
                for h in range(H):
                    out[t, h] = _f32(w[ids[t], h])
        return embed
    if fmt == "q8_0":
        @T.prim_func(private=True)
        def embed_q8_0(var_ids: T.handle, codes: T.Buffer((V, H), "int8"), scales: T.Buffer((V, blocks), _SCALE),
                       var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            ids = T.match_buffer(var_ids, (n,), "int32")
            out = T.match_buffer(var_out, (n, H), "float32")
            for t in range(n):
                for h in range(H):
                    out[t, h] = _f32(scales[ids[t], h // 32]) * _f32(codes[ids[t], h])
        return embed_q8_0

    @T.prim_func(private=True)
    def embed_q4_1(var_ids: T.handle, codes: T.Buffer((V, H // 2), "uint8"), scales: T.Buffer((V, blocks), _SCALE),
                   mins: T.Buffer((V, blocks), _SCALE), var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        ids = T.match_buffer(var_ids, (n,), "int32")
        out = T.match_buffer(var_out, (n, H), "float32")
        for t in range(n):
            for s in range(blocks):
                for j in range(16):
                    out[t, s * 32 + j] = _f32(scales[ids[t], s]) * _low(codes[ids[t], s * 16 + j]) + _f32(
                        mins[ids[t], s])
                    out[t, s * 32 + 16 + j] = _f32(scales[ids[t], s]) * _high(codes[ids[t], s * 16 + j]) + _f32(
                        mins[ids[t], s])
    return embed_q4_1


_SILU_CLAMP = 80.0   # exp(-g) is taken at min(-g, 80): silu(g) for g < -80 is 0 to float32 precision anyway


@functools.cache
def swiglu_kernel(ffn: int) -> tirx.PrimFunc:
    """``out[t, j] = silu(gu[t, j]) * gu[t, ffn + j]`` for float32 ``gu[n, 2 ffn]`` (gate and up fused) and
    ``out[n, ffn]``, where ``silu(g) = g / (1 + exp(-g))``; tokens in parallel chunks, 16 lanes at a time."""
    if ffn % _LANES:
        raise ValueError(f"the MLP width {ffn} is not a multiple of {_LANES}")

    # s_tir: a root block, which Relax's reshape-pattern check asks of one-input kernels
    @T.prim_func(private=True, s_tir=True)
    def swiglu(var_gu: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})  # opaque: not to be fused
        n = T.int64()
        gu = T.match_buffer(var_gu, (n, 2 * ffn), "float32")
        out = T.match_buffer(var_out, (n, ffn), "float32")
        with T.sblock("root"):
            for chunk in T.parallel(_CHUNKS):
                for t in range(chunk * n // _CHUNKS, (chunk + 1) * n // _CHUNKS):
                    for c in range(ffn // _LANES):
                        for lane in T.vectorized(_LANES):
                            g: T.let = gu[t, c * _LANES + lane]
                            out[t, c * _LANES + lane] = g / (T.float32(1) + fast_exp(
                                T.min(-g, T.float32(_SILU_CLAMP)))) * gu[t, ffn + c * _LANES + lane]
    return swiglu
