# fmt: off
"""argmax: per row, the index of the largest value (lowest index on ties) and that value.

Operation, with x float32 ``[batch, vocab]`` (``vocab >= 1``), index int32 ``[batch]`` and value float32 ``[batch]``::

    for r in range(batch):
        best_v, best_i = -inf, NO_INDEX
        for i in range(vocab):
            if x[r, i] > best_v or (x[r, i] == best_v and i < best_i):
                best_v, best_i = x[r, i], i
        index[r], value[r] = best_i, best_v

A row of only -inf gives index 0, value -inf (as ``reference.argmax``). NaN is never selected (logits are never NaN;
numpy would return the first NaN; a row of only NaN gives index 0, value -inf). The selection is shared with top_n
(see ``_select``): on CPUs rows in parallel, 64 per-lane partials (4 vector registers) in a branch-free vectorised
loop, a lane merge and a scalar tail; on GPUs one block per row, threads striding over the vocabulary, then block
all-reduces of the value and of the lowest index holding it.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from ._common import CALLER_ARRAY_ALIGN, is_cpu, max_threads
from ._reductions import row_of
from ._select import CPU_WIDTH, NO_INDEX, row_best_cpu, row_best_gpu

NAME = kernel_abi.ARGMAX


def _out_index(best_i: tirx.PrimExpr) -> tirx.PrimExpr:
    """The index written out: 0 where nothing was selectable (a row of only NaN), so it is always a valid token id."""
    return T.Select(best_i == NO_INDEX, T.int32(0), best_i)


def _cpu() -> tirx.PrimFunc:
    @T.prim_func
    def argmax(var_x: T.handle, var_index: T.handle, var_value: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        x = T.match_buffer(var_x, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        index = T.match_buffer(var_index, (batch,), "int32")
        value = T.match_buffer(var_value, (batch,), "float32")
        for r in T.parallel(batch):
            lane_v = T.alloc_buffer((CPU_WIDTH,), "float32", scope="local")
            lane_i = T.alloc_buffer((CPU_WIDTH,), "int32", scope="local")
            lane_take = T.alloc_buffer((CPU_WIDTH,), "int8", scope="local")
            best_v = T.alloc_buffer((1,), "float32", scope="local")
            best_i = T.alloc_buffer((1,), "int32", scope="local")
            row_best_cpu(x, r, vocab, None, None, lane_v, lane_i, lane_take, best_v, best_i)
            index[r] = _out_index(best_i[0])
            value[r] = best_v[0]
    return argmax


def _gpu(threads: int) -> tirx.PrimFunc:
    @T.prim_func
    def argmax(var_x: T.handle, var_index: T.handle, var_value: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        x = T.match_buffer(var_x, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        index = T.match_buffer(var_index, (batch,), "int32")
        value = T.match_buffer(var_value, (batch,), "float32")
        for r in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                part_v = T.alloc_buffer((1,), "float32", scope="local")
                part_i = T.alloc_buffer((1,), "int32", scope="local")
                best_v = T.alloc_buffer((1,), "float32", scope="local")
                best_i = T.alloc_buffer((1,), "int32", scope="local")
                row_best_gpu(row_of(x, r), vocab, None, None, tx, threads, part_v, part_i, best_v, best_i)
                if tx == 0:
                    index[r] = _out_index(best_i[0])
                    value[r] = best_v[0]
    return argmax


def get_argmax(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    return _cpu() if is_cpu(target) else _gpu(max_threads(target))
