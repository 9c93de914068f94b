# fmt: off
"""apply_logit_bias_inplace: add a sparse, per-request bias to logits.

Operation, with logits float32 ``[batch, vocab]`` and ``num_entries`` duplicate-free sparse entries (pos2seq int32,
token_ids int32, bias float32, each ``[num_entries]``); an entry naming a row or token outside ``logits`` is
skipped (a guard: the runtime never sends one)::

    for i in range(num_entries):
        r, t = pos2seq[i], token_ids[i]
        if 0 <= r < batch and 0 <= t < vocab:
            logits[r, t] += bias[i]
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from ._common import CALLER_ARRAY_ALIGN, is_cpu, max_threads

NAME = kernel_abi.LOGIT_BIAS


def _cpu() -> tirx.PrimFunc:
    # Entries are few (a request's logit_bias map); one serial loop beats threading them.
    @T.prim_func
    def apply_logit_bias_inplace(var_logits: T.handle, var_pos2seq: T.handle, var_token_ids: T.handle,
                                 var_bias: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab, num_entries = T.int32(), T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        pos2seq = T.match_buffer(var_pos2seq, (num_entries,), "int32")
        token_ids = T.match_buffer(var_token_ids, (num_entries,), "int32")
        bias = T.match_buffer(var_bias, (num_entries,), "float32")
        for i in range(num_entries):
            if pos2seq[i] >= 0 and pos2seq[i] < batch and token_ids[i] >= 0 and token_ids[i] < vocab:
                logits[pos2seq[i], token_ids[i]] = logits[pos2seq[i], token_ids[i]] + bias[i]
    return apply_logit_bias_inplace


def _gpu(threads: int) -> tirx.PrimFunc:
    # One thread per entry; entries are duplicate-free, so no two threads write the same logit.
    @T.prim_func
    def apply_logit_bias_inplace(var_logits: T.handle, var_pos2seq: T.handle, var_token_ids: T.handle,
                                 var_bias: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab, num_entries = T.int32(), T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        pos2seq = T.match_buffer(var_pos2seq, (num_entries,), "int32")
        token_ids = T.match_buffer(var_token_ids, (num_entries,), "int32")
        bias = T.match_buffer(var_bias, (num_entries,), "float32")
        for bx in T.thread_binding((num_entries + threads - 1) // threads, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                if bx * threads + tx < num_entries:
                    i: T.let = bx * threads + tx
                    if pos2seq[i] >= 0 and pos2seq[i] < batch and token_ids[i] >= 0 and token_ids[i] < vocab:
                        logits[pos2seq[i], token_ids[i]] = logits[pos2seq[i], token_ids[i]] + bias[i]
    return apply_logit_bias_inplace


def get_apply_logit_bias_inplace(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    return _cpu() if is_cpu(target) else _gpu(max_threads(target))
