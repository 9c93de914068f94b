# fmt: off
"""The decoder's RMS norm of its hidden states, with the residual add before it, as one TIR kernel (tokens in
parallel, 16 lanes a vector).

Relax's ``rms_norm`` and ``add`` are serial scalar loops on the CPU (one thread whatever ``TVM_NUM_THREADS`` says:
at a 1B model's 64-token prefill 7.6 ms of CPU a prefill, run on one core while the other waits); here the add, the
sum of squares and the scaling are one pass over each token's row, tokens on every thread from ``PARALLEL_FROM``
tokens on (fewer: a parallel launch would cost more than the work)::

    for t in range(n):
        s = x[t] + r[t]                      # float32 [hidden]; without ``add``, s = x[t]
        out[t] = s / sqrt(mean(s * s) + eps) * weight
        total[t] = s                         # with ``add``: the residual stream after the add

A token's sum of squares is taken in a fixed order (16 partial sums over the row, the rest of the row added to the
first lanes, then a fixed tree), whatever ``n`` is, so a token's output does not depend on the other tokens (batch
invariance).
"""

from __future__ import annotations

import functools
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

_LANES = 16
#: tokens from which the tokens run in parallel
PARALLEL_FROM = 8


def _tree(acc: Any, lanes: int) -> Any:
    """``acc[0] + ... + acc[lanes - 1]`` as a balanced tree (a fixed order)."""
    if lanes == 1:
        return acc[0]
    half = lanes // 2
    parts = [acc[i] + acc[i + half] for i in range(half)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + len(parts) // 2] for i in range(len(parts) // 2)]
    return parts[0]


@functools.cache
def rms_norm_kernel(hidden: int, eps: float, add: bool) -> tirx.PrimFunc:
    """The module doc's loop for float32 rows of ``hidden``; parameters ``x[n, hidden]``, with ``add`` also
    ``r[n, hidden]``, then ``weight[hidden]``, with ``add`` the output ``total[n, hidden]``, then ``out[n, hidden]``.
    Raises ValueError for a width below 1 or an ``eps`` that is negative or not finite."""
    if hidden < 1:
        raise ValueError(f"the RMS norm's width must be at least 1, got {hidden}")
    if not eps >= 0 or eps == float("inf"):
        raise ValueError(f"the RMS norm's epsilon must be a finite number >= 0, got {eps}")
    full, tail = hidden // _LANES * _LANES, hidden % _LANES
    inv_hidden, epsilon = 1.0 / hidden, float(eps)

    @T.macro
    def token(x, r, w, total, out, t, acc):
        for lane in T.vectorized(_LANES):
            acc[lane] = T.float32(0)
        for c in range(full // _LANES):
            for lane in T.vectorized(_LANES):
                if add:
                    total[t, c * _LANES + lane] = x[t, c * _LANES + lane] + r[t, c * _LANES + lane]
                    acc[lane] = acc[lane] + total[t, c * _LANES + lane] * total[t, c * _LANES + lane]
                else:
                    acc[lane] = acc[lane] + x[t, c * _LANES + lane] * x[t, c * _LANES + lane]
        for j in range(tail):
            if add:
                total[t, full + j] = x[t, full + j] + r[t, full + j]
                acc[j] = acc[j] + total[t, full + j] * total[t, full + j]
            else:
                acc[j] = acc[j] + x[t, full + j] * x[t, full + j]
        acc[_LANES] = T.float32(1) / T.sqrt(_tree(acc, _LANES) * T.float32(inv_hidden) + T.float32(epsilon))
        for c in range(full // _LANES):
            for lane in T.vectorized(_LANES):
                if add:
                    out[t, c * _LANES + lane] = total[t, c * _LANES + lane] * acc[_LANES] * w[c * _LANES + lane]
                else:
                    out[t, c * _LANES + lane] = x[t, c * _LANES + lane] * acc[_LANES] * w[c * _LANES + lane]
        for j in range(tail):
            if add:
                out[t, full + j] = total[t, full + j] * acc[_LANES] * w[full + j]
            else:
                out[t, full + j] = x[t, full + j] * acc[_LANES] * w[full + j]

    @T.macro
    def body(x, r, w, total, out, n):
        if n >= PARALLEL_FROM:
            for t in T.parallel(n):
                acc = T.alloc_buffer((_LANES + 1,), "float32", scope="local")
                token(x, r, w, total, out, t, acc)
        else:
            acc = T.alloc_buffer((_LANES + 1,), "float32", scope="local")
            for t in range(n):
                token(x, r, w, total, out, t, acc)

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
