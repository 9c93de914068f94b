# fmt: off
"""apply_penalty_inplace: repetition, frequency and presence penalties over sparse (row, token, count) entries.

Operation, with logits float32 ``[batch, vocab]``, ``num_entries`` duplicate-free entries (pos2seq, token_ids,
token_cnt: int32 ``[num_entries]``) naming every token that occurs in the prompt or the output of the row's sequence,
``token_cnt`` = its count in the output only, and penalties float32 ``[batch, 3]`` = (presence, frequency,
repetition) per row (the vLLM / OpenAI semantics). An entry whose row is negative is padding and is skipped (the
runtime keeps each sequence's entries in place between steps, with slack); so is, as a guard that the runtime's own
checks never need, any entry naming a row or token outside ``logits``. On the CPU entries are split across threads
and each update's logit is prefetched PREFETCH_AHEAD entries earlier (a hint: never a fault, never a write)::

    for i in range(num_entries):
        r, t, c = pos2seq[i], token_ids[i], token_cnt[i]
        if not (0 <= r < batch and 0 <= t < vocab):
            continue
        presence, frequency, repetition = penalties[r]
        x = logits[r, t]
        x = x / repetition if x > 0 else x * repetition
        logits[r, t] = x - (frequency * c + presence * (c > 0))
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from ._common import CALLER_ARRAY_ALIGN, is_cpu, max_threads
from ._reductions import prefetch

NAME = kernel_abi.PENALTY

#: How many entries ahead the CPU kernel prefetches the logit it will update (at 1.8M entries over 64 x 128256
#: logits: 16 -> 0.75x the time without, 64 -> 0.5x, on the 2-core EPYC VM).
PREFETCH_AHEAD = 64


def _penalised(x: tirx.PrimExpr, cnt: tirx.PrimExpr, presence: tirx.PrimExpr, frequency: tirx.PrimExpr,
               repetition: tirx.PrimExpr) -> tirx.PrimExpr:
    """The element formula (repetition first, then frequency and presence)."""
    repeated = T.Select(x > T.float32(0), x / repetition, x * repetition)
    return repeated - (frequency * T.Cast("float32", cnt) + T.Select(cnt > 0, presence, T.float32(0)))


def _cpu() -> tirx.PrimFunc:
    @T.prim_func
    def apply_penalty_inplace(var_logits: T.handle, var_pos2seq: T.handle, var_token_ids: T.handle,
                              var_token_cnt: T.handle, var_penalties: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab, num_entries = T.int32(), T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        pos2seq = T.match_buffer(var_pos2seq, (num_entries,), "int32")
        token_ids = T.match_buffer(var_token_ids, (num_entries,), "int32")
        token_cnt = T.match_buffer(var_token_cnt, (num_entries,), "int32")
        penalties = T.match_buffer(var_penalties, (batch, 3), "float32")
        for i in T.parallel(num_entries):  # entries are duplicate-free: no two write the same logit
            # the logit PREFETCH_AHEAD entries on (clamped into the buffer): the scattered read-modify-writes miss
            # the caches, and the hint keeps many misses in flight
            ahead: T.let = T.min(i + PREFETCH_AHEAD, num_entries - 1)
            prefetch(logits, T.min(T.max(pos2seq[ahead], 0), batch - 1), T.min(T.max(token_ids[ahead], 0), vocab - 1))
            r: T.let = pos2seq[i]
            if r >= 0 and r < batch and token_ids[i] >= 0 and token_ids[i] < vocab:
                logits[r, token_ids[i]] = _penalised(logits[r, token_ids[i]], token_cnt[i], penalties[r, 0],
                                                     penalties[r, 1], penalties[r, 2])
    return apply_penalty_inplace


def _gpu(threads: int) -> tirx.PrimFunc:
    @T.prim_func
    def apply_penalty_inplace(var_logits: T.handle, var_pos2seq: T.handle, var_token_ids: T.handle,
                              var_token_cnt: T.handle, var_penalties: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab, num_entries = T.int32(), T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        pos2seq = T.match_buffer(var_pos2seq, (num_entries,), "int32")
        token_ids = T.match_buffer(var_token_ids, (num_entries,), "int32")
        token_cnt = T.match_buffer(var_token_cnt, (num_entries,), "int32")
        penalties = T.match_buffer(var_penalties, (batch, 3), "float32")
        for bx in T.thread_binding((num_entries + threads - 1) // threads, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                if bx * threads + tx < num_entries:
                    i: T.let = bx * threads + tx
                    r: T.let = pos2seq[i]
                    if r >= 0 and r < batch and token_ids[i] >= 0 and token_ids[i] < vocab:
                        logits[r, token_ids[i]] = _penalised(logits[r, token_ids[i]], token_cnt[i], penalties[r, 0],
                                                             penalties[r, 1], penalties[r, 2])
    return apply_penalty_inplace


def get_apply_penalty_inplace(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    return _cpu() if is_cpu(target) else _gpu(max_threads(target))
