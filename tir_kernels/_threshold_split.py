# fmt: off
"""The GPU threshold search's passes over whole rows, each row split over blocks, and the per-row combines between
them (used by ``renormalize_probs`` and ``sample_from_logits``).

The threshold search of a row (``renormalize.gpu_row_threshold``) needs three passes over the row before its
bisection steps: the first pass (count, sum and largest bits of the positive values), the bound pass (count and sum
at or above GPU_PIVOTS pivots: the min-p threshold and 1, 2, 4, 8 binades below the maximum) and, where the values
at or above the chosen lower bound fit, the copy of those values into a candidate list. Here each pass runs as one
kernel over blocks of SPLIT_THREADS threads, each block reading one chunk of SPLIT_CHUNK values (the softmax's split:
it depends on the vocabulary alone, so a row's result does not depend on the batch), and writing its partials to
workspaces; between the passes one thread per row combines the partials in chunk order (a fixed order: the same
floats whatever the batch) into the row's record, and the list is written in index order to a global workspace, from
which the one-block search loads it into shared memory.

Workspaces, with parts = ``split_parts(vocab)``: ``p1_cnt`` / ``p1_sum`` / ``p1_max`` [batch * parts] (first pass),
``bd_cnt`` / ``bd_sum`` [batch * parts * GPU_PIVOTS] (bound pass), ``row_i`` [batch * ROW_INTS] and ``row_f``
[batch * ROW_FLOATS] (the row's record, slots below), ``chunk_off`` [batch * parts] (where each chunk's candidates
start in the list), ``cand`` [batch * list_cap] (the list).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ._reductions import (
    GPU_UNROLL,
    SPLIT_CHUNK,
    SPLIT_THREADS,
    add,
    block_all,
    gpu_inclusive_scan,
    maximum,
    split_parts,
)

#: Pivots of the bound pass: the min-p threshold, then 1, 2, 4, 8 binades below the row's largest value.
GPU_PIVOTS = 5
#: Bit patterns per binade of float32 (one step of the exponent field).
BINADE = 1 << 23

# Slots of the row record (int32 ``row_i``, ROW_INTS a row; float32 ``row_f``, ROW_FLOATS a row).
#: The min-p threshold's bits (1 without min-p): the kept set after the first pass is bits >= it.
I_LO = 0
#: The largest bits of the row (< 1: a row of zeros, or a row the caller does not search).
I_MAX = 1
#: 1 while F_MASS is the sum of the kept set (no min-p).
I_EXACT = 2
#: 1 where top-k is on (after the first pass's count), 1 where top-p is on.
I_TOPK = 3
I_TOPP = 4
#: 1 where the bound pass reads the row.
I_LIVE = 5
#: The bound pass's pivots (GPU_PIVOTS slots).
I_PIVOT = 6
#: The list's lower bound (a pivot), the count of values at or above it, and its pivot's index.
I_LB = I_PIVOT + GPU_PIVOTS
I_COUNT = I_LB + 1
I_JLB = I_LB + 2
#: 1 where the list is used (a filter searches and the values >= the lower bound fit).
I_LIST = I_LB + 3
ROW_INTS = I_LIST + 1
#: The sum of the positive values (the first pass).
F_MASS = 0
#: The bound pass's sums at pivot 0 and at the list's lower bound.
F_SUM0 = 1
F_SUMLB = 2
ROW_FLOATS = 3

_INT_MIN = -2147483647  # not -2**31: WGSL has no literal for it


def _bits(x: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.reinterpret("int32", x)


def _entry(buf: tirx.Buffer, j: tirx.PrimExpr, n: int) -> tirx.PrimExpr:
    """buf[j] for j < n, as a chain of selects over constant indices (a local array indexed by a variable would be
    placed in memory, not registers)."""
    value = buf[n - 1]
    for i in reversed(range(n - 1)):
        value = T.Select(j == i, buf[i], value)
    return value


@T.macro
def first_pass_chunk(value, vocab, b, tx, live, p1_cnt, p1_sum, p1_max):
    """Block b (row b // parts, chunk b % parts; SPLIT_THREADS threads ``tx``): the count, sum and largest bits of
    the chunk's positive values ``value(i)`` (read only where ``live``: else a row of zeros), thread 0 writes."""
    l_i = T.alloc_buffer((1,), "int32", scope="local")
    l_f = T.alloc_buffer((1,), "float32", scope="local")
    l_mx = T.alloc_buffer((1,), "int32", scope="local")
    r_i = T.alloc_buffer((1,), "int32", scope="local")
    r_f = T.alloc_buffer((1,), "float32", scope="local")
    r_mx = T.alloc_buffer((1,), "int32", scope="local")
    xs = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
    base: T.let = b % split_parts(vocab) * SPLIT_CHUNK
    l_i[0] = 0
    l_f[0] = T.float32(0)
    l_mx[0] = 0
    for u in T.unroll(GPU_UNROLL):
        # the value into a register (a local store, not a ``T.let``: docs/kernels.md, Build time)
        xs[u] = T.if_then_else(live and base + u * SPLIT_THREADS + tx < vocab,
                               value(T.min(base + u * SPLIT_THREADS + tx, vocab - 1)), T.float32(0))
        above: T.let = _bits(xs[u]) >= 1
        l_i[0] = l_i[0] + T.Select(above, 1, 0)
        l_f[0] = l_f[0] + T.Select(above, xs[u], T.float32(0))
        l_mx[0] = T.max(l_mx[0], _bits(xs[u]))
    block_all(add, T.int32(0), l_i[0], r_i, tx)
    block_all(add, T.float32(0), l_f[0], r_f, tx)
    block_all(maximum, T.int32(0), l_mx[0], r_mx, tx)
    if tx == 0:
        p1_cnt[b] = r_i[0]
        p1_sum[b] = r_f[0]
        p1_max[b] = r_mx[0]


@T.macro
def row_setup(p1_cnt, p1_sum, p1_max, r, vocab, k, top_p_r, min_p_r, row_i, row_f):
    """Row r's first-pass results, combined over its chunks in order, and what follows from them (the min-p
    threshold, which filters search, the bound pass's pivots) into its record. One thread."""
    parts: T.let = split_parts(vocab)
    acc = T.alloc_buffer((2,), "int32", scope="local")
    mass = T.alloc_buffer((1,), "float32", scope="local")
    acc[0] = 0
    acc[1] = 0
    mass[0] = T.float32(0)
    for p in range(parts):
        acc[0] = acc[0] + p1_cnt[r * parts + p]
        mass[0] = mass[0] + p1_sum[r * parts + p]
        acc[1] = T.max(acc[1], p1_max[r * parts + p])
    top: T.let = acc[1]
    has_min_p: T.let = min_p_r > T.float32(0) and top >= 1
    lo: T.let = T.Select(has_min_p, T.max(1, _bits(min_p_r * T.reinterpret("float32", top))), 1)
    topk: T.let = k > 0 and k < vocab and (has_min_p or acc[0] > k) and top >= 1
    topp: T.let = top_p_r < T.float32(1) and top >= 1
    row_i[r * ROW_INTS + I_LO] = lo
    row_i[r * ROW_INTS + I_MAX] = top
    row_i[r * ROW_INTS + I_EXACT] = T.Select(has_min_p, 0, 1)
    row_i[r * ROW_INTS + I_TOPK] = T.Select(topk, 1, 0)
    row_i[r * ROW_INTS + I_TOPP] = T.Select(topp, 1, 0)
    row_i[r * ROW_INTS + I_LIVE] = T.Select(top >= 1 and (topk or topp or has_min_p), 1, 0)
    row_i[r * ROW_INTS + I_PIVOT] = lo
    for j in T.unroll(1, GPU_PIVOTS):
        row_i[r * ROW_INTS + I_PIVOT + j] = T.max(lo, top - T.shift_left(1, j - 1) * BINADE + 1)
    row_f[r * ROW_FLOATS + F_MASS] = mass[0]


@T.macro
def bound_pass_chunk(value, vocab, b, tx, row_i, bd_cnt, bd_sum):
    """Block b: the count and sum of the chunk's values at or above each of its row's pivots (read only where the
    row's record says the bound pass is live), thread 0 writes them."""
    r: T.let = b // split_parts(vocab)
    base: T.let = b % split_parts(vocab) * SPLIT_CHUNK
    live: T.let = row_i[r * ROW_INTS + I_LIVE] == 1
    pv = T.alloc_buffer((GPU_PIVOTS,), "int32", scope="local")
    lc = T.alloc_buffer((GPU_PIVOTS,), "int32", scope="local")
    ls = T.alloc_buffer((GPU_PIVOTS,), "float32", scope="local")
    r_i = T.alloc_buffer((1,), "int32", scope="local")
    r_f = T.alloc_buffer((1,), "float32", scope="local")
    for j in T.unroll(GPU_PIVOTS):
        pv[j] = row_i[r * ROW_INTS + I_PIVOT + j]
        lc[j] = 0
        ls[j] = T.float32(0)
    xs = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
    for u in T.unroll(GPU_UNROLL):
        xs[u] = T.if_then_else(live and base + u * SPLIT_THREADS + tx < vocab,
                               value(T.min(base + u * SPLIT_THREADS + tx, vocab - 1)), T.float32(0))
        for j in T.unroll(GPU_PIVOTS):
            above: T.let = _bits(xs[u]) >= pv[j]
            lc[j] = lc[j] + T.Select(above, 1, 0)
            ls[j] = ls[j] + T.Select(above, xs[u], T.float32(0))
    # a serial loop: an all-reduce in an unrolled one is copied before it is lowered (one result buffer, several
    # all-reduces); the partials are picked by constant indices, so they stay in registers
    for j in range(GPU_PIVOTS):
        block_all(add, T.int32(0), _entry(lc, j, GPU_PIVOTS), r_i, tx)
        block_all(add, T.float32(0), _entry(ls, j, GPU_PIVOTS), r_f, tx)
        if tx == 0:
            bd_cnt[b * GPU_PIVOTS + j] = r_i[0]
            bd_sum[b * GPU_PIVOTS + j] = r_f[0]


@T.macro
def row_bound(bd_cnt, bd_sum, r, vocab, k, top_p_r, list_cap, row_i, row_f, chunk_off):
    """Row r's bound-pass results, combined over its chunks in order: the list's lower bound lb (the highest pivot
    holding k values with top-k, or whose values alone reach top_p of the mass at or above pivot 0 with top-p
    alone; else pivot 0), whether the list is used, and where each chunk's candidates start in it. One thread."""
    parts: T.let = split_parts(vocab)
    cnt = T.alloc_buffer((GPU_PIVOTS,), "int32", scope="local")
    sums = T.alloc_buffer((GPU_PIVOTS,), "float32", scope="local")
    st = T.alloc_buffer((3,), "int32", scope="local")  # 0: lb, 1: its pivot, 2: the running offset
    for j in T.unroll(GPU_PIVOTS):
        cnt[j] = 0
        sums[j] = T.float32(0)
        for p in range(parts):
            cnt[j] = cnt[j] + bd_cnt[(r * parts + p) * GPU_PIVOTS + j]
            sums[j] = sums[j] + bd_sum[(r * parts + p) * GPU_PIVOTS + j]
    topk: T.let = row_i[r * ROW_INTS + I_TOPK] == 1
    topp: T.let = row_i[r * ROW_INTS + I_TOPP] == 1
    st[0] = row_i[r * ROW_INTS + I_PIVOT]
    st[1] = 0
    for jj in T.unroll(GPU_PIVOTS - 1):
        if (topk and cnt[GPU_PIVOTS - 1 - jj] >= k) or (
                not topk and topp and sums[GPU_PIVOTS - 1 - jj] >= top_p_r * sums[0]):
            st[0] = row_i[r * ROW_INTS + I_PIVOT + GPU_PIVOTS - 1 - jj]
            st[1] = GPU_PIVOTS - 1 - jj
    count: T.let = _entry(cnt, st[1], GPU_PIVOTS)
    row_i[r * ROW_INTS + I_LB] = st[0]
    row_i[r * ROW_INTS + I_COUNT] = count
    row_i[r * ROW_INTS + I_JLB] = st[1]
    row_i[r * ROW_INTS + I_LIST] = T.Select(row_i[r * ROW_INTS + I_LIVE] == 1 and (topk or topp)
                                            and count <= list_cap, 1, 0)
    row_f[r * ROW_FLOATS + F_SUM0] = sums[0]
    row_f[r * ROW_FLOATS + F_SUMLB] = _entry(sums, st[1], GPU_PIVOTS)
    st[2] = 0
    for p in range(parts):
        chunk_off[r * parts + p] = st[2]
        st[2] = st[2] + bd_cnt[(r * parts + p) * GPU_PIVOTS + st[1]]


_chunk_scan = gpu_inclusive_scan(SPLIT_THREADS.bit_length() - 1)


@T.macro
def collect_chunk(value, vocab, b, tx, row_i, chunk_off, list_cap, cand, cand_id):
    """Block b: where its row uses the list, the chunk's values with bits >= the row's lb into ``cand`` (the row's
    list, list_cap entries from r * list_cap) and their indices into ``cand_id`` (None: not kept), in index order,
    from the chunk's offset. Each thread takes GPU_UNROLL consecutive values (its share's place: a block scan of
    the threads' counts)."""
    r: T.let = b // split_parts(vocab)
    base: T.let = b % split_parts(vocab) * SPLIT_CHUNK
    on: T.let = row_i[r * ROW_INTS + I_LIST] == 1
    lb: T.let = row_i[r * ROW_INTS + I_LB]
    xs = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
    n = T.alloc_buffer((1,), "int32", scope="local")
    at = T.alloc_buffer((1,), "int32", scope="local")
    part = T.alloc_buffer((1,), "int32", scope="local")
    offs = T.alloc_buffer((SPLIT_THREADS,), "int32", scope="shared")
    n[0] = 0
    for u in T.unroll(GPU_UNROLL):
        xs[u] = T.if_then_else(on and base + tx * GPU_UNROLL + u < vocab,
                               value(T.min(base + tx * GPU_UNROLL + u, vocab - 1)), T.float32(0))
        n[0] = n[0] + T.Select(on and _bits(xs[u]) >= lb, 1, 0)
    offs[tx] = n[0]
    T.tvm_storage_sync("shared")
    _chunk_scan(offs, part, tx)
    at[0] = chunk_off[b] + offs[tx] - n[0]
    for u in T.unroll(GPU_UNROLL):
        if on and _bits(xs[u]) >= lb:
            # (clamped both ways: the bounds of an index read from a local buffer must not depend on it)
            cand[r * list_cap + T.max(T.min(at[0], list_cap - 1), 0)] = xs[u]
            if cand_id is not None:
                cand_id[r * list_cap + T.max(T.min(at[0], list_cap - 1), 0)] = base + tx * GPU_UNROLL + u
            at[0] = at[0] + 1



#: Row scalars the split passes bind once per block (``row_scalar(r, k)``, k < ROW_SCALARS) before building the
#: row's reading ``row_value(r, scalars)``: a variable each, so that the per-token expression stays small (the
#: lowering's time grows with the buffer accesses in it).
ROW_SCALARS = 7


def split_threshold_passes(list_cap: int):
    """The macro ``passes(batch, vocab, row_scalar, row_value, k_of, top_p_of, min_p_of, live_of, row_i, row_f,
    cand, cand_id)``: the five kernels before a one-block search (first pass, row setup, bound pass, row bound, list
    copy), for rows read as ``row_value(r, scalars)(i)`` (scalars: ``row_scalar(r, k)`` for k < ROW_SCALARS, bound
    once per block) with filters ``k_of(r)``, ``top_p_of(r)``, ``min_p_of(r)``, searched where ``live_of(r)``.
    Fills the row records ``row_i`` / ``row_f`` and the lists ``cand`` / ``cand_id`` (values and indices, list_cap
    entries a row; ``cand_id`` None: no indices) the caller allocated; allocates its own workspaces for the
    partials."""

    @T.macro
    def passes(batch, vocab, row_scalar, row_value, k_of, top_p_of, min_p_of, live_of, row_i, row_f, cand,
               cand_id):
        p1_cnt = T.alloc_buffer((batch * split_parts(vocab),), "int32", scope="global")
        p1_sum = T.alloc_buffer((batch * split_parts(vocab),), "float32", scope="global")
        p1_max = T.alloc_buffer((batch * split_parts(vocab),), "int32", scope="global")
        bd_cnt = T.alloc_buffer((batch * split_parts(vocab) * GPU_PIVOTS,), "int32", scope="global")
        bd_sum = T.alloc_buffer((batch * split_parts(vocab) * GPU_PIVOTS,), "float32", scope="global")
        chunk_off = T.alloc_buffer((batch * split_parts(vocab),), "int32", scope="global")
        # the first pass, each row split over blocks
        for b in T.thread_binding(batch * split_parts(vocab), thread="blockIdx.x"):
            for tx in T.thread_binding(SPLIT_THREADS, thread="threadIdx.x"):
                r1: T.let = b // split_parts(vocab)
                a0: T.let = row_scalar(r1, 0)
                a1: T.let = row_scalar(r1, 1)
                a2: T.let = row_scalar(r1, 2)
                a3: T.let = row_scalar(r1, 3)
                a4: T.let = row_scalar(r1, 4)
                a5: T.let = row_scalar(r1, 5)
                a6: T.let = row_scalar(r1, 6)
                first_pass_chunk(row_value(r1, (a0, a1, a2, a3, a4, a5, a6)), vocab, b, tx, live_of(r1),
                                 p1_cnt, p1_sum, p1_max)
        # each row's first-pass results and pivots (one thread a row)
        for r in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                if tx == 0:
                    row_setup(p1_cnt, p1_sum, p1_max, r, vocab, k_of(r), top_p_of(r), min_p_of(r), row_i, row_f)
        # the bound pass
        for b in T.thread_binding(batch * split_parts(vocab), thread="blockIdx.x"):
            for tx in T.thread_binding(SPLIT_THREADS, thread="threadIdx.x"):
                r3: T.let = b // split_parts(vocab)
                c0: T.let = row_scalar(r3, 0)
                c1: T.let = row_scalar(r3, 1)
                c2: T.let = row_scalar(r3, 2)
                c3: T.let = row_scalar(r3, 3)
                c4: T.let = row_scalar(r3, 4)
                c5: T.let = row_scalar(r3, 5)
                c6: T.let = row_scalar(r3, 6)
                bound_pass_chunk(row_value(r3, (c0, c1, c2, c3, c4, c5, c6)), vocab, b, tx, row_i, bd_cnt, bd_sum)
        # each row's lower bound, whether it uses the list, and its chunks' offsets in it
        for r in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                if tx == 0:
                    row_bound(bd_cnt, bd_sum, r, vocab, k_of(r), top_p_of(r), list_cap, row_i, row_f, chunk_off)
        # the list's copy
        for b in T.thread_binding(batch * split_parts(vocab), thread="blockIdx.x"):
            for tx in T.thread_binding(SPLIT_THREADS, thread="threadIdx.x"):
                r5: T.let = b // split_parts(vocab)
                e0: T.let = row_scalar(r5, 0)
                e1: T.let = row_scalar(r5, 1)
                e2: T.let = row_scalar(r5, 2)
                e3: T.let = row_scalar(r5, 3)
                e4: T.let = row_scalar(r5, 4)
                e5: T.let = row_scalar(r5, 5)
                e6: T.let = row_scalar(r5, 6)
                collect_chunk(row_value(r5, (e0, e1, e2, e3, e4, e5, e6)), vocab, b, tx, row_i, chunk_off, list_cap,
                              cand, cand_id)

    return passes
