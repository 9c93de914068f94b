# fmt: off
"""log_softmax_gather: per-row log-sum-exp and the log-probability of one target token (temperature 1).

Operation, with logits float32 ``[batch, vocab]``, target_ids int32 ``[batch]``, and logprob, logsumexp float32
``[batch]`` (written)::

    for r in range(batch):
        m = max(logits[r])
        if m == -inf:                                   # every token masked
            logsumexp[r] = logprob[r] = -inf
        else:
            log_sum = log(sum(exp(logits[r] - m)))
            logsumexp[r] = m + log_sum
            t = target_ids[r]
            logprob[r] = (logits[r, t] - m) - log_sum if 0 <= t < vocab else -inf   # = logits[r, t] - logsumexp[r]

A masked target (logit -inf) gets logprob -inf; a target id outside the vocabulary is treated as a token of probability
0 (logprob -inf) rather than read out of bounds. This is the basis of the log-probabilities reported for raw logits.

CPU: rows in parallel; a max pass and a sum-of-exps pass (fast_exp, two-level float32 sum) over each row, the second
one from L2. GPU: one block per row, threads striding over the vocabulary, block allreduces for the max and the sum;
thread 0 writes the results. The reductions are shared with softmax_with_temperature (``_reductions``).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from ._common import CALLER_ARRAY_ALIGN, is_cpu, max_threads, neg_inf
from ._reductions import CPU_WORD, cpu_row_max, cpu_row_sum_exp, gpu_row_max, gpu_row_sum_exp, safe_shift

NAME = kernel_abi.LOG_SOFTMAX


def _logsumexp(row_max: tirx.PrimExpr, log_sum: tirx.PrimExpr) -> tirx.PrimExpr:
    """log(sum(exp(x))) from the row max and log(sum(exp(x - max))); -inf for a row of only -inf."""
    return T.Select(row_max == neg_inf(), neg_inf(), row_max + log_sum)


def _logprob(logits: tirx.Buffer, r: tirx.PrimExpr, target: tirx.PrimExpr, vocab: tirx.PrimExpr,
             row_max: tirx.PrimExpr, log_sum: tirx.PrimExpr) -> tirx.PrimExpr:
    """(logits[r, target] - max) - log_sum: the same value as logits[r, target] - logsumexp, without the cancellation
    of two large numbers (logits offset by 1e4 keep full precision). -inf for a row of only -inf or a target outside
    [0, vocab)."""
    inside = T.And(target >= 0, target < vocab)
    picked = T.if_then_else(inside, logits[r, T.Select(inside, target, 0)], neg_inf())
    return T.Select(row_max == neg_inf(), neg_inf(), (picked - row_max) - log_sum)


def _cpu() -> tirx.PrimFunc:
    @T.prim_func
    def log_softmax_gather(var_logits: T.handle, var_target_ids: T.handle, var_logprob: T.handle,
                           var_logsumexp: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        target_ids = T.match_buffer(var_target_ids, (batch,), "int32")
        logprob = T.match_buffer(var_logprob, (batch,), "float32")
        logsumexp = T.match_buffer(var_logsumexp, (batch,), "float32")
        for r in T.parallel(batch):
            lanes = T.alloc_buffer((CPU_WORD,), "float32", scope="global")
            block = T.alloc_buffer((CPU_WORD,), "float32", scope="global")
            row_max = T.alloc_buffer((1,), "float32", scope="global")
            row_sum = T.alloc_buffer((1,), "float32", scope="global")
            cpu_row_max(logits, r, vocab, lanes, block, row_max)
            shift: T.let = safe_shift(row_max[0])
            cpu_row_sum_exp(logits, r, vocab, shift, T.float32(1), None, lanes, block, row_sum)
            log_sum: T.let = T.log(row_sum[0])
            logsumexp[r] = _logsumexp(row_max[0], log_sum)
            logprob[r] = _logprob(logits, r, target_ids[r], vocab, row_max[0], log_sum)
    return log_softmax_gather


def _gpu(threads: int) -> tirx.PrimFunc:
    @T.prim_func
    def log_softmax_gather(var_logits: T.handle, var_target_ids: T.handle, var_logprob: T.handle,
                           var_logsumexp: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        target_ids = T.match_buffer(var_target_ids, (batch,), "int32")
        logprob = T.match_buffer(var_logprob, (batch,), "float32")
        logsumexp = T.match_buffer(var_logsumexp, (batch,), "float32")
        for bx in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                part = T.alloc_buffer((1,), "float32", scope="local")
                row_max = T.alloc_buffer((1,), "float32", scope="local")
                row_sum = T.alloc_buffer((1,), "float32", scope="local")
                gpu_row_max(logits, bx, vocab, tx, threads, part, row_max)
                shift: T.let = safe_shift(row_max[0])
                gpu_row_sum_exp(logits, bx, vocab, shift, T.float32(1), tx, threads, part, row_sum)
                if tx == 0:
                    log_sum: T.let = T.log(row_sum[0])
                    logsumexp[bx] = _logsumexp(row_max[0], log_sum)
                    logprob[bx] = _logprob(logits, bx, target_ids[bx], vocab, row_max[0], log_sum)
    return log_softmax_gather


def get_log_softmax_gather(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    return _cpu() if is_cpu(target) else _gpu(max_threads(target))
