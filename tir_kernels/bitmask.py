# fmt: off
"""apply_bitmask_inplace: set logits of disallowed tokens to -inf, on the rows that carry a mask.

Operation, with logits float32 ``[batch, vocab]``, row_ids int32 ``[num_rows]`` (distinct rows of logits) and bitmask
int32 ``[num_rows, num_words]`` (``num_words >= ceil(vocab / 32)``; bit ``v % 32`` of word ``v // 32`` set = allowed)::

    for i in range(num_rows):
        r = row_ids[i]
        if not (0 <= r < batch and num_words * 32 >= vocab):  # a guard: the runtime never sends such a row
            continue
        for v in range(vocab):
            if (bitmask[i, v // 32] >> (v % 32)) & 1 == 0:
                logits[r, v] = -inf

Rows not named in row_ids are not touched. The runtime applies this stage last, after bias and penalties, so nothing
is ever subtracted from a masked logit; the softmax turns -inf into a probability of exactly 0.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from ._common import CALLER_ARRAY_ALIGN, is_cpu, max_threads, neg_inf

NAME = kernel_abi.BITMASK


def _keep_if_allowed(x: tirx.PrimExpr, word: tirx.PrimExpr, bit: tirx.PrimExpr) -> tirx.PrimExpr:
    """The element formula: x where the bit is set, -inf otherwise (a select, so vector code stays branch-free)."""
    return T.Select(T.bitwise_and(T.shift_right(word, bit), 1) == 1, x, neg_inf())


def _cpu() -> tirx.PrimFunc:
    # Rows in parallel; each full 32-token word is one branch-free vector select, then a scalar tail.
    @T.prim_func
    def apply_bitmask_inplace(var_logits: T.handle, var_row_ids: T.handle, var_bitmask: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab, num_rows, num_words = T.int32(), T.int32(), T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        row_ids = T.match_buffer(var_row_ids, (num_rows,), "int32")
        bitmask = T.match_buffer(var_bitmask, (num_rows, num_words), "int32")
        for i in T.parallel(num_rows):
            r: T.let = row_ids[i]
            if r >= 0 and r < batch and num_words * 32 >= vocab:
                for w in range(vocab // 32):
                    word: T.let = bitmask[i, w]
                    for b in T.vectorized(32):
                        logits[r, w * 32 + b] = _keep_if_allowed(logits[r, w * 32 + b], word, b)
                for b in range(vocab % 32):
                    logits[r, vocab // 32 * 32 + b] = _keep_if_allowed(
                        logits[r, vocab // 32 * 32 + b], bitmask[i, vocab // 32], b)
    return apply_bitmask_inplace


def _gpu(threads: int) -> tirx.PrimFunc:
    # One block row per masked row (blockIdx.y), threads along the vocabulary: no division per element.
    @T.prim_func
    def apply_bitmask_inplace(var_logits: T.handle, var_row_ids: T.handle, var_bitmask: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab, num_rows, num_words = T.int32(), T.int32(), T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        row_ids = T.match_buffer(var_row_ids, (num_rows,), "int32")
        bitmask = T.match_buffer(var_bitmask, (num_rows, num_words), "int32")
        for i in T.thread_binding(num_rows, thread="blockIdx.y"):
            for bx in T.thread_binding((vocab + threads - 1) // threads, thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    if (bx * threads + tx < vocab and row_ids[i] >= 0 and row_ids[i] < batch
                            and num_words * 32 >= vocab):
                        v: T.let = bx * threads + tx
                        logits[row_ids[i], v] = _keep_if_allowed(logits[row_ids[i], v], bitmask[i, v // 32], v % 32)
    return apply_bitmask_inplace


def get_apply_bitmask_inplace(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    return _cpu() if is_cpu(target) else _gpu(max_threads(target))
