# fmt: off
"""softmax_with_temperature: per-row softmax of logits / temperature, greedy one-hot at temperature 0.

Operation, with logits float32 ``[batch, vocab]``, temperature float32 ``[batch]`` (>= 0) and probs float32
``[batch, vocab]`` (written)::

    for r in range(batch):
        m = max(logits[r])
        if m == -inf:                                   # every token masked
            probs[r, :] = 0
        elif temperature[r] == 0:                       # greedy: one-hot on the argmax, lowest id on ties
            probs[r, :] = 0
            probs[r, min(v for v in range(vocab) if logits[r, v] == m)] = 1
        else:
            e = exp((logits[r] - m) * (1 / temperature[r]))   # exactly 0 where logits[r, v] == -inf
            probs[r] = e / sum(e)

A temperature in (0, 1e-38] uses the inverse temperature FLT_MAX instead of overflowing: the row becomes uniform over
its tied maxima (the limit t -> 0+). Numerically stable for any vocab (the max is subtracted before exp); the sum is
accumulated in float32 over many partials (CPU: 64 lanes, each adding blocks of 1024 tokens into the row total; GPU:
one partial per thread, then a tree), within a few 1e-7 of the exact sum at vocab 262144.

CPU: rows in parallel; per row one pass reads the logits from memory (``cpu_row_softmax_pass``: an online maximum
per chunk of 1024 values, exps ``2**((x - running max) * log2(e) / t)`` written to probs and summed), then the chunks
whose running maximum was below the row's are rescaled and a scale pass multiplies by 1 / sum (the rows are hot in
L2). Greedy rows take a max pass, a first-index-of-max pass and a one-hot write instead. The exps and sums are those
of ``sample_from_logits``, which runs the same macros.
GPU: one block per row, threads striding over the vocabulary, block allreduces for the max, the sum and (at
temperature 0) the first index of the max; the exps are recomputed in the final write pass rather than stored and
reloaded.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from ._common import CALLER_ARRAY_ALIGN, is_cpu, max_threads, neg_inf
from ._reductions import (
    CPU_CHUNK,
    CPU_WORD,
    INT32_MAX,
    add,
    cpu_first_index_of,
    cpu_rescale_chunks,
    cpu_row_map,
    cpu_row_max,
    cpu_row_softmax_pass,
    exp2_scale,
    gpu_row_fold,
    gpu_row_map,
    guarded_exp,
    index_where,
    inverse_temperature,
    maximum,
    minimum,
    row_of,
    safe_shift,
    shifted_exp,
)

NAME = kernel_abi.SOFTMAX


def _one_hot(v: tirx.PrimExpr, hot: tirx.PrimExpr) -> tirx.PrimExpr:
    """1 at token ``hot``, 0 elsewhere (``hot == vocab`` gives a row of zeros)."""
    return T.Select(v == hot, T.float32(1), T.float32(0))


def inverse_sum(total: tirx.PrimExpr) -> tirx.PrimExpr:
    """1 / sum of the exps, or 0 for an empty sum (a row of only -inf), so that the scaled row is zeros, not NaN."""
    return T.Select(total > T.float32(0), T.float32(1) / total, T.float32(0))


# Per-token values for the row maps (callables v -> PrimExpr, built at parse time from the row's scalars).


def _zeros() -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    return lambda v: T.float32(0)


def _one_hot_at(hot: tirx.PrimExpr) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    return lambda v: _one_hot(v, hot)


def _scaled(buf: tirx.Buffer, r: tirx.PrimExpr, factor: tirx.PrimExpr) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    return lambda v: buf[r, v] * factor


def probability(value: Callable[[tirx.PrimExpr], tirx.PrimExpr], greedy: tirx.PrimExpr, hot: tirx.PrimExpr,
                shift: tirx.PrimExpr, scale: tirx.PrimExpr,
                inv_sum: tirx.PrimExpr) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """The whole formula in one pass (GPU), on the row read as value(v): one-hot when greedy, else the exp
    recomputed and scaled by 1 / sum."""
    return lambda v: T.Select(greedy, _one_hot(v, hot), shifted_exp(value(v), shift, scale, guarded_exp) * inv_sum)


def _numerator(value: Callable[[tirx.PrimExpr], tirx.PrimExpr], shift: tirx.PrimExpr,
               scale: tirx.PrimExpr) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """The GPU softmax numerator of value(v)."""
    return lambda v: shifted_exp(value(v), shift, scale, guarded_exp)


def _cpu() -> tirx.PrimFunc:
    @T.prim_func
    def softmax_with_temperature(var_logits: T.handle, var_temperature: T.handle, var_probs: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        temperature = T.match_buffer(var_temperature, (batch,), "float32")
        probs = T.match_buffer(var_probs, (batch, vocab), "float32")
        for r in T.parallel(batch):
            lanes = T.alloc_buffer((CPU_WORD,), "float32", scope="global")
            block = T.alloc_buffer((CPU_WORD,), "float32", scope="global")
            index_lanes = T.alloc_buffer((CPU_WORD,), "int32", scope="global")
            index_block = T.alloc_buffer((CPU_WORD,), "int32", scope="global")
            part = T.alloc_buffer((CPU_WORD,), "float32", scope="global")
            mx = T.alloc_buffer((CPU_WORD,), "float32", scope="global")
            run = T.alloc_buffer((2,), "float32", scope="global")
            shifts = T.alloc_buffer((vocab // CPU_CHUNK + 1,), "float32", scope="global")
            row_max = T.alloc_buffer((1,), "float32", scope="global")
            row_sum = T.alloc_buffer((1,), "float32", scope="global")
            hot = T.alloc_buffer((1,), "int32", scope="global")
            if temperature[r] == T.float32(0):
                cpu_row_max(logits, r, vocab, lanes, block, row_max)
                if row_max[0] == neg_inf():
                    cpu_row_map(probs, r, vocab, _zeros())
                else:
                    cpu_first_index_of(logits, r, vocab, row_max[0], index_lanes, index_block, hot)
                    cpu_row_map(probs, r, vocab, _one_hot_at(hot[0]))
            else:
                # exps into probs in one pass (zeros for a row of only -inf), then scaled by 1 / sum
                scale2: T.let = exp2_scale(temperature[r])
                cpu_row_softmax_pass(logits, r, row_of(logits, r), None, vocab, scale2, probs, r, shifts,
                                     lanes, part, mx, run, row_sum)
                cpu_rescale_chunks(probs, r, vocab, scale2, shifts, run[0])
                inv_sum: T.let = inverse_sum(row_sum[0])
                cpu_row_map(probs, r, vocab, _scaled(probs, r, inv_sum))
    return softmax_with_temperature


@T.macro
def gpu_row_stats(value, vocab, t, tx, threads, row_max, row_sum, hot):
    """One block per row, reading it as value(v), at temperature t: row_max[0] = the row's maximum, row_sum[0] = the
    sum of its softmax numerators, hot[0] = the first index of the maximum when greedy (t = 0) on a row with a finite
    maximum, else vocab (no token). The results are local (1,) buffers every thread of the block reads."""
    part = T.alloc_buffer((1,), "float32", scope="local")
    index_part = T.alloc_buffer((1,), "int32", scope="local")
    gpu_row_fold(vocab, tx, threads, neg_inf(), neg_inf(), maximum, value, True, part, row_max)
    # the row's scalars bound once: an all-reduce result lives in shared memory (read as volatile), and inside the
    # per-element formula it would be re-read, and 1 / t recomputed, for every element
    peak: T.let = row_max[0]
    shift: T.let = safe_shift(peak)
    scale: T.let = inverse_temperature(t)
    gpu_row_fold(vocab, tx, threads, T.float32(0), T.float32(0), add, _numerator(value, shift, scale), True, part,
                 row_sum)
    gpu_row_fold(vocab, tx, threads, vocab, T.int32(INT32_MAX), minimum, index_where(value, peak, vocab),
                 t == T.float32(0) and peak != neg_inf(), index_part, hot)


def _gpu(threads: int) -> tirx.PrimFunc:
    @T.prim_func
    def softmax_with_temperature(var_logits: T.handle, var_temperature: T.handle, var_probs: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        temperature = T.match_buffer(var_temperature, (batch,), "float32")
        probs = T.match_buffer(var_probs, (batch, vocab), "float32")
        for bx in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                row_max = T.alloc_buffer((1,), "float32", scope="local")
                row_sum = T.alloc_buffer((1,), "float32", scope="local")
                hot = T.alloc_buffer((1,), "int32", scope="local")
                gpu_row_stats(row_of(logits, bx), vocab, temperature[bx], tx, threads, row_max, row_sum, hot)
                shift: T.let = safe_shift(row_max[0])
                scale: T.let = inverse_temperature(temperature[bx])
                greedy: T.let = temperature[bx] == T.float32(0)
                inv_sum: T.let = inverse_sum(row_sum[0])
                gpu_row_map(probs, bx, vocab, tx, threads,
                            probability(row_of(logits, bx), greedy, hot[0], shift, scale, inv_sum))
    return softmax_with_temperature


def get_softmax_with_temperature(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    return _cpu() if is_cpu(target) else _gpu(max_threads(target))
