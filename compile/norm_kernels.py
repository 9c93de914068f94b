# fmt: off
"""The decoder's RMS norm of its hidden states (with the residual add before it) as one TIR kernel whose tokens run
in parallel, computing bit for bit what Relax's ``rms_norm`` computes.

Relax lowers ``nn.op.rms_norm`` to TOPI's blocks, one serial loop nest each on one thread (whatever
``TVM_NUM_THREADS`` says), and the residual add before it to another::

    sq[t, i] = x[t, i] * x[t, i]                          # a block of its own: each square rounded to float32
    s[t] = 0; for i in 0 .. hidden - 1: s[t] = s[t] + sq[t, i]   # in index order, one float32 sum per token
    r[t] = rsqrt(s[t] / float32(hidden) + float32(eps))  # LLVM: 1 / sqrt(...), IEEE division and square root
    out[t, i] = r[t] * x[t, i] * w[i]                    # (r * x) * w

This kernel runs the same operations on the same float32 values in the same order for each token, so its outputs
are those of the Relax lowering bit for bit (the tests compare them), and a token's result does not depend on the
other tokens (batch invariance). What differs is only the scheduling: tiles of ``TILE`` tokens run in parallel
from ``PARALLEL_FROM`` tokens on; a tile's sums run side by side (``TILE`` independent chains, one float32 sum per
token in index order, so the sums' latency overlaps); the add, the squares and the scaling are vectors of 16 (each
lane its own element's operation). The squares are stored to a buffer and summed from it in a separate loop: LLVM
(TVM builds with floating-point contraction on) would otherwise fuse ``s + x * x`` into one FMA, rounded once
instead of twice, the difference that made an earlier fused norm change SmolLM2's answers. With ``add`` the kernel
takes ``x + r`` first (one float32 add, as Relax's ``add``) and also writes that sum, the residual stream.
"""

from __future__ import annotations

import functools
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

#: a vector's float32 lanes (the add, the squares and the scaling)
_LANES = 16
#: tokens a tile sums side by side
TILE = 8
#: elements of a token's row squared before they are summed (a tile's squares: TILE x _CHUNK floats on the stack)
_CHUNK = 128
#: tokens from which the tiles run in parallel (fewer: a parallel launch would cost more than the work)
PARALLEL_FROM = 16


def _fenced(value: Any) -> Any:
    """``value`` behind ``llvm.arithmetic.fence``: LLVM may not contract it with the operation it feeds (a square
    stored and loaded back could otherwise be forwarded into the sum and fused with it where the loops unroll)."""
    return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id("llvm.arithmetic.fence"), value, dtype="float32")


