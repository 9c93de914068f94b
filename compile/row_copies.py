# fmt: off
"""The attention's two row copies as TIR kernels with the tokens in parallel: each token's fused q/k/v row padded
with zeros up to the KV cache's heads, and the first columns of each row of the attention's output (the query
heads, without the rows that carry the stored keys and values).

Relax's ``concat`` with ``zeros`` and its ``split`` did these as serial scalar loops (three kernels, one of them a
second output nobody reads); these are one kernel each (one builder, ``_column_copy``), copies of the same values
(so the same bits), 16 elements a vector, tokens in parallel from ``PARALLEL_FROM`` tokens on.
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

_LANES = 16
#: tokens from which the tokens run in parallel (fewer: a parallel launch would cost more than the copy)
PARALLEL_FROM = 16


def _check(width: int, other: int, dtype: str) -> None:
    if width < 1 or other < 1:
        raise ValueError(f"row widths must be at least 1, got {width} and {other}")
    if dtype not in ("float16", "float32"):
        raise ValueError(f"row copies are of float16 or float32 rows, got {dtype!r}")


@functools.cache
def pad_rows_kernel(width: int, padded: int, dtype: str) -> tirx.PrimFunc:
    """``out[t, :width] = x[t]``, ``out[t, width:] = 0`` for ``x[n, width]`` and ``out[n, padded]`` of ``dtype``.
    Raises ValueError for a width below 1, a ``padded`` below ``width`` or another type than float16 / float32."""
    _check(width, padded, dtype)
    if padded < width:
        raise ValueError(f"rows of {width} cannot be padded to {padded}")
    return _column_copy(width, padded, dtype)


@functools.cache
def first_columns_kernel(width: int, kept: int, dtype: str) -> tirx.PrimFunc:
    """``out[t] = x[t, :kept]`` for ``x[n, width]`` and ``out[n, kept]`` of ``dtype``. Raises ValueError for a
    width below 1, ``kept`` not in 1 .. ``width`` or another type than float16 / float32."""
    _check(width, kept, dtype)
    if kept > width:
        raise ValueError(f"{kept} columns cannot be kept of rows of {width}")
    return _column_copy(width, kept, dtype)


def _column_copy(width: int, out_width: int, dtype: str) -> tirx.PrimFunc:
    """``out[t, :c] = x[t, :c]`` with ``c = min(width, out_width)``, the rest of ``out[t]`` zeros, for ``x[n,
    width]`` and ``out[n, out_width]``: both kernels above (sizes checked by them)."""
    copied = min(width, out_width)

    @T.macro
    def row(x, out, t):
        for c in range(copied // _LANES):
            for lane in T.vectorized(_LANES):
                out[t, c * _LANES + lane] = x[t, c * _LANES + lane]
        for k in range(copied % _LANES):
            out[t, copied // _LANES * _LANES + k] = x[t, copied // _LANES * _LANES + k]
        for k in range(out_width - copied):
            out[t, copied + k] = T.Cast(dtype, 0)

    # s_tir: a root block, which Relax's reshape-pattern check asks of one-input kernels
    @T.prim_func(private=True, s_tir=True)
    def column_copy(var_x: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})  # opaque: not to be fused
        n = T.int64()
        x = T.match_buffer(var_x, (n, width), dtype)
        out = T.match_buffer(var_out, (n, out_width), dtype)
        with T.sblock("root"):
            if n >= PARALLEL_FROM:
                for t in T.parallel(n):
                    row(x, out, t)
            else:
                for t in range(n):
                    row(x, out, t)

    return column_copy
