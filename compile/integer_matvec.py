# fmt: off
"""Quantised matvecs with integer dot products (AVX2): activations quantised to integer blocks once per call, the
GGUF's Q4_1 / Q8_0 weight blocks multiplied with them in integers, one float FMA per block.

The activations ``x[n, K]`` float32 become, per token ``t`` and block ``b`` of 32 values (as GGML's Q8_1 with
``qmax`` 127, or in 16 bits with ``qmax`` 32767): ``xd[t, b] = max |x[t, 32 b: 32 b + 32]| / qmax``,
``xq[t, 32 b + j] = nearbyint(x[t, 32 b + j] / xd[t, b])`` (0 for an all-zero block) and
``xs[t, b] = xd[t, b] * sum_j xq[t, 32 b + j]``. Then for weight row ``o``::

    q4_1:  y[t, o] = sum_b scales[o, b] * xd[t, b] * sum_j q[o, 32 b + j] * xq[t, 32 b + j]
                                                         + mins[o, b] * xs[t, b]
    q8_0:  y[t, o] = sum_b scales[o, b] * xd[t, b] * sum_j codes[o, 32 b + j] * xq[t, 32 b + j]

The integer sums of a block, against int8 activations: one ``vpmaddubsw`` (unsigned x signed bytes into pairs of
int16) and one ``vpmaddwd`` (pairs of int16 into int32) on 32 bytes: Q4_1's 16 code bytes are split into low and
high nibbles (weights ``j`` and ``16 + j``) and joined into one 32-byte vector, which is exactly the block's order,
so the GGUF's layout streams as it is; Q8_0's signed codes go through ``vpsignb`` (``|w|`` and ``x`` with ``w``'s
sign). Against int16 activations (the default: as fast here, and the logits stay within about 1e-3 of float where
8 bits put them 0.6-0.9 off on SmolLM2): the codes widened to int16 (``vpmovzxbw`` / ``vpmovsxbw``), two
``vpmaddwd`` and one ``vpaddd``. A block's int32 lanes become float and are added into 8 float32 lanes with one FMA
by the product of the two scales, ``f[t, b] = scales[o, b] * xd[t, b]``, computed for all of a row's blocks once
per row and token (vectorised), as Q4_1's min term ``sum_b mins[o, b] * xs[t, b]`` (an 8-lane dot product over the
blocks). A token's blocks go round 2 independent accumulators (so consecutive FMAs do not wait for each other),
summed at the row's end. The rows go in 64 parallel chunks (both threads on every matvec), the tokens of a row in
groups of 4 (then a pair, then one): each weight block is loaded and unpacked once per group, each token with its
own accumulators summed in the same order as a token alone (a token's result does not depend on the others).
One thread, CPU time, gate_up (Q4_1 3072 x 576): 1 / 8 / 79 tokens 0.131 / 0.57 / 6.3 ms (in pairs, with the
scales' product and the min term in every block: 0.194 / 1.06 / 10.5).

These macros are the decode branch of ``linear_kernels.linear_kernel`` on CPUs with AVX2 (``has_int8_dot``);
elsewhere the float dot products of that module run (the portable path). In the compiled model they serve Q8_0
weights (SmolLM2's output head) and a Q4_1 embedding's tied head; Q4_1 layer matrices are repacked for
``packed_matvec`` (a lane per row, about twice as fast).
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

_QBLOCK = 32
_CHUNKS = 64
_LANES = 8   # float32 lanes of a block accumulator (one ymm register)
_UNROLL = 2  # independent accumulators a token's blocks go round
_GROUP = 4   # tokens whose dot products share each weight block's load and unpacking
_MADDUBS = "llvm.x86.avx2.pmadd.ub.sw"
_MADDWD = "llvm.x86.avx2.pmadd.wd"
_SIGN = "llvm.x86.avx2.psign.b"
REQUIRED_FEATURES = ("avx2",)


def has_int8_dot(features: frozenset[str]) -> bool:
    """Whether code built with these LLVM features can use the integer-dot kernels."""
    return all(f in features for f in REQUIRED_FEATURES)


def _intrin(name: str, dtype: str, *args: Any) -> Any:
    return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(name), *args, dtype=dtype)


def _block_dot(w_u8x32: Any, x_i8x32: Any) -> Any:
    """The 8 int32 partial sums of ``sum_j w[j] * x[j]`` (w unsigned, x signed bytes), as float32x8."""
    pairs = _intrin(_MADDUBS, "int16x16", w_u8x32, x_i8x32)
    return T.Cast("float32x8", _intrin(_MADDWD, "int32x8", pairs, T.broadcast(T.int16(1), 16)))


def _pairs16(w_i16x16: Any, x_i16x16: Any) -> Any:
    """int32x8 sums of adjacent products of two int16x16 vectors (``vpmaddwd``)."""
    return _intrin(_MADDWD, "int32x8", w_i16x16, x_i16x16)


def q4_1_block16(codes: Any, o: Any, b: Any, xq: Any, t: Any) -> Any:
    """As ``q4_1_block`` against int16 activations: nibbles widened to int16, two ``vpmaddwd``."""
    wv = codes.vload([o, b * 16], "uint8x16")
    low = T.Cast("int16x16", T.bitwise_and(wv, T.broadcast(T.uint8(15), 16)))
    high = T.Cast("int16x16", T.shift_right(wv, T.broadcast(T.uint8(4), 16)))
    return T.Cast("float32x8", _pairs16(low, xq.vload([t, b * _QBLOCK], "int16x16"))
                  + _pairs16(high, xq.vload([t, b * _QBLOCK + 16], "int16x16")))


def q8_0_block16(codes: Any, o: Any, b: Any, xq: Any, t: Any) -> Any:
    """As ``q8_0_block`` against int16 activations: codes widened to int16, two ``vpmaddwd``."""
    w0 = T.Cast("int16x16", codes.vload([o, b * _QBLOCK], "int8x16"))
    w1 = T.Cast("int16x16", codes.vload([o, b * _QBLOCK + 16], "int8x16"))
    return T.Cast("float32x8", _pairs16(w0, xq.vload([t, b * _QBLOCK], "int16x16"))
                  + _pairs16(w1, xq.vload([t, b * _QBLOCK + 16], "int16x16")))


def q4_1_block(codes: Any, o: Any, b: Any, xq: Any, t: Any) -> Any:
    """float32x8 partial sums of block ``b`` of row ``o`` (codes ``[N, K/2]``) against token ``t``."""
    wv = codes.vload([o, b * 16], "uint8x16")
    low = T.bitwise_and(wv, T.broadcast(T.uint8(15), 16))
    high = T.shift_right(wv, T.broadcast(T.uint8(4), 16))
    return _block_dot(T.Shuffle([low, high], list(range(32))), xq.vload([t, b * _QBLOCK], "int8x32"))


def q8_0_block(codes: Any, o: Any, b: Any, xq: Any, t: Any) -> Any:
    """float32x8 partial sums of block ``b`` of row ``o`` (int8 codes ``[N, K]``) against token ``t``."""
    wv = codes.vload([o, b * _QBLOCK], "int8x32")
    xv = xq.vload([t, b * _QBLOCK], "int8x32")
    return _block_dot(_intrin(_SIGN, "int8x32", wv, wv), _intrin(_SIGN, "int8x32", xv, wv))


@T.macro
def quantise_activations(x, xq, xd, xs, n, in_features, amax, qmax):
    """xq, xd, xs of ``x[n, K]`` (module doc, with ``qmax`` for 127: 127 for int8 ``xq``, 32767 for int16);
    ``amax``: a local float32 scratch of 2."""
    for t in range(n):
        for b in range(in_features // _QBLOCK):
            amax[0] = T.float32(0)
            for j in range(_QBLOCK):
                amax[0] = T.max(amax[0], T.abs(T.Cast("float32", x[t, b * _QBLOCK + j])))
            d: T.let = amax[0] / T.float32(qmax)
            inv: T.let = T.Select(d > T.float32(0), T.float32(1) / T.max(d, T.float32(1e-30)), T.float32(0))
            amax[1] = T.float32(0)
            for j in range(_QBLOCK):
                q: T.let = T.nearbyint(T.Cast("float32", x[t, b * _QBLOCK + j]) * inv)
                xq[t, b * _QBLOCK + j] = T.Cast(xq.dtype, q)
                amax[1] = amax[1] + q
            xd[t, b] = d
            xs[t, b] = d * amax[1]


@T.macro
def _group(y, xq, t0, size, o, blocks, codes, block, f, m, acc, red):
    """``y[t0 + s, o]`` for the ``size`` tokens ``t0 ..`` (each alone would get the same sums in the same order):
    per block, the weight block loaded and unpacked once (the unrolled tokens' identical loads and unpacking are
    one in LLVM's code), then per token its 8 int32 partial sums, as float, times the token's factor ``f[s, b]``
    (weight scale x activation scale) into the token's accumulator ``b % 2``; at the row's end the two and their
    8 lanes summed in one fixed order, plus the token's min term ``m[s]``."""
    for s in T.unroll(size):
        for u in T.unroll(_UNROLL):
            acc[T.ramp((s * _UNROLL + u) * _LANES, 1, _LANES)] = T.broadcast(T.float32(0), _LANES)
    for b2 in range(blocks // _UNROLL):
        for u in T.unroll(_UNROLL):
            for s in T.unroll(size):
                acc[T.ramp((s * _UNROLL + u) * _LANES, 1, _LANES)] = acc[T.ramp((s * _UNROLL + u) * _LANES, 1,
                                                                              _LANES)] + block(
                    codes, o, b2 * _UNROLL + u, xq, t0 + s) * T.broadcast(f[s, b2 * _UNROLL + u], _LANES)
    for b in range(blocks // _UNROLL * _UNROLL, blocks):
        for s in T.unroll(size):
            acc[T.ramp(s * _UNROLL * _LANES, 1, _LANES)] = acc[T.ramp(s * _UNROLL * _LANES, 1, _LANES)] + block(
                codes, o, b, xq, t0 + s) * T.broadcast(f[s, b], _LANES)
    for s in T.unroll(size):
        for lane in T.vectorized(_LANES):
            red[lane] = acc[s * _UNROLL * _LANES + lane] + acc[(s * _UNROLL + 1) * _LANES + lane]
        for lane in T.vectorized(4):
            red[lane] = red[lane] + red[lane + 4]
        y[t0 + s, o] = T.Cast(y.dtype, (red[0] + red[2]) + (red[1] + red[3]) + m[s])


@T.macro
def _factors(xd, xs, t0, size, o, blocks, scales, mins, f, m, mv):
    """For tokens ``t0 .. t0 + size - 1`` of row ``o``: ``f[s, b] = scales[o, b] * xd[t, b]`` and the min term
    ``m[s] = sum_b mins[o, b] * xs[t, b]`` (8 lanes over the blocks, then the lanes and the tail, in one fixed
    order; 0 without ``mins``)."""
    for s in T.unroll(size):
        for b in T.vectorized(blocks):
            f[s, b] = T.Cast("float32", scales[o, b]) * xd[t0 + s, b]
        for lane in T.vectorized(_LANES):
            mv[lane] = T.float32(0)
        if mins is not None:
            for b8 in range(blocks // _LANES):
                for lane in T.vectorized(_LANES):
                    mv[lane] = mv[lane] + T.Cast("float32", mins[o, b8 * _LANES + lane]) * xs[
                        t0 + s, b8 * _LANES + lane]
            for b in range(blocks // _LANES * _LANES, blocks):
                mv[0] = mv[0] + T.Cast("float32", mins[o, b]) * xs[t0 + s, b]
        m[s] = ((mv[0] + mv[4]) + (mv[2] + mv[6])) + ((mv[1] + mv[5]) + (mv[3] + mv[7]))


@T.macro
def int8_rows(y, xq, xd, xs, n, out_features, blocks, scales, mins, codes, block):
    """``y[t, o]`` for every row (module doc): 64 parallel chunks of rows; per row, the tokens in groups of 4 (then
    a pair, then one), each weight block unpacked once per group; per token, its blocks go round 2 accumulators of
    8 float32 lanes (consecutive FMAs do not wait for each other) with the scales' product ``f`` and the min term
    computed once per row and token (``_factors``). A token's sums are the same, in the same order, whatever group
    it is in (a batch or a prompt gives each token the result it would get alone)."""
    for chunk in T.parallel(_CHUNKS):
        acc = T.alloc_buffer((_GROUP * _UNROLL * _LANES,), "float32", scope="local")
        f = T.alloc_buffer((_GROUP, blocks), "float32", scope="local")
        m = T.alloc_buffer((_GROUP,), "float32", scope="local")
        mv = T.alloc_buffer((_LANES,), "float32", scope="local")
        red = T.alloc_buffer((_LANES,), "float32", scope="local")
        for o in range(chunk * out_features // _CHUNKS, (chunk + 1) * out_features // _CHUNKS):
            for tg in range(n // _GROUP):
                _factors(xd, xs, tg * _GROUP, _GROUP, o, blocks, scales, mins, f, m, mv)
                _group(y, xq, tg * _GROUP, _GROUP, o, blocks, codes, block, f, m, acc, red)
            if n % _GROUP >= 2:
                _factors(xd, xs, n // _GROUP * _GROUP, 2, o, blocks, scales, mins, f, m, mv)
                _group(y, xq, n // _GROUP * _GROUP, 2, o, blocks, codes, block, f, m, acc, red)
            if n % 2 == 1:
                _factors(xd, xs, n - 1, 1, o, blocks, scales, mins, f, m, mv)
                _group(y, xq, n - 1, 1, o, blocks, codes, block, f, m, acc, red)


def block_dot(fmt: str, xbits: int) -> Any:
    """The block function of ``fmt`` ("q4_1" or "q8_0") against ``xbits``-bit activations (8 or 16)."""
    if xbits not in (8, 16):
        raise ValueError(f"activation bits must be 8 or 16, got {xbits}")
    if fmt == "q4_1":
        return q4_1_block if xbits == 8 else q4_1_block16
    if fmt == "q8_0":
        return q8_0_block if xbits == 8 else q8_0_block16
    raise ValueError(f"integer-dot matvecs take q4_1 or q8_0 weights, got {fmt!r}")


@T.macro
def integer_matvec(y, x, n, out_features, in_features, scales, mins, codes, block, xtype, qmax):
    """``y[t, o]`` for ``x[n, K]`` (module doc): x quantised to ``xtype`` blocks (``quantise_activations``, into
    ``xs`` also the scaled sums the min term reads), then ``int8_rows``; ``mins``: Q4_1's, or None (Q8_0)."""
    xq = T.alloc_buffer((n, in_features), xtype)
    xd = T.alloc_buffer((n, in_features // _QBLOCK), "float32")
    xs = T.alloc_buffer((n, in_features // _QBLOCK), "float32")
    amax = T.alloc_buffer((2,), "float32", scope="local")
    quantise_activations(x, xq, xd, xs, n, in_features, amax, qmax)
    int8_rows(y, xq, xd, xs, n, out_features, in_features // _QBLOCK, scales, mins, codes, block)
