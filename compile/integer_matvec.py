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
by the product of the two scales. A row's blocks go round 4 independent accumulators (so consecutive FMAs do not
wait for each other), summed at the row's end. The rows go in 64 parallel chunks (both threads on every matvec),
the tokens of a row in pairs: each weight block is loaded and unpacked once for two tokens, each token with its own
accumulators summed in the same order as a token alone (a token's result does not depend on the others; a verify of
6 tokens or a batch of 6 costs about 30% less than one token after another).

These macros are the decode branch of ``linear_kernels.linear_kernel`` on CPUs with AVX2 (``has_int8_dot``);
elsewhere the float dot products of that module run (the portable path).
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

_QBLOCK = 32
_CHUNKS = 64
_LANES = 8   # float32 lanes of a block accumulator (one ymm register)
_UNROLL = 4  # independent accumulators a row's blocks go round
_PAIR = 2    # tokens whose dot products share each weight block's load and unpacking
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
                amax[0] = T.max(amax[0], T.abs(x[t, b * _QBLOCK + j]))
            d: T.let = amax[0] / T.float32(qmax)
            inv: T.let = T.Select(d > T.float32(0), T.float32(1) / T.max(d, T.float32(1e-30)), T.float32(0))
            amax[1] = T.float32(0)
            for j in range(_QBLOCK):
                q: T.let = T.nearbyint(x[t, b * _QBLOCK + j] * inv)
                xq[t, b * _QBLOCK + j] = T.Cast(xq.dtype, q)
                amax[1] = amax[1] + q
            xd[t, b] = d
            xs[t, b] = d * amax[1]


@T.macro
def _accumulate(acc, low, u, codes, o, b, xq, xd, t, scales, block, min_term):
    """Accumulator ``u`` (of 4) += block ``b``'s 8 partial sums times both scales; its scalar += the min term."""
    acc[T.ramp(u * _LANES, 1, _LANES)] = acc[T.ramp(u * _LANES, 1, _LANES)] + block(codes, o, b, xq, t) * T.broadcast(
        T.Cast("float32", scales[o, b]) * xd[t, b], _LANES)
    low[u] = low[u] + min_term(o, b, t)


@T.macro
def _reduce_into(y, t, o, acc, low, a, l):
    """``y[t, o]`` = the sum of the 4 accumulators at ``acc[a:a + 32]`` and the 4 scalars at ``low[l:l + 4]``, in one
    fixed order (the same for a token alone and a token of a pair)."""
    for lane in T.vectorized(_LANES):
        acc[a + lane] = acc[a + lane] + acc[a + _LANES + lane] + acc[a + 2 * _LANES + lane] + acc[
            a + 3 * _LANES + lane]
    for lane in T.vectorized(4):
        acc[a + lane] = acc[a + lane] + acc[a + lane + 4]
    for lane in T.vectorized(2):
        acc[a + lane] = acc[a + lane] + acc[a + lane + 2]
    y[t, o] = acc[a] + acc[a + 1] + (low[l] + low[l + 1]) + (low[l + 2] + low[l + 3])


@T.macro
def int8_rows(y, xq, xd, n, out_features, blocks, scales, codes, block, min_term):
    """``y[t, o]`` for every row (module doc): 64 parallel chunks of rows; per row and token, the blocks go round
    4 independent accumulators of 8 float32 lanes (and ``min_term(o, b, t)`` round 4 scalars), so that the FMAs of
    consecutive blocks do not wait for each other; all are summed at the row's end. Tokens go in pairs, each with
    its own accumulators (the same sums in the same order as a token alone), so that a weight block is loaded and
    unpacked once for both."""
    for chunk in T.parallel(_CHUNKS):
        acc = T.alloc_buffer((_PAIR * _UNROLL * _LANES,), "float32", scope="local")
        low = T.alloc_buffer((_PAIR * _UNROLL,), "float32", scope="local")
        for o in range(chunk * out_features // _CHUNKS, (chunk + 1) * out_features // _CHUNKS):
            for tp in range(n // _PAIR):
                for s in T.unroll(_PAIR):
                    for u in T.unroll(_UNROLL):
                        acc[T.ramp((s * _UNROLL + u) * _LANES, 1, _LANES)] = T.broadcast(T.float32(0), _LANES)
                        low[s * _UNROLL + u] = T.float32(0)
                for b4 in range(blocks // _UNROLL):
                    for u in T.unroll(_UNROLL):
                        for s in T.unroll(_PAIR):
                            _accumulate(acc, low, s * _UNROLL + u, codes, o, b4 * _UNROLL + u, xq, xd, tp * _PAIR + s,
                                        scales, block, min_term)
                for b in range(blocks // _UNROLL * _UNROLL, blocks):
                    for s in T.unroll(_PAIR):
                        _accumulate(acc, low, s * _UNROLL, codes, o, b, xq, xd, tp * _PAIR + s, scales, block,
                                    min_term)
                for s in T.unroll(_PAIR):
                    _reduce_into(y, tp * _PAIR + s, o, acc, low, s * _UNROLL * _LANES, s * _UNROLL)
            for t in range(n // _PAIR * _PAIR, n):  # the odd token out, alone
                for u in T.unroll(_UNROLL):
                    acc[T.ramp(u * _LANES, 1, _LANES)] = T.broadcast(T.float32(0), _LANES)
                    low[u] = T.float32(0)
                for b4 in range(blocks // _UNROLL):
                    for u in T.unroll(_UNROLL):
                        _accumulate(acc, low, u, codes, o, b4 * _UNROLL + u, xq, xd, t, scales, block, min_term)
                for b in range(blocks // _UNROLL * _UNROLL, blocks):
                    _accumulate(acc, low, 0, codes, o, b, xq, xd, t, scales, block, min_term)
                _reduce_into(y, t, o, acc, low, 0, 0)


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
def integer_matvec(y, x, n, out_features, in_features, scales, codes, block, min_term, xtype, qmax):
    """``y[t, o]`` for ``x[n, K]`` (module doc): x quantised to ``xtype`` blocks (``quantise_activations``, into
    ``xs`` also the scaled sums the min term reads), then ``int8_rows``; ``min_term(o, b, t, xs)``."""
    xq = T.alloc_buffer((n, in_features), xtype)
    xd = T.alloc_buffer((n, in_features // _QBLOCK), "float32")
    xs = T.alloc_buffer((n, in_features // _QBLOCK), "float32")
    amax = T.alloc_buffer((2,), "float32", scope="local")
    quantise_activations(x, xq, xd, xs, n, in_features, amax, qmax)
    int8_rows(y, xq, xd, n, out_features, in_features // _QBLOCK, scales, codes, block,
              lambda o, b, t: min_term(o, b, t, xs))