@functools.cache
def rms_norm_kernel(hidden: int, eps: float, add: bool) -> tirx.PrimFunc:
    """The module doc's operations for float32 rows of ``hidden``; parameters ``x[n, hidden]``, with ``add`` also
    ``r[n, hidden]``, then ``weight[hidden]``, with ``add`` the output ``total[n, hidden] = x + r``, then
    ``out[n, hidden]``. Raises ValueError for a width below 1 or an ``eps`` that is negative or not finite."""
    if hidden < 1:
        raise ValueError(f"the RMS norm's width must be at least 1, got {hidden}")
    if not eps >= 0 or eps == float("inf"):
        raise ValueError(f"the RMS norm's epsilon must be a finite number >= 0, got {eps}")
    chunk = min(_CHUNK, hidden)
    chunks, rest = hidden // chunk, hidden % chunk
    epsilon, width = float(eps), float(hidden)

    @T.macro
    def squares(x, r, total, sq, t0, count, start, size):
        """``sq[j, :size]`` = the squares of token ``t0 + j``'s elements ``start ..`` (the add first)."""
        for j in range(count):
            for c in range(size // _LANES):
                for lane in T.vectorized(_LANES):
                    if add:
                        total[t0 + j, start + c * _LANES + lane] = (x[t0 + j, start + c * _LANES + lane]
                                                                    + r[t0 + j, start + c * _LANES + lane])
                        sq[j, c * _LANES + lane] = (total[t0 + j, start + c * _LANES + lane]
                                                    * total[t0 + j, start + c * _LANES + lane])
                    else:
                        sq[j, c * _LANES + lane] = (x[t0 + j, start + c * _LANES + lane]
                                                    * x[t0 + j, start + c * _LANES + lane])
            for k in range(size % _LANES):
                if add:
                    total[t0 + j, start + size // _LANES * _LANES + k] = (
                        x[t0 + j, start + size // _LANES * _LANES + k] + r[t0 + j, start + size // _LANES * _LANES + k])
                    sq[j, size // _LANES * _LANES + k] = (total[t0 + j, start + size // _LANES * _LANES + k]
                                                          * total[t0 + j, start + size // _LANES * _LANES + k])
                else:
                    sq[j, size // _LANES * _LANES + k] = (x[t0 + j, start + size // _LANES * _LANES + k]
                                                          * x[t0 + j, start + size // _LANES * _LANES + k])

    @T.macro
    def tile(x, r, w, total, out, t0, count):
        """Tokens ``t0 .. t0 + count - 1``: the module doc's operations, their sums side by side."""
        sq = T.alloc_buffer((count, chunk), "float32", scope="local")
        acc = T.alloc_buffer((count,), "float32", scope="local")
        for j in T.unroll(count):
            acc[j] = T.float32(0)
        for b in range(chunks):
            squares(x, r, total, sq, t0, count, b * chunk, chunk)
            for i in range(chunk):
                for j in T.unroll(count):
                    acc[j] = acc[j] + _fenced(sq[j, i])
        if rest > 0:
            squares(x, r, total, sq, t0, count, chunks * chunk, rest)
            for i in range(rest):
                for j in T.unroll(count):
                    acc[j] = acc[j] + _fenced(sq[j, i])
        for j in T.unroll(count):
            acc[j] = T.rsqrt(acc[j] / T.float32(width) + T.float32(epsilon))
        for j in range(count):
            for c in range(hidden // _LANES):
                for lane in T.vectorized(_LANES):
                    if add:
                        out[t0 + j, c * _LANES + lane] = (acc[j] * total[t0 + j, c * _LANES + lane]
                                                          * w[c * _LANES + lane])
                    else:
                        out[t0 + j, c * _LANES + lane] = acc[j] * x[t0 + j, c * _LANES + lane] * w[c * _LANES + lane]
            for k in range(hidden % _LANES):
                if add:
                    out[t0 + j, hidden // _LANES * _LANES + k] = (acc[j] * total[t0 + j, hidden // _LANES * _LANES + k]
                                                                  * w[hidden // _LANES * _LANES + k])
                else:
                    out[t0 + j, hidden // _LANES * _LANES + k] = (acc[j] * x[t0 + j, hidden // _LANES * _LANES + k]
                                                                  * w[hidden // _LANES * _LANES + k])

    @T.macro
    def body(x, r, w, total, out, n):
        if n >= PARALLEL_FROM:
            for g in T.parallel((n + TILE - 1) // TILE):
                if g * TILE + TILE <= n:
                    tile(x, r, w, total, out, g * TILE, TILE)
                else:
                    for t in range(n - g * TILE):
                        tile(x, r, w, total, out, g * TILE + t, 1)
        else:
            for g in range(n // TILE):
                tile(x, r, w, total, out, g * TILE, TILE)
            for t in range(n % TILE):
                tile(x, r, w, total, out, n // TILE * TILE + t, 1)

    if add:
        @T.prim_func(private=True)
        def add_rms_norm(var_x: T.handle, var_r: T.handle, w: T.Buffer((hidden,), "float32"), var_total: T.handle,
                         var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, hidden), "float32")
            r = T.match_buffer(var_r, (n, hidden), "float32")
            total = T.match_buffer(var_total, (n, hidden), "float32")
            out = T.match_buffer(var_out, (n, hidden), "float32")
            body(x, r, w, total, out, n)

        return add_rms_norm

    @T.prim_func(private=True)
    def rms_norm(var_x: T.handle, w: T.Buffer((hidden,), "float32"), var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, hidden), "float32")
        out = T.match_buffer(var_out, (n, hidden), "float32")
        body(x, x, w, x, out, n)

    return rms_norm
