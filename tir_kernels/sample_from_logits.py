# fmt: off
"""sample_from_logits: the bitmask, temperature softmax, min-p / top-k / top-p and sampling of each row in one kernel.

Operation, with logits float32 ``[batch, vocab]``, temperature, top_p, min_p, uniform float32 ``[batch]``, top_k,
renorm and mask_index int32 ``[batch]``, bitmask int32 ``[num_masks, num_words]`` (``num_masks >= 1``), token int32
``[batch]`` and chosen_prob float32 ``[batch]`` (written); the numpy definition is ``reference.sample_from_logits``
applied to the masked logits::

    for r in range(batch):
        x = logits[r]
        if any(isnan(x) | (x == +inf)):                                 # no distribution: flagged
            token[r], chosen_prob[r] = NON_FINITE, 0                    # (top_values / top_ids not written)
            continue
        m = mask_index[r]
        if 0 <= m < num_masks and num_words * 32 >= vocab:             # else: no mask (-1, or a guard)
            x = where(bit v % 32 of bitmask[m, v // 32] is set, x, -inf)  # apply_bitmask_inplace's rule
        p = softmax_with_temperature(x, temperature[r])                # one-hot at temperature 0, zeros if masked
        if renorm[r]:
            p = renormalize_probs(p, top_k[r], top_p[r], min_p[r])
        token[r], chosen_prob[r] = multinomial_from_uniform(p, uniform[r])  # -1, 0 for a row of zeros
        for j in range(min(top_count[r], n)):                          # processed top-n logprobs, where asked
            top_values[r, j], top_ids[r, j] = top_n(p, n)[j]           # (top_values, top_ids: [batch, n])

The logits are not written. Every step is the staged kernel's own formula on the same float32 values in the same
order (the shared macros of ``_reductions``, ``renormalize`` and ``multinomial``), so that with the same uniforms it
picks the same tokens as ``apply_bitmask_inplace`` -> ``softmax_with_temperature`` -> ``renormalize_probs`` (where
``renorm``) -> ``multinomial_from_uniform``, on the same device; ``renorm`` says where the staged path would
renormalize (the sampler does for every row of a batch in which any row filters). Greedy rows (temperature 0) are
the first index of the row maximum; no probability array is written anywhere.

CPU: rows in parallel. Per row, one pass reads the logits from memory (``cpu_row_softmax_pass``: an online maximum
per chunk of 1024 values, the exps against it, the next chunk prefetched) and stores the row's exps in a per-thread
scratch row (a workspace of ``vocab`` floats, reused row after row, so it stays in cache); the chunks whose maximum
was below the row's are then rescaled (``cpu_rescale_chunks``), and every later pass reads that scratch: the
probabilities are ``exp * (1 / sum)``, recomputed where read rather than stored. renormalize's threshold search runs
on them as is: its first pass, then (usually) its candidate list, on which the searches run; when the list holds
every kept value the draw runs on it too (``multinomial.sample_list``: the staged draw's additions, in its order, of
the values it would find nonzero), so the row is not read again. Otherwise the sampling pass reads only the steps of
blocks whose maximum is kept (the others add exact zeros to the staged kernel's sums). A row with a valid mask runs
the same macros reading ``where(allowed, x, -inf)``. The maximum loop also keeps the largest of an integer key of
each logit's bits (|bits|, less 1 if negative: at least +inf's bits exactly for a NaN or +inf, masked or not), so such
a row is flagged (NON_FINITE) at no extra pass (greedy rows take the maximum of ``flagging(value)`` instead).
Processed top-n: the row the draw read (one-hot, zeros, or ``exp * (1 / sum)`` renormalized) is written into the
scratch row, and ``_select.row_top_cpu`` selects from it (block maxima, then a short list).
GPU: ten kernels, most with each row split over blocks (docs/kernels.md). The staged softmax's statistics
(``softmax.split_chunk_stats``, then ``row_stats_of_parts``: the same numbers as its kernels) on the masked logit
(``if_then_else``, so an unmasked row never reads the bitmask), with NaN and +inf flagged; the threshold search's
passes over the row split over blocks (``_threshold_split``: first pass, bound pass, candidate list), each reading
``exp((x - max) * scale) * (1 / sum)`` recomputed from the logits (as the staged softmax's write does; nothing is
stored); one block per row for the search's steps (``renormalize.gpu_row_threshold``, on the list where it fits);
the draw's segment sums split over blocks (from the list, where the row used it: it holds every kept value); one
block per row for the rest of the draw (``multinomial.gpu_segments_macro``) and the processed top-n
(``_top_split.block_top_macro``: a bound and a list for rows asking for 9 to 32 entries, else top_n's rounds).
A flagged row is read as zeros by those passes, then marked NON_FINITE.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from . import multinomial, renormalize
from ._common import CALLER_ARRAY_ALIGN, is_cpu, max_threads, neg_inf, pos_inf
from ._reductions import (
    CPU_CHUNK,
    CPU_WORD,
    SPLIT_THREADS,
    cpu_rescale_chunks,
    cpu_row_fold,
    cpu_row_peak,
    cpu_row_softmax_pass,
    exp2_scale,
    flagging,
    index_where,
    inverse_temperature,
    minimum,
    row_of,
    safe_shift,
    split_parts,
)
from ._select import row_top_cpu
from ._threshold_split import I_COUNT, I_LIST, ROW_FLOATS, ROW_INTS, split_threshold_passes
from ._top_split import block_top_macro
from .softmax import inverse_sum, probability, row_stats_of_parts, split_chunk_stats

NAME = kernel_abi.SAMPLE_FROM_LOGITS

#: The token of a row whose logits hold a NaN or a +inf (no distribution to sample from; -1 is "every token masked").
NON_FINITE = kernel_abi.NON_FINITE


def _bits(x: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.reinterpret("int32", x)


def _kept(x: tirx.PrimExpr, lo: tirx.PrimExpr, mass: tirx.PrimExpr) -> tirx.PrimExpr:
    """The renormalized probability: renormalize's last pass (``renormalize.rescaled``)."""
    return renormalize.rescaled(x, lo, mass)


