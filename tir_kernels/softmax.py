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
GPU: each row split over blocks of SPLIT_THREADS threads, SPLIT_CHUNK values each (a split that depends on the
vocabulary alone, so a row's result does not depend on the batch; 63 blocks per row at vocab 128256), in three
kernels passing their results through workspaces: each block reads its chunk once (GPU_UNROLL values a thread, in
registers) and records its maximum, the sum of its exps against it and the first index holding it
(``split_chunk_stats``); one warp per row combines the chunks in a fixed order (``row_stats_of_parts``); each block
writes its chunk, recomputing the exps (the logits are read twice, the second time from L2 where they fit, and the
probabilities written once). ``sample_from_logits`` runs the same two macros, so its probabilities are these, bit for
bit.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from ._common import CALLER_ARRAY_ALIGN, is_cpu, neg_inf
from ._reductions import (
    CPU_CHUNK,
    CPU_WORD,
    GPU_UNROLL,
    INT32_MAX,
    SPLIT_CHUNK,
    SPLIT_THREADS,
    add,
    block_all,
    cpu_first_index_of,
    cpu_rescale_chunks,
    cpu_row_map,
    cpu_row_max,
    cpu_row_softmax_pass,
    exp2_scale,
    guarded_exp,
    inverse_temperature,
    maximum,
    minimum,
    row_of,
    safe_shift,
    shifted_exp,
    split_parts,
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


def _peak_of(xs: tirx.Buffer) -> tirx.PrimExpr:
    """The largest of xs[0 .. GPU_UNROLL) as a tree of maxima."""
    values = [xs[u] for u in range(GPU_UNROLL)]
    while len(values) > 1:
        values = [T.max(a, b) for a, b in zip(values[::2], values[1::2], strict=True)] + values[len(values) // 2 * 2:]
    return values[0]


def _sum_exps(xs: tirx.Buffer, shift: tirx.PrimExpr, scale: tirx.PrimExpr) -> tirx.PrimExpr:
    """The sum of the softmax numerators of xs[0 .. GPU_UNROLL)."""
    total = shifted_exp(xs[0], shift, scale, guarded_exp)
    for u in range(1, GPU_UNROLL):
        total = total + shifted_exp(xs[u], shift, scale, guarded_exp)
    return total


def _first_of(xs: tirx.Buffer, peak: tirx.PrimExpr, base: tirx.PrimExpr, tx: tirx.Var,
              vocab: tirx.PrimExpr) -> tirx.PrimExpr:
    """The lowest index base + u * SPLIT_THREADS + tx (< vocab) whose value xs[u] equals peak, else vocab."""
    first = vocab
    for u in reversed(range(GPU_UNROLL)):
        i = base + u * SPLIT_THREADS + tx
        first = T.Select(T.And(i < vocab, xs[u] == peak), i, first)
    return first


@T.macro
def split_chunk_stats(value, vocab, t, b, tx, part_max, part_sum, part_first):
    """Block b of a split kernel (SPLIT_THREADS threads ``tx``; row b // parts, its chunk b % parts), reading the row
    as value(i): part_max[b], part_sum[b], part_first[b] = the chunk's maximum, the sum of its softmax numerators
    against it at temperature t, the first index holding it (vocab where none). The chunk is read once (GPU_UNROLL
    values a thread, kept in registers); thread 0 writes."""
    xs = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
    peak = T.alloc_buffer((1,), "float32", scope="local")
    total = T.alloc_buffer((1,), "float32", scope="local")
    first = T.alloc_buffer((1,), "int32", scope="local")
    base: T.let = b % split_parts(vocab) * SPLIT_CHUNK
    scale: T.let = inverse_temperature(t)
    for u in T.unroll(GPU_UNROLL):
        xs[u] = T.if_then_else(base + u * SPLIT_THREADS + tx < vocab,
                               value(T.min(base + u * SPLIT_THREADS + tx, vocab - 1)), neg_inf())
    block_all(maximum, neg_inf(), _peak_of(xs), peak, tx)
    m: T.let = peak[0]
    block_all(add, T.float32(0), _sum_exps(xs, safe_shift(m), scale), total, tx)
    block_all(minimum, T.int32(INT32_MAX), _first_of(xs, m, base, tx, vocab), first, tx)
    if tx == 0:
        part_max[b] = m
        part_sum[b] = total[0]
        part_first[b] = first[0]


@T.macro
def row_stats_of_parts(part_max, part_sum, part_first, r, vocab, t, stats, hot):
    """Row r's softmax statistics from its blocks' partials (``split_chunk_stats``), in every thread that runs it, in
    a fixed order (the same numbers in every kernel that calls it): stats[0] = the maximum, stats[1] = the sum of the
    numerators, hot[0] = the first index of the maximum (vocab for a row of only -inf)."""
    parts: T.let = split_parts(vocab)
    scale: T.let = inverse_temperature(t)
    stats[0] = neg_inf()
    for p in range(parts):
        stats[0] = T.max(stats[0], part_max[r * parts + p])
    top: T.let = stats[0]
    shift: T.let = safe_shift(top)
    stats[1] = T.float32(0)
    hot[0] = vocab
    for p in range(parts):
        stats[1] = stats[1] + part_sum[r * parts + p] * shifted_exp(part_max[r * parts + p], shift, scale,
                                                                    guarded_exp)
        hot[0] = T.Select(part_max[r * parts + p] == top, T.min(hot[0], part_first[r * parts + p]), hot[0])
    hot[0] = T.Select(top == neg_inf(), vocab, hot[0])


def _gpu_split() -> tirx.PrimFunc:
    threads = SPLIT_THREADS

    @T.prim_func
    def softmax_with_temperature(var_logits: T.handle, var_temperature: T.handle, var_probs: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        temperature = T.match_buffer(var_temperature, (batch,), "float32")
        probs = T.match_buffer(var_probs, (batch, vocab), "float32")
        # workspaces: each block's partials (a row's blocks are consecutive), then each row's statistics
        part_max = T.alloc_buffer((batch * split_parts(vocab),), "float32", scope="global")
        part_sum = T.alloc_buffer((batch * split_parts(vocab),), "float32", scope="global")
        part_first = T.alloc_buffer((batch * split_parts(vocab),), "int32", scope="global")
        row_max = T.alloc_buffer((batch,), "float32", scope="global")
        row_sum = T.alloc_buffer((batch,), "float32", scope="global")
        row_hot = T.alloc_buffer((batch,), "int32", scope="global")
        # kernel 1: each block's chunk, read once
        for b in T.thread_binding(batch * split_parts(vocab), thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                split_chunk_stats(row_of(logits, b // split_parts(vocab)), vocab,
                                  temperature[b // split_parts(vocab)], b, tx, part_max, part_sum, part_first)
        # kernel 2: each row's statistics from its blocks' partials (one warp a row, thread 0 writes)
        for r in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                stats = T.alloc_buffer((2,), "float32", scope="local")
                hot = T.alloc_buffer((1,), "int32", scope="local")
                row_stats_of_parts(part_max, part_sum, part_first, r, vocab, temperature[r], stats, hot)
                if tx == 0:
                    row_max[r] = stats[0]
                    row_sum[r] = stats[1]
                    row_hot[r] = hot[0]
        # kernel 3: each block writes its chunk of the row
        for b in T.thread_binding(batch * split_parts(vocab), thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                r: T.let = b // split_parts(vocab)
                base: T.let = b % split_parts(vocab) * SPLIT_CHUNK
                shift: T.let = safe_shift(row_max[r])
                scale: T.let = inverse_temperature(temperature[r])
                greedy: T.let = temperature[r] == T.float32(0)
                inv_sum: T.let = inverse_sum(row_sum[r])
                hot: T.let = row_hot[r]
                for u in T.unroll(GPU_UNROLL):
                    if base + u * threads + tx < vocab:
                        probs[r, base + u * threads + tx] = probability(
                            row_of(logits, r), greedy, hot, shift, scale, inv_sum)(base + u * threads + tx)
    return softmax_with_temperature


def get_softmax_with_temperature(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    return _cpu() if is_cpu(target) else _gpu_split()
