# fmt: off
"""multinomial_from_uniform: draw one token per row from (unnormalised) probabilities, given a uniform number.

Operation, with probs float32 ``[batch, vocab]`` (non-negative, not necessarily summing to 1), uniform float32
``[batch]`` in ``[0, 1)``, token int32 ``[batch]`` and chosen_prob float32 ``[batch]`` (the numpy definition is
``reference.multinomial_from_uniform``)::

    for r in range(batch):
        p = probs[r]
        if not any(p > 0):
            token[r], chosen_prob[r] = -1, 0.0                 # a row of zeros
            continue
        target = uniform[r] * sum(p)
        t = first v with p[v] > 0 and cumsum(p)[v] > target
        if there is none:                                      # rounding left the cumulative sum short
            t = last v with p[v] > 0
        token[r], chosen_prob[r] = t, p[t]

A token of probability 0 is never chosen. Sums are float32 (the reference sums in float64): where ``target`` lies
within rounding of a cumulative sum, the kernel may pick the neighbouring token of positive probability.

CPU: one pass sums the row in blocks (vectorised, each block reduced in a fixed order) and keeps the block sums;
the walk over the block sums repeats the exact additions that made the total, so it always stops in a block of
positive mass when ``uniform < 1``; a scalar scan inside that block finds the token. GPU: each thread sums a
contiguous segment of the row, an inclusive scan over the segment sums (shared memory) finds the segment holding
the target, and the thread owning it scans inside its segment. The per-row work is a TVMScript macro reading the row
through ``value(i)`` (``cpu_row_macros``, ``gpu_row_macro``), shared with ``sample_from_logits``.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from ._common import CALLER_ARRAY_ALIGN, CPU_LANES, is_cpu, max_threads
from ._reductions import GPU_UNROLL, gpu_inclusive_scan, row_of

NAME = kernel_abi.MULTINOMIAL

#: Values per vector step on CPUs (four AVX-512 registers, independent accumulations).
_CPU_WIDTH = 4 * CPU_LANES
#: The CPU kernel keeps the sums of at most this many blocks of whole steps (at least 16 steps, 1024 values, each):
#: few enough that the walk over them is short, small enough that the scalar scan inside one is short.
_MAX_BLOCKS = 256
_MIN_BLOCK_STEPS = 16


def _span_start(b: tirx.PrimExpr, nblk: tirx.PrimExpr, nvec: tirx.PrimExpr, bv: tirx.PrimExpr) -> tirx.PrimExpr:
    """First index of CPU block b (block nblk is the scalar tail)."""
    return T.Select(b == nblk, nvec * _CPU_WIDTH, b * bv * _CPU_WIDTH)


def _span_end(b: tirx.PrimExpr, nblk: tirx.PrimExpr, nvec: tirx.PrimExpr, bv: tirx.PrimExpr,
              vocab: tirx.PrimExpr) -> tirx.PrimExpr:
    """One past the last index of CPU block b."""
    return T.Select(b == nblk, vocab, T.min(b * bv + bv, nvec) * _CPU_WIDTH)


def cpu_row_macros() -> tuple[Callable[..., None], Callable[..., None]]:
    """The CPU row macros ``sample_row(value, vocab, u, live, pos)`` and ``sample_list(cand, cidx, n, kept, vocab, u,
    pos, chosen)``.

    sample_row: pos[1] = the token drawn from row values ``value(i)`` with uniform ``u`` (-1 for a row of zeros).
    ``live(j)`` (None: always) may be False only for steps j (values j * 64 .. j * 64 + 63) that are all exactly 0:
    they are then not read (adding zeros changes no sum).

    sample_list: the same draw from a row given as a list: ``kept(cand[e])`` at index ``cidx[e]`` for the n entries
    (indices increasing), 0 elsewhere; chosen[0] = the drawn value. Every sum adds the same nonzero values in the same
    order as sample_row (the zeros it adds change nothing), so both draw the same token."""
    w = _CPU_WIDTH
    assert w == 64, "the lane reduction below is written out for 64 lanes"

    @T.macro
    def fold(lanes, half):
        for l in T.vectorized(half):
            lanes[l] = lanes[l] + lanes[l + half]

    @T.macro
    def block_total(lanes, bsum, blk, acc):
        # the tree sum of the 64 lanes; its last three levels on a copy of the first 8, so that the lanes are only
        # ever accessed in whole 8-wide vectors (else LLVM splits their registers and shuffles them in every step)
        last = T.alloc_buffer((8,), "float32", scope="global")
        fold(lanes, 32)
        fold(lanes, 16)
        fold(lanes, 8)
        for l in T.vectorized(8):
            last[l] = lanes[l]
        fold(last, 4)
        fold(last, 2)
        fold(last, 1)
        bsum[blk] = last[0]
        acc[0] = acc[0] + last[0]

    @T.macro
    def add_step(value, lanes, j):
        for l in T.vectorized(w):
            lanes[l] = lanes[l] + value(j * w + l)

    @T.macro
    def walk(bsum, nblk, goal, acc, pos):
        # the first block whose running sum passes the target (the same additions as the total): pos[0], with the
        # running sum before it in acc[1]; -1 if none
        acc[1] = T.float32(0)
        pos[0] = -1
        pos[2] = 0
        while pos[0] < 0 and pos[2] <= nblk:
            if acc[1] + bsum[pos[2]] > goal and bsum[pos[2]] > T.float32(0):
                pos[0] = pos[2]
            else:
                acc[1] = acc[1] + bsum[pos[2]]
                pos[2] = pos[2] + 1

    @T.macro
    def last_positive_block(bsum, nblk, pos):
        # nothing passed the target: a row of zeros, or rounding (uniform >= 1): pos[2] = the last block of positive
        # sum (-1 if none), whose last positive value is drawn
        pos[2] = nblk
        while pos[2] >= 0 and bsum[T.max(pos[2], 0)] <= T.float32(0):
            pos[2] = pos[2] - 1

    @T.macro
    def sample_row(value, vocab, u, live, pos):
        lanes = T.alloc_buffer((w,), "float32", scope="local")
        # block sums; the last entry is the scalar tail (vocab % w values)
        bsum = T.alloc_buffer((_MAX_BLOCKS + 1,), "float32", scope="local")
        acc = T.alloc_buffer((2,), "float32", scope="local")  # 0: total, then running sum; 1: running sum
        # pos: int32 (3,). 0: block (or -1), 1: token (or -1), 2: index
        nvec: T.let = vocab // w
        bv: T.let = T.max(_MIN_BLOCK_STEPS, (nvec + _MAX_BLOCKS - 1) // _MAX_BLOCKS)
        nblk: T.let = (nvec + bv - 1) // bv
        # pass 1: the block sums and the total, added in block order
        acc[0] = T.float32(0)
        for blk in range(nblk):
            for l in T.vectorized(w):
                lanes[l] = T.float32(0)
            for j in range(T.min(bv, nvec - blk * bv)):
                if live is None:
                    add_step(value, lanes, blk * bv + j)
                elif live(blk * bv + j):
                    add_step(value, lanes, blk * bv + j)
            block_total(lanes, bsum, blk, acc)
        bsum[nblk] = T.float32(0)
        for t in range(vocab % w):
            bsum[nblk] = bsum[nblk] + value(nvec * w + t)
        acc[0] = acc[0] + bsum[nblk]
        goal: T.let = u * acc[0]
        walk(bsum, nblk, goal, acc, pos)
        pos[1] = -1
        if pos[0] >= 0:
            # scan inside the block: the first positive value passing the target, else its last positive one
            start: T.let = _span_start(pos[0], nblk, nvec, bv)
            end: T.let = _span_end(pos[0], nblk, nvec, bv, vocab)
            acc[0] = acc[1]
            pos[2] = -1
            for i in range(start, end):
                if value(i) > T.float32(0):
                    acc[0] = acc[0] + value(i)
                    if pos[1] < 0 and acc[0] > goal:
                        pos[1] = i
                    pos[2] = i
            if pos[1] < 0:
                pos[1] = pos[2]
        else:
            last_positive_block(bsum, nblk, pos)
            if pos[2] >= 0:
                start: T.let = _span_start(pos[2], nblk, nvec, bv)
                end: T.let = _span_end(pos[2], nblk, nvec, bv, vocab)
                for i in range(start, end):
                    if value(i) > T.float32(0):
                        pos[1] = i

    @T.macro
    def sample_list(cand, cidx, n, kept, vocab, u, pos, chosen):
        lanes = T.alloc_buffer((w,), "float32", scope="local")
        bsum = T.alloc_buffer((_MAX_BLOCKS + 1,), "float32", scope="local")
        acc = T.alloc_buffer((2,), "float32", scope="local")
        e = T.alloc_buffer((1,), "int32", scope="local")  # the next list entry
        nvec: T.let = vocab // w
        bv: T.let = T.max(_MIN_BLOCK_STEPS, (nvec + _MAX_BLOCKS - 1) // _MAX_BLOCKS)
        nblk: T.let = (nvec + bv - 1) // bv
        acc[0] = T.float32(0)
        e[0] = 0
        for blk in range(nblk):
            if e[0] < n and cidx[T.max(T.min(e[0], n - 1), 0)] < T.min(blk * bv + bv, nvec) * w:
                for l in T.vectorized(w):
                    lanes[l] = T.float32(0)
                while e[0] < n and cidx[T.max(T.min(e[0], n - 1), 0)] < T.min(blk * bv + bv, nvec) * w:
                    lanes[cidx[e[0]] % w] = lanes[cidx[e[0]] % w] + kept(cand[e[0]])
                    e[0] = e[0] + 1
                block_total(lanes, bsum, blk, acc)
            else:
                bsum[blk] = T.float32(0)  # what a block of zeros folds to; adding it changes no sum
        bsum[nblk] = T.float32(0)
        while e[0] < n:
            bsum[nblk] = bsum[nblk] + kept(cand[e[0]])
            e[0] = e[0] + 1
        acc[0] = acc[0] + bsum[nblk]
        goal: T.let = u * acc[0]
        walk(bsum, nblk, goal, acc, pos)
        pos[1] = -1
        chosen[0] = T.float32(0)
        if pos[0] >= 0:
            start: T.let = _span_start(pos[0], nblk, nvec, bv)
            end: T.let = _span_end(pos[0], nblk, nvec, bv, vocab)
            acc[0] = acc[1]
            pos[2] = -1
            for i in range(n):
                if cidx[i] >= start and cidx[i] < end and kept(cand[i]) > T.float32(0):
                    acc[0] = acc[0] + kept(cand[i])
                    if pos[1] < 0 and acc[0] > goal:
                        pos[1] = cidx[i]
                        chosen[0] = kept(cand[i])
                    pos[2] = i
            if pos[1] < 0 and pos[2] >= 0:
                pos[1] = cidx[pos[2]]
                chosen[0] = kept(cand[pos[2]])
        else:
            last_positive_block(bsum, nblk, pos)
            if pos[2] >= 0:
                start: T.let = _span_start(pos[2], nblk, nvec, bv)
                end: T.let = _span_end(pos[2], nblk, nvec, bv, vocab)
                for i in range(n):
                    if cidx[i] >= start and cidx[i] < end and kept(cand[i]) > T.float32(0):
                        pos[1] = cidx[i]
                        chosen[0] = kept(cand[i])

    return sample_row, sample_list


def _cpu() -> tirx.PrimFunc:
    sample_row, _ = cpu_row_macros()

    @T.prim_func
    def multinomial_from_uniform(var_probs: T.handle, var_uniform: T.handle, var_token: T.handle,
                                 var_chosen: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        probs = T.match_buffer(var_probs, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        uniform = T.match_buffer(var_uniform, (batch,), "float32")
        token = T.match_buffer(var_token, (batch,), "int32")
        chosen = T.match_buffer(var_chosen, (batch,), "float32")
        for r in T.parallel(batch):
            pos = T.alloc_buffer((3,), "int32", scope="local")
            sample_row(row_of(probs, r), vocab, uniform[r], None, pos)
            token[r] = pos[1]
            chosen[r] = T.Select(pos[1] >= 0, probs[r, T.max(pos[1], 0)], T.float32(0))
    return multinomial_from_uniform


@T.macro
def gpu_segment_sum(value, vocab, segments, g, seg_sum, last):
    """Segment g of ``segments`` (each ceil(vocab / segments) consecutive values, the GPU draw's per-thread share):
    seg_sum[0] = the sum of its positive values ``value(i)`` in index order, last[0] = the last index holding one
    (-1 where none). One thread; GPU_UNROLL values a step whose loads are issued together."""
    xs = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
    seg: T.let = (vocab + segments - 1) // segments
    begin: T.let = T.min(g * seg, vocab)
    end: T.let = T.min(begin + seg, vocab)
    seg_sum[0] = T.float32(0)
    last[0] = -1
    for s in range((end - begin) // GPU_UNROLL):
        for u in T.unroll(GPU_UNROLL):
            xs[u] = value(begin + s * GPU_UNROLL + u)
        for u in T.unroll(GPU_UNROLL):
            if xs[u] > T.float32(0):
                seg_sum[0] = seg_sum[0] + xs[u]
                last[0] = begin + s * GPU_UNROLL + u
    for t in range((end - begin) % GPU_UNROLL):
        if value(begin + (end - begin) // GPU_UNROLL * GPU_UNROLL + t) > T.float32(0):
            seg_sum[0] = seg_sum[0] + value(begin + (end - begin) // GPU_UNROLL * GPU_UNROLL + t)
            last[0] = begin + (end - begin) // GPU_UNROLL * GPU_UNROLL + t


def _entry_of(base: tirx.PrimExpr, e: tirx.PrimExpr, cap: int) -> tirx.PrimExpr:
    """base + e, e clamped to [0, cap) (an index computed from a local buffer: TVM's buffer-region analysis needs
    bounds that do not depend on it)."""
    return base + T.max(T.min(e, cap - 1), 0)


@T.macro
def _first_at_or_above(ids, base, n, cap, bound, steps, at):
    """at[0] = the first e < n with ids[base + e] >= bound (n where none), ids increasing, n <= cap (a Python int);
    ``steps`` bisection steps (a Python int, at least log2(n) + 1)."""
    at[0] = 0
    at[1] = n
    for it in range(steps):
        if at[0] < at[1]:
            if ids[_entry_of(base, (at[0] + at[1]) // 2, cap)] < bound:
                at[0] = (at[0] + at[1]) // 2 + 1
            else:
                at[1] = (at[0] + at[1]) // 2


@T.macro
def gpu_list_segment_sum(cand, cand_id, base, n, cap, kept, vocab, segments, g, seg_sum, last):
    """``gpu_segment_sum`` of segment g for a row given as a list: ``kept(cand[base + e])`` at index
    ``cand_id[base + e]`` for its n entries (indices increasing; n <= cap, a Python int), 0 elsewhere. The same
    additions in the same order (the row's other values are 0, which the row's pass skips). One thread; two
    bisections over the indices find the segment's entries."""
    first = T.alloc_buffer((2,), "int32", scope="local")
    stop = T.alloc_buffer((2,), "int32", scope="local")
    seg: T.let = (vocab + segments - 1) // segments
    begin: T.let = T.min(g * seg, vocab)
    _first_at_or_above(cand_id, base, n, cap, begin, cap.bit_length() + 1, first)
    _first_at_or_above(cand_id, base, n, cap, T.min(begin + seg, vocab), cap.bit_length() + 1, stop)
    seg_sum[0] = T.float32(0)
    last[0] = -1
    for e in range(stop[0] - first[0]):
        x: T.let = kept(cand[_entry_of(base, first[0] + e, cap)])
        if x > T.float32(0):
            seg_sum[0] = seg_sum[0] + x
            last[0] = cand_id[_entry_of(base, first[0] + e, cap)]


def gpu_row_macro(threads: int) -> Callable[..., None]:
    """The GPU row macro ``sample_row(value, vocab, u, tx, token, chosen, r)``, one block per row: token[r],
    chosen[r] = the token drawn from row values ``value(i)`` with uniform ``u`` (-1, 0 for a row of zeros)."""
    sample_segments = gpu_segments_macro(threads)

    @T.macro
    def sample_row(value, vocab, u, tx, token, chosen, r):
        seg_sum = T.alloc_buffer((1,), "float32", scope="local")
        last = T.alloc_buffer((1,), "int32", scope="local")  # last positive value of the segment
        gpu_segment_sum(value, vocab, threads, tx, seg_sum, last)
        sample_segments(value, vocab, u, tx, token, chosen, r, seg_sum, last)

    return sample_row


def gpu_segments_macro(threads: int) -> Callable[..., None]:
    """The GPU row macro ``sample_segments(value, vocab, u, tx, token, chosen, r, seg_sum, last)``, one block per
    row, each thread tx holding its segment's ``gpu_segment_sum`` (``threads`` segments): the draw that follows."""
    log_threads = threads.bit_length() - 1
    assert threads == 1 << log_threads, "the scans and reductions need a power-of-two block size"
    inclusive_scan = gpu_inclusive_scan(log_threads)

    @T.macro
    def sample_segments(value, vocab, u, tx, token, chosen, r, seg_sum, last):
        incl = T.alloc_buffer((threads,), "float32", scope="shared")  # inclusive scan of segment sums
        s_hit = T.alloc_buffer((threads,), "int32", scope="shared")
        s_last = T.alloc_buffer((threads,), "int32", scope="shared")
        part = T.alloc_buffer((1,), "float32", scope="local")
        pick = T.alloc_buffer((1,), "int32", scope="local")
        hit = T.alloc_buffer((2,), "int32", scope="local")  # the segment holding the target, last positive
        carry = T.alloc_buffer((1,), "float32", scope="local")  # the mass before the current chunk of the segment
        chunk_total = T.alloc_buffer((1,), "float32", scope="local")
        mine = T.alloc_buffer((1,), "float32", scope="local")
        seg_last = T.alloc_buffer((1,), "int32", scope="local")
        aim = T.alloc_buffer((1,), "float32", scope="local")  # the target mass (u * the row sum)
        seg: T.let = (vocab + threads - 1) // threads
        # inclusive scan (Hillis-Steele) of the segment sums
        incl[tx] = seg_sum[0]
        T.tvm_storage_sync("shared")
        inclusive_scan(incl, part, tx)
        goal: T.let = u * incl[threads - 1]
        below: T.let = T.Select(tx > 0, incl[T.max(tx - 1, 0)], T.float32(0))
        # the segment holding the target: the lowest one whose scan interval contains it
        s_hit[tx] = T.Select(seg_sum[0] > T.float32(0) and below <= goal and goal < incl[tx], tx,
                             threads)
        s_last[tx] = last[0]
        T.tvm_storage_sync("shared")
        for h in T.unroll(log_threads):
            if tx < T.shift_right(threads, h + 1):
                s_hit[tx] = T.min(s_hit[tx], s_hit[tx + T.shift_right(threads, h + 1)])
                s_last[tx] = T.max(s_last[tx], s_last[tx + T.shift_right(threads, h + 1)])
            T.tvm_storage_sync("shared")
        hit[0] = s_hit[0]  # conditions may not read shared memory (TVM's storage-access check)
        hit[1] = s_last[0]
        aim[0] = goal  # (incl is reused below)
        # The target's segment, scanned by the whole block in chunks of ``threads`` values (one value per thread,
        # an inclusive scan through shared memory, the lowest index passing the target by a min-reduction) rather
        # than by its one thread walking it value by value. The shared arrays are reused: each thread's last positive
        # value goes to s_hit (the segment's is then read), the scan to incl, the candidates to s_last.
        hseg: T.let = T.min(hit[0], threads - 1)
        hs: T.let = T.min(hseg * seg, vocab)
        hl: T.let = T.Select(hit[0] < threads, T.min(hs + seg, vocab) - hs, 0)
        carry[0] = T.Select(hseg > 0, incl[T.max(hseg - 1, 0)], T.float32(0))
        T.tvm_storage_sync("shared")
        s_hit[tx] = last[0]
        T.tvm_storage_sync("shared")
        seg_last[0] = s_hit[hseg]
        pick[0] = vocab
        for c in range((seg + threads - 1) // threads):
            mine[0] = T.if_then_else(c * threads + tx < hl, value(hs + T.min(c * threads + tx, T.max(hl - 1, 0))),
                                     T.float32(0))
            mine[0] = T.Select(mine[0] > T.float32(0), mine[0], T.float32(0))
            incl[tx] = mine[0]
            T.tvm_storage_sync("shared")
            inclusive_scan(incl, part, tx)
            running: T.let = carry[0] + incl[tx]
            s_last[tx] = T.Select(mine[0] > T.float32(0) and running > aim[0], hs + c * threads + tx, vocab)
            chunk_total[0] = incl[threads - 1]
            T.tvm_storage_sync("shared")
            for k in T.unroll(log_threads):
                if tx < T.shift_right(threads, k + 1):
                    s_last[tx] = T.min(s_last[tx], s_last[tx + T.shift_right(threads, k + 1)])
                T.tvm_storage_sync("shared")
            pick[0] = T.min(pick[0], s_last[0])
            carry[0] = carry[0] + chunk_total[0]
            T.tvm_storage_sync("shared")
        if tx == 0:
            if hit[0] < threads:
                # the first positive value passing the target, else (rounding) the segment's last positive one
                token[r] = T.Select(pick[0] < vocab, pick[0], seg_last[0])
                chosen[r] = value(T.Select(pick[0] < vocab, pick[0], T.max(seg_last[0], 0)))
            else:
                # nothing holds the target: a row of zeros (-1), or rounding: the last positive value
                token[r] = hit[1]
                chosen[r] = T.Select(hit[1] >= 0, value(T.max(hit[1], 0)), T.float32(0))

    return sample_segments


def _gpu(threads: int) -> tirx.PrimFunc:
    sample_row = gpu_row_macro(threads)

    @T.prim_func
    def multinomial_from_uniform(var_probs: T.handle, var_uniform: T.handle, var_token: T.handle,
                                 var_chosen: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        probs = T.match_buffer(var_probs, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        uniform = T.match_buffer(var_uniform, (batch,), "float32")
        token = T.match_buffer(var_token, (batch,), "int32")
        chosen = T.match_buffer(var_chosen, (batch,), "float32")
        for r in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                sample_row(row_of(probs, r), vocab, uniform[r], tx, token, chosen, r)
    return multinomial_from_uniform


def get_multinomial_from_uniform(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    return _cpu() if is_cpu(target) else _gpu(max_threads(target))