Value = Callable[["tirx.PrimExpr"], "tirx.PrimExpr"]


def _allowed(bitmask: tirx.Buffer, m: tirx.PrimExpr, i: tirx.PrimExpr) -> tirx.PrimExpr:
    """Bit i of mask row m: token i allowed (floordiv/floormod, so that a 32-lane step reads one word)."""
    return T.bitwise_and(T.shift_right(bitmask[m, i // 32], i % 32), 1) == 1


def _masked_logit(logits: tirx.Buffer, r: tirx.PrimExpr, bitmask: tirx.Buffer, m: tirx.PrimExpr) -> Value:
    """Row r's logit, -inf where mask row m disallows the token (``apply_bitmask_inplace``'s formula)."""
    return lambda i: T.Select(_allowed(bitmask, m, i), logits[r, i], neg_inf())


def _gpu_logit(logits: tirx.Buffer, r: tirx.PrimExpr, bitmask: tirx.Buffer, m: tirx.PrimExpr,
               on: tirx.PrimExpr) -> Value:
    """The GPU's reading of row r: masked by row m where ``on`` (``if_then_else``: the mask is not read otherwise);
    the logit is read once (a ``Let``)."""

    def value(i: tirx.PrimExpr) -> tirx.PrimExpr:
        x = tirx.Var("logit", "float32")
        return tirx.Let(x, logits[r, i], T.Select(T.if_then_else(on, _allowed(bitmask, m, i), T.bool(True)), x,
                                                  neg_inf()))

    return value


# Per-token values for the row macros (callables i -> PrimExpr, built at parse time from the row's scalars).


def _scaled(exps: tirx.Buffer, inv: tirx.PrimExpr) -> Value:
    """The probability from the stored exps: exp * (1 / sum), the staged softmax's last pass."""
    return lambda i: exps[0, i] * inv


def _rescale(lo: tirx.PrimExpr, mass: tirx.PrimExpr) -> Value:
    """x -> its renormalized value (for the values of the candidate list)."""
    return lambda x: _kept(x, lo, mass)


def _kept_of(prob: Value, lo: tirx.PrimExpr, mass: tirx.PrimExpr) -> Value:
    return lambda i: _kept(prob(i), lo, mass)


def _live(bmax: tirx.Buffer, steps_per_block: tirx.PrimExpr, lo: tirx.PrimExpr) -> Value:
    """Whether step j (CPU_WORD values) can hold a kept value: its renormalize block's maximum is kept."""
    return lambda j: bmax[j // steps_per_block] >= lo


def _unless(bad: tirx.PrimExpr, value: Value) -> Value:
    """value(i), or 0 in a flagged row (a row of zeros: the searches and the draw handle it as every token masked)."""
    return lambda i: T.Select(bad, T.float32(0), value(i))


def _sampled(prob: Value, on: tirx.PrimExpr, lo: tirx.PrimExpr, mass: tirx.PrimExpr) -> Value:
    """The values the GPU draw reads: renormalized where ``on``, else the softmax itself (prob(i) bound once)."""

    def value(i: tirx.PrimExpr) -> tirx.PrimExpr:
        p = tirx.Var("prob", "float32")
        return tirx.Let(p, prob(i), T.Select(on, _kept(p, lo, mass), p))

    return value


def _cpu_rows() -> Callable[..., None]:
    """The CPU loop nest: rows in parallel (see the module docstring)."""
    threshold, _ = renormalize.cpu_row_macros()
    sample_row, sample_list = multinomial.cpu_row_macros()
    w = CPU_WORD

    @T.macro
    def greedy(value, raw, vocab, r, lanes, block, index_lanes, index_block, row_max, hot, token, chosen):
        # temperature 0: the first index of the maximum (-1 for a row of only -inf, NON_FINITE for a NaN or +inf)
        cpu_row_peak(flagging(value, raw), vocab, lanes, row_max)
        if row_max[0] == pos_inf():
            token[r] = NON_FINITE
            chosen[r] = T.float32(0)
        elif row_max[0] == neg_inf():
            token[r] = -1
            chosen[r] = T.float32(0)
        else:
            cpu_row_fold(vocab, vocab, minimum, index_where(value, row_max[0], vocab), None, r, index_lanes,
                         index_block, hot)
            token[r] = hot[0]
            chosen[r] = T.float32(1)

    @T.macro
    def row(r, vocab, masked, plain, on, logits, temperature, top_k, top_p, min_p, renorm, uniform, token, chosen,
            top_count, top_values, top_ids):
        # row r, reading its logits through masked(i) where ``on`` (a valid mask row), else plain(i): only the
        # passes that read the logits are written twice (the rest reads the exps row: one copy, for compile time)
        lanes = T.alloc_buffer((w,), "float32", scope="global")
        block = T.alloc_buffer((w,), "float32", scope="global")
        index_lanes = T.alloc_buffer((w,), "int32", scope="global")
        index_block = T.alloc_buffer((w,), "int32", scope="global")
        row_max = T.alloc_buffer((1,), "float32", scope="global")
        row_sum = T.alloc_buffer((1,), "float32", scope="global")
        hot = T.alloc_buffer((1,), "int32", scope="global")
        exps = T.alloc_buffer((1, vocab), "float32", scope="global")  # the row's exps (a workspace, in cache)
        part = T.alloc_buffer((w,), "float32", scope="global")
        mx = T.alloc_buffer((w,), "float32", scope="global")
        run = T.alloc_buffer((2,), "float32", scope="global")
        shifts = T.alloc_buffer((vocab // CPU_CHUNK + 1,), "float32", scope="global")
        bmax = T.alloc_buffer((renormalize.CPU_MAX_BLOCKS,), "int32", scope="local")
        gmax = T.alloc_buffer((renormalize.CPU_GROUPS,), "int32", scope="local")
        cand = T.alloc_buffer((renormalize.CPU_LIST_SIZE,), "float32", scope="local")
        cidx = T.alloc_buffer((renormalize.CPU_LIST_SIZE,), "int32", scope="local")
        picked = T.alloc_buffer((1,), "float32", scope="global")
        st = T.alloc_buffer((9,), "int32", scope="global")
        ms = T.alloc_buffer((2,), "float32", scope="global")
        pos = T.alloc_buffer((3,), "int32", scope="local")
        if temperature[r] == T.float32(0):
            if on:
                greedy(masked, plain, vocab, r, lanes, block, index_lanes, index_block, row_max, hot, token, chosen)
            else:
                greedy(plain, plain, vocab, r, lanes, block, index_lanes, index_block, row_max, hot, token, chosen)
            if top_count[r] > 0:  # the staged softmax's one-hot row (zeros for a row of only -inf)
                for i in range(vocab):
                    exps[0, i] = T.Select(i == token[r], T.float32(1), T.float32(0))
        else:
            # the staged softmax's exps, in one pass that reads the logits from memory, into the scratch row
            scale2: T.let = exp2_scale(temperature[r])
            if on:
                cpu_row_softmax_pass(logits, r, masked, plain, vocab, scale2, exps, 0, shifts, lanes,
                                     part, mx, run, row_sum)
            else:
                cpu_row_softmax_pass(logits, r, plain, plain, vocab, scale2, exps, 0, shifts, lanes,
                                     part, mx, run, row_sum)
            if run[0] == pos_inf():  # a NaN or +inf logit
                token[r] = NON_FINITE
                chosen[r] = T.float32(0)
            elif run[0] == neg_inf():  # every token masked
                token[r] = -1
                chosen[r] = T.float32(0)
                if top_count[r] > 0:
                    for i in range(vocab):
                        exps[0, i] = T.float32(0)
            else:
                cpu_rescale_chunks(exps, 0, vocab, scale2, shifts, run[0])
                inv: T.let = inverse_sum(row_sum[0])
                if renorm[r] != 0:
                    threshold(_scaled(exps, inv), vocab, top_k[r], top_p[r], min_p[r], bmax, gmax, cand, cidx, st,
                              ms)
                    lo: T.let = st[0]
                    mass: T.let = ms[0]
                    if st[7] == 1:
                        # every kept value is on the candidate list: draw from it, not from the row
                        sample_list(cand, cidx, st[8], _rescale(lo, mass), vocab,
                                    uniform[r], pos, picked)
                        token[r] = pos[1]
                        chosen[r] = picked[0]
                    else:
                        bv: T.let = renormalize.cpu_block_steps(vocab // w)
                        sample_row(_kept_of(_scaled(exps, inv), lo, mass), vocab, uniform[r], _live(bmax, bv, lo),
                                   pos)
                        token[r] = pos[1]
                        chosen[r] = T.Select(pos[1] >= 0, _kept_of(_scaled(exps, inv), lo, mass)(T.max(pos[1], 0)),
                                             T.float32(0))
                    if top_count[r] > 0:  # the renormalized row, in place
                        for i in range(vocab):
                            exps[0, i] = _kept(exps[0, i] * inv, lo, mass)
                else:
                    sample_row(_scaled(exps, inv), vocab, uniform[r], None, pos)
                    token[r] = pos[1]
                    chosen[r] = T.Select(pos[1] >= 0, _scaled(exps, inv)(T.max(pos[1], 0)), T.float32(0))
                    if top_count[r] > 0:  # the probabilities, in place
                        for i in range(vocab):
                            exps[0, i] = exps[0, i] * inv
        if top_count[r] > 0 and token[r] != NON_FINITE:
            # top_n of the processed row left in the scratch row (in cache)
            row_top_cpu(exps, 0, vocab, T.min(top_count[r], top_values.shape[1]), top_values, top_ids, r)

    @T.macro
    def rows(batch, vocab, logits, temperature, top_k, top_p, min_p, renorm, uniform, mask_index, bitmask, token,
             chosen, top_count, top_values, top_ids):
        num_masks: T.let = bitmask.shape[0]
        for r in T.parallel(batch):
            m: T.let = mask_index[r]
            on: T.let = m >= 0 and m < num_masks and bitmask.shape[1] * 32 >= vocab
            row(r, vocab, _masked_logit(logits, r, bitmask, T.Select(on, m, 0)), row_of(logits, r), on, logits,
                temperature, top_k, top_p, min_p, renorm, uniform, token, chosen, top_count, top_values, top_ids)

    return rows


def _mask_on(mask_index: tirx.Buffer, bitmask: tirx.Buffer, r: tirx.PrimExpr, vocab: tirx.PrimExpr) -> tirx.PrimExpr:
    """Whether row r reads its logits through a mask row (a valid index, and a bitmask wide enough)."""
    return tirx.all(mask_index[r] >= 0, mask_index[r] < bitmask.shape[0], bitmask.shape[1] * 32 >= vocab)


# The row scalars the fused GPU kernel's second kernel writes for the later ones: float32 ``row_fs`` [batch * 3]
# (the softmax's shift, inverse temperature, 1 / sum) and int32 ``row_is`` [batch * 4] (the first index of the
# maximum, the mask row or -1, greedy, flagged). Stored floats read back are the same floats; one load each keeps the
# per-token expressions small (the lowering's time grows with their size).
_F_SHIFT, _F_SCALE, _F_INV = 0, 1, 2
_I_HOT, _I_MASK, _I_GREEDY, _I_BAD = 0, 1, 2, 3


def _row_scalar(row_fs: tirx.Buffer, row_is: tirx.Buffer) -> Callable[[tirx.PrimExpr, int], tirx.PrimExpr]:
    """(r, k) -> row r's scalar k: shift, scale, 1 / sum, then the first index of the maximum, the mask row,
    greedy, flagged (the order ``_row_probability`` reads them in)."""
    slots = [(row_fs, 3, _F_SHIFT), (row_fs, 3, _F_SCALE), (row_fs, 3, _F_INV), (row_is, 4, _I_HOT),
             (row_is, 4, _I_MASK), (row_is, 4, _I_GREEDY), (row_is, 4, _I_BAD)]
    return lambda r, k: slots[k][0][r * slots[k][1] + slots[k][2]]


def _row_probability(logits: tirx.Buffer, bitmask: tirx.Buffer) -> Callable[..., Value]:
    """(r, scalars) -> row r's probability as the staged softmax writes it, from the row's scalars (``_row_scalar``,
    bound once by the caller): 0 throughout a flagged row."""

    def value(r: tirx.PrimExpr, s: tuple) -> Value:
        shift, scale, inv, hot, m, greedy, bad = s
        return _unless(bad != 0, probability(_gpu_logit(logits, r, bitmask, T.max(m, 0), m >= 0), greedy != 0, hot,
                                             shift, scale, inv))

    return value


#: Threads per block of the fused kernel's split segment sums (each thread one of the draw's segments).
_SEGMENT_THREADS = 64


#: Entries per thread of the processed top-n's list in shared memory (the draw's scans hold 12 KB of it too).
_TOP_LIST_PER_THREAD = 0.5


def _gpu_rows(threads: int, uniform_loops: bool, shuffle_reduce: bool, list_cap: int) -> Callable[..., None]:
    """The GPU loop nest: rows split over blocks, then one block per row (see the module docstring)."""
    threshold = renormalize.gpu_row_threshold(threads, uniform_loops, shuffle_reduce, list_cap)
    passes = split_threshold_passes(list_cap)
    sample_segments = multinomial.gpu_segments_macro(threads)
    row_top = block_top_macro(threads, uniform_loops, int(_TOP_LIST_PER_THREAD * threads))

    @T.macro
    def rows(batch, vocab, logits, temperature, top_k, top_p, min_p, renorm, uniform, mask_index, bitmask, token,
             chosen, top_count, top_values, top_ids):
        # workspaces: the staged softmax's per-block partials (``softmax.split_chunk_stats``) and row statistics,
        # the threshold search's row records and candidate lists (``_threshold_split``)
        part_max = T.alloc_buffer((batch * split_parts(vocab),), "float32", scope="global")
        part_sum = T.alloc_buffer((batch * split_parts(vocab),), "float32", scope="global")
        part_first = T.alloc_buffer((batch * split_parts(vocab),), "int32", scope="global")
        row_fs = T.alloc_buffer((batch * 3,), "float32", scope="global")
        row_is = T.alloc_buffer((batch * 4,), "int32", scope="global")
        row_i = T.alloc_buffer((batch * ROW_INTS,), "int32", scope="global")
        row_f = T.alloc_buffer((batch * ROW_FLOATS,), "float32", scope="global")
        cand = T.alloc_buffer((batch * list_cap,), "float32", scope="global")
        cand_id = T.alloc_buffer((batch * list_cap,), "int32", scope="global")
        row_lo = T.alloc_buffer((batch,), "int32", scope="global")
        row_mass = T.alloc_buffer((batch,), "float32", scope="global")
        seg_sums = T.alloc_buffer((batch * threads,), "float32", scope="global")
        seg_last = T.alloc_buffer((batch * threads,), "int32", scope="global")
        # kernel 1: the staged softmax's first kernel on the masked row (the maximum +inf for a row with a NaN or
        # +inf logit: it is then read as zeros, and flagged); each row split over blocks of SPLIT_THREADS
        for b in T.thread_binding(batch * split_parts(vocab), thread="blockIdx.x"):
            for tx in T.thread_binding(SPLIT_THREADS, thread="threadIdx.x"):
                r1: T.let = b // split_parts(vocab)
                m1: T.let = mask_index[r1]
                masked1: T.let = m1 >= 0 and m1 < bitmask.shape[0] and bitmask.shape[1] * 32 >= vocab
                split_chunk_stats(flagging(_gpu_logit(logits, r1, bitmask, T.Select(masked1, m1, 0), masked1),
                                           row_of(logits, r1)),
                                  vocab, temperature[r1], b, tx, part_max, part_sum, part_first)
        # kernel 2: each row's statistics from its blocks' partials (the staged softmax's second kernel), and the
        # scalars of its probability formula
        for r2 in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                stats2 = T.alloc_buffer((2,), "float32", scope="local")
                hot2 = T.alloc_buffer((1,), "int32", scope="local")
                row_stats_of_parts(part_max, part_sum, part_first, r2, vocab, temperature[r2], stats2, hot2)
                if tx == 0:
                    row_fs[r2 * 3 + _F_SHIFT] = safe_shift(stats2[0])
                    row_fs[r2 * 3 + _F_SCALE] = inverse_temperature(temperature[r2])
                    row_fs[r2 * 3 + _F_INV] = inverse_sum(stats2[1])
                    row_is[r2 * 4 + _I_HOT] = hot2[0]
                    row_is[r2 * 4 + _I_MASK] = T.Select(_mask_on(mask_index, bitmask, r2, vocab), mask_index[r2], -1)
                    row_is[r2 * 4 + _I_GREEDY] = T.Select(temperature[r2] == T.float32(0), 1, 0)
                    row_is[r2 * 4 + _I_BAD] = T.Select(stats2[0] == pos_inf(), 1, 0)
        # kernels 3-7: the threshold search's passes over the row, split over blocks; rows the staged path would
        # not renormalize run them with every filter off and without reading the row
        passes(batch, vocab, _row_scalar(row_fs, row_is), _row_probability(logits, bitmask),
               lambda r: T.Select(renorm[r] != 0, top_k[r], 0), lambda r: T.Select(renorm[r] != 0, top_p[r],
                                                                                   T.float32(1)),
               lambda r: T.Select(renorm[r] != 0, min_p[r], T.float32(0)), lambda r: renorm[r] != 0,
               row_i, row_f, cand, cand_id)
        # kernel 8: one block per row: the search's steps (on the list in shared memory where it is used)
        for r in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                st = T.alloc_buffer((renormalize.GPU_STATE,), "int32", scope="local")
                ms = T.alloc_buffer((2,), "float32", scope="local")
                on: T.let = renorm[r] != 0
                h0: T.let = row_fs[r * 3 + _F_SHIFT]
                h1: T.let = row_fs[r * 3 + _F_SCALE]
                h2: T.let = row_fs[r * 3 + _F_INV]
                h3: T.let = row_is[r * 4 + _I_HOT]
                h4: T.let = row_is[r * 4 + _I_MASK]
                h5: T.let = row_is[r * 4 + _I_GREEDY]
                h6: T.let = row_is[r * 4 + _I_BAD]
                threshold(_row_probability(logits, bitmask)(r, (h0, h1, h2, h3, h4, h5, h6)),
                          vocab, tx, T.Select(on, top_k[r], 0), T.Select(on, top_p[r], T.float32(1)),
                          T.Select(on, min_p[r], T.float32(0)), st, ms, r, row_i, row_f, cand)
                if tx == 0:
                    row_lo[r] = st[0]
                    row_mass[r] = ms[0]
        # kernel 9: the draw's segment sums (``threads`` segments a row, one thread each), split over blocks: from
        # the list where the row used it (it holds every kept value), else from the row
        for b in T.thread_binding(batch * (threads // _SEGMENT_THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(_SEGMENT_THREADS, thread="threadIdx.x"):
                rs: T.let = b // (threads // _SEGMENT_THREADS)
                g: T.let = b % (threads // _SEGMENT_THREADS) * _SEGMENT_THREADS + tx
                seg_sum = T.alloc_buffer((1,), "float32", scope="local")
                last = T.alloc_buffer((1,), "int32", scope="local")
                ons: T.let = renorm[rs] != 0
                los: T.let = row_lo[rs]
                mass_s: T.let = row_mass[rs]
                k0: T.let = row_fs[rs * 3 + _F_SHIFT]
                k1: T.let = row_fs[rs * 3 + _F_SCALE]
                k2: T.let = row_fs[rs * 3 + _F_INV]
                k3: T.let = row_is[rs * 4 + _I_HOT]
                k4: T.let = row_is[rs * 4 + _I_MASK]
                k5: T.let = row_is[rs * 4 + _I_GREEDY]
                k6: T.let = row_is[rs * 4 + _I_BAD]
                if row_i[rs * ROW_INTS + I_LIST] == 1:
                    multinomial.gpu_list_segment_sum(cand, cand_id, rs * list_cap, row_i[rs * ROW_INTS + I_COUNT],
                                                     list_cap, _rescale(los, mass_s), vocab, threads, g, seg_sum, last)
                else:
                    multinomial.gpu_segment_sum(
                        _sampled(_row_probability(logits, bitmask)(rs, (k0, k1, k2, k3, k4, k5, k6)), ons, los,
                                 mass_s), vocab, threads, g, seg_sum, last)
                seg_sums[rs * threads + g] = seg_sum[0]
                seg_last[rs * threads + g] = last[0]
        # kernel 10: one block per row: the draw from the segment sums, then top-n
        for r in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                seg_sum = T.alloc_buffer((1,), "float32", scope="local")
                last = T.alloc_buffer((1,), "int32", scope="local")
                seg_sum[0] = seg_sums[r * threads + tx]
                last[0] = seg_last[r * threads + tx]
                on: T.let = renorm[r] != 0
                lo: T.let = row_lo[r]
                mass: T.let = row_mass[r]
                q0: T.let = row_fs[r * 3 + _F_SHIFT]
                q1: T.let = row_fs[r * 3 + _F_SCALE]
                q2: T.let = row_fs[r * 3 + _F_INV]
                q3: T.let = row_is[r * 4 + _I_HOT]
                q4: T.let = row_is[r * 4 + _I_MASK]
                q5: T.let = row_is[r * 4 + _I_GREEDY]
                bad: T.let = row_is[r * 4 + _I_BAD]
                sample_segments(_sampled(_row_probability(logits, bitmask)(r, (q0, q1, q2, q3, q4, q5, bad)), on, lo,
                                         mass),
                                vocab, uniform[r], tx, token, chosen, r, seg_sum, last)
                if tx == 0 and bad != 0:  # the thread that wrote the -1 of a row of zeros
                    token[r] = NON_FINITE
                # processed top-n: WGSL runs the width's rounds in every row (its barriers need uniform control
                # flow); elsewhere a row runs the rounds it asks for (the bound is the same in every thread); rows
                # asking for more than 8 entries take a bound and a list instead where it fits
                count: T.let = T.Select(bad != 0, 0, T.min(top_count[r], top_values.shape[1]))
                row_top(_sampled(_row_probability(logits, bitmask)(r, (q0, q1, q2, q3, q4, q5, bad)), on, lo, mass),
                        vocab, top_values.shape[1] if uniform_loops else count, count, tx, top_values, top_ids, r)

    return rows


def _kernel(rows: Callable[..., None]) -> tirx.PrimFunc:
    @T.prim_func
    def sample_from_logits(var_logits: T.handle, var_temperature: T.handle, var_top_k: T.handle,
                           var_top_p: T.handle, var_min_p: T.handle, var_renorm: T.handle, var_uniform: T.handle,
                           var_mask_index: T.handle, var_bitmask: T.handle, var_token: T.handle, var_chosen: T.handle,
                           var_top_count: T.handle, var_top_values: T.handle, var_top_ids: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab, num_masks, num_words, n = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        temperature = T.match_buffer(var_temperature, (batch,), "float32")
        top_k = T.match_buffer(var_top_k, (batch,), "int32")
        top_p = T.match_buffer(var_top_p, (batch,), "float32")
        min_p = T.match_buffer(var_min_p, (batch,), "float32")
        renorm = T.match_buffer(var_renorm, (batch,), "int32")
        uniform = T.match_buffer(var_uniform, (batch,), "float32")
        mask_index = T.match_buffer(var_mask_index, (batch,), "int32")
        bitmask = T.match_buffer(var_bitmask, (num_masks, num_words), "int32")
        token = T.match_buffer(var_token, (batch,), "int32")
        chosen = T.match_buffer(var_chosen, (batch,), "float32")
        top_count = T.match_buffer(var_top_count, (batch,), "int32")
        top_values = T.match_buffer(var_top_values, (batch, n), "float32")
        top_ids = T.match_buffer(var_top_ids, (batch, n), "int32")
        rows(batch, vocab, logits, temperature, top_k, top_p, min_p, renorm, uniform, mask_index, bitmask, token,
             chosen, top_count, top_values, top_ids)
    return sample_from_logits


def get_sample_from_logits(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    if is_cpu(target):
        return _kernel(_cpu_rows())
    threads = max_threads(target)
    return _kernel(_gpu_rows(threads, uniform_loops=target.kind.name == "webgpu",
                             shuffle_reduce=target.kind.name == "cuda",
                             list_cap=renormalize.gpu_list_capacity(target, threads)))
