# fmt: off
"""top_n: per row, the n largest values in decreasing order (equal values: lower index first) and their indices.

Operation, with x float32 ``[batch, vocab]``, values float32 ``[batch, n]`` and indices int32 ``[batch, n]``; ``n`` is
the runtime width of the output buffers (any ``1 <= n <= vocab``, typically 1..20), not a compile-time constant::

    for r in range(batch):
        prev_v, prev_i = +inf, -1                 # ranks before every entry
        for j in range(n):
            best_v, best_i = -inf, NO_INDEX
            for i in range(vocab):
                v = x[r, i]
                ranks_after_prev = v < prev_v or (v == prev_v and i > prev_i)
                if ranks_after_prev and (v > best_v or (v == best_v and i < best_i)):
                    best_v, best_i = v, i
            values[r, j], indices[r, j] = best_v, (best_i if best_i != NO_INDEX else -1)
            prev_v, prev_i = best_v, best_i

i.e. n rounds of argmax, round j taking the largest (value, -index) pair strictly below the one of round j-1: exact
for duplicates and -inf (masked) values, equal to ``reference.top_n``. On CPUs rows in parallel, each with
``_select.row_top_cpu``: one vectorised pass for block maxima, a short list of the only entries that can be selected,
and the rounds on that list (so n = 20 costs about one pass, not 20). On GPUs, for n <= 32, each row split over
blocks (``_top_split``: group maxima, the row's bound, each chunk's candidates at or above it, a merge by ranks in one
block per row; two reads of the row); larger n, and rows whose candidates do not fit (long runs of equal values above
the bound), take one block per row: ``_select.row_top_gpu``'s rounds (a strided scan and two block all-reduces each).

``n > vocab`` is a caller error (the runtime rejects it); the kernel then fills the slots past ``vocab`` with value
-inf and index -1 rather than reading out of bounds. NaN is never selected (logits are never NaN).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from ._common import CALLER_ARRAY_ALIGN, is_cpu, max_threads
from ._select import row_top_cpu
from ._top_split import merge_capacity, split_top_n

NAME = kernel_abi.TOP_N


def _cpu() -> tirx.PrimFunc:
    @T.prim_func
    def top_n(var_x: T.handle, var_values: T.handle, var_indices: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab, n = T.int32(), T.int32(), T.int32()
        x = T.match_buffer(var_x, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        values = T.match_buffer(var_values, (batch, n), "float32")
        indices = T.match_buffer(var_indices, (batch, n), "int32")
        for r in T.parallel(batch):
            row_top_cpu(x, r, vocab, n, values, indices, r)
    return top_n


def _gpu(threads: int, uniform_loops: bool, cap: int) -> tirx.PrimFunc:
    top = split_top_n(threads, uniform_loops, cap)

    @T.prim_func
    def top_n(var_x: T.handle, var_values: T.handle, var_indices: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab, n = T.int32(), T.int32(), T.int32()
        x = T.match_buffer(var_x, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        values = T.match_buffer(var_values, (batch, n), "float32")
        indices = T.match_buffer(var_indices, (batch, n), "int32")
        top(x, batch, vocab, n, values, indices)
    return top_n


def get_top_n(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    if is_cpu(target):
        return _cpu()
    threads = max_threads(target)
    return _gpu(threads, uniform_loops=target.kind.name == "webgpu", cap=merge_capacity(target, threads))
