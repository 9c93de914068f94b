# fmt: off
"""top_n's GPU passes with each row split over blocks (group maxima, the row's bound, per-chunk candidates, merge),
and the same bound-and-list selection inside one block (``block_top_macro``: the fused kernel's processed top-n).

The n largest entries of a row (larger value first, lower index first among equal values: ``_select``'s order) are
all at or above t, the n-th largest of any n distinct entries of the row; here t is the n-th largest of the maxima of
groups of GROUP_SIZE values (each a distinct entry). Four kernels find them, for n <= SPLIT_TOP_MAX::

    group max:  gmax[r, g] = max(x[r, group g])                                      # split over blocks
    bound:      t[r] = n-th largest of gmax[r, :] (-inf with fewer than n groups)   # one block a row
    candidates: chunk c of row r lists its values > t[r], then its first n equal to t[r] (index order),
                into S = SPLIT_SLOTS slots, and how many of each (more than S: overflow)  # split over blocks
    merge:      the chunks' entries above t[r] and, of those equal to it, the row's first n, gathered;
                every entry's rank = the gathered entries that rank before it;
                values[r, rank], indices[r, rank] = the entry where rank < n          # one block a row

The listed entries hold the row's first n (every value above t, and among the values equal to t the first n of the
row are among the first n of their chunks), and an entry among the first n ranks before every entry that is not, so
its rank among the listed is its rank in the row: the result is exactly the rounds of ``_select.row_top_gpu``. A row
whose chunks overflow their slots or whose list outgrows the merge's shared memory (flat rows, long runs of equal
values above the bound), and every row when n > SPLIT_TOP_MAX, takes ``row_top_gpu``'s rounds over the row in the
merge's block instead. The split depends on the vocabulary alone (SPLIT_CHUNK values a block, as the softmax's), so a
row's result does not depend on the batch.

Workspaces (parts = ``split_parts(vocab)``): ``gmax`` [batch * parts * GROUPS] (float32), ``row_t`` [batch],
``slot_v`` / ``slot_i`` [batch * parts * SPLIT_SLOTS] (float32 / int32), ``slot_n`` [batch * parts * 2] (int32).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ._common import neg_inf
from ._reductions import (
    GPU_UNROLL,
    SPLIT_CHUNK,
    SPLIT_THREADS,
    block_all,
    gpu_inclusive_scan,
    maximum,
    row_of,
    split_parts,
)
from ._select import GPU_TOP_LOCAL, better, row_top_gpu

#: Values per group of the bound: one warp's share of a chunk (32 threads x GPU_UNROLL values).
GROUP_SIZE = 32 * GPU_UNROLL
#: Groups per chunk.
GROUPS = SPLIT_CHUNK // GROUP_SIZE
#: Candidate slots per chunk: its values above the bound and its first n equal to it must fit.
SPLIT_SLOTS = 64
#: The largest n the split passes serve (larger n: the rounds over the row).
SPLIT_TOP_MAX = 32
#: Entries of the merge's list in shared memory per thread of its block (8 bytes an entry), by target kind: 16 KB on
#: CUDA and ROCm, 4 KB on WebGPU (256 threads), 4 KB on Metal (32 KB of threadgroup memory, its all-reduces take more).
_MERGE_PER_THREAD = {"cuda": 2.0, "rocm": 2.0, "webgpu": 2.0, "vulkan": 2.0, "opencl": 1.0, "metal": 0.5}


def merge_capacity(target: tvm.target.Target, threads: int) -> int:
    """Entries of the merge's list in shared memory on ``target``."""
    return int(_MERGE_PER_THREAD[target.kind.name] * threads)


#: Low half of the candidates' packed per-thread counts: the values equal to the bound (at most SPLIT_CHUNK each).
_HALF = 16

_chunk_scan = gpu_inclusive_scan(SPLIT_THREADS.bit_length() - 1)


def split_live(n: tirx.PrimExpr) -> tirx.PrimExpr:
    """Whether the split passes serve an output of width n (else the merge's block scans the row)."""
    return tirx.all(n > 0, n <= SPLIT_TOP_MAX)


@T.macro
def group_max_chunk(x, vocab, n, b, tx, gmax):
    """Block b (row b // parts, chunk b % parts; SPLIT_THREADS threads ``tx``): gmax[b * GROUPS + w] = the largest
    of warp w's values of the chunk (-inf for values past the row: a weaker bound, never a wrong one). Reads only
    where ``split_live(n)``."""
    r: T.let = b // split_parts(vocab)
    base: T.let = b % split_parts(vocab) * SPLIT_CHUNK
    mine = T.alloc_buffer((1,), "float32", scope="local")
    acc = T.alloc_buffer((1,), "float32", scope="local")
    peaks = T.alloc_buffer((SPLIT_THREADS,), "float32", scope="shared")
    mine[0] = neg_inf()
    for u in T.unroll(GPU_UNROLL):
        mine[0] = T.max(mine[0], T.if_then_else(split_live(n) and base + u * SPLIT_THREADS + tx < vocab,
                                                x[r, T.min(base + u * SPLIT_THREADS + tx, vocab - 1)], neg_inf()))
    peaks[tx] = mine[0]
    T.tvm_storage_sync("shared")
    if tx < GROUPS:
        acc[0] = peaks[tx * 32]
        for k in range(1, 32):
            acc[0] = T.max(acc[0], peaks[tx * 32 + k])
        gmax[b * GROUPS + tx] = acc[0]


def row_bound_macro(threads: int):
    """The macro ``bound(gmax, r, vocab, n, tx, row_t)``, one block of ``threads`` per row: row_t[r] = the n-th
    largest of row r's group maxima, counted with multiplicity (-inf when it has fewer than n). Each group maximum v
    counts the others above it and at or above it (tiles of ``threads`` through shared memory); the one with fewer
    than n above and at least n at or above is t (all such are equal)."""

    @T.macro
    def bound(gmax, r, vocab, n, tx, row_t):
        ng: T.let = split_parts(vocab) * GROUPS
        tiles: T.let = T.Select(split_live(n), (ng + threads - 1) // threads, 0)
        tile = T.alloc_buffer((threads,), "float32", scope="shared")
        cnt = T.alloc_buffer((2,), "int32", scope="local")  # above, at or above
        best = T.alloc_buffer((1,), "float32", scope="local")
        t = T.alloc_buffer((1,), "float32", scope="local")
        best[0] = neg_inf()
        for k in range(tiles):
            g: T.let = k * threads + tx
            v: T.let = gmax[r * ng + T.min(g, ng - 1)]
            cnt[0] = 0
            cnt[1] = 0
            for h in range(tiles):
                tile[tx] = gmax[r * ng + T.min(h * threads + tx, ng - 1)]
                T.tvm_storage_sync("shared")
                for j in range(T.min(threads, ng - h * threads)):
                    w: T.let = tile[j]
                    cnt[0] = cnt[0] + T.Select(w > v, 1, 0)
                    cnt[1] = cnt[1] + T.Select(w >= v, 1, 0)
                T.tvm_storage_sync("shared")
            if g < ng and cnt[0] < n and cnt[1] >= n:
                best[0] = T.max(best[0], v)
        block_all(maximum, neg_inf(), best[0], t, tx)
        if tx == 0:
            row_t[r] = t[0]

    return bound


@T.macro
def candidates_chunk(x, vocab, n, b, tx, row_t, slot_v, slot_i, slot_n):
    """Block b: its chunk's values above its row's bound t (index order), then its first n equal to t (index order),
    with their indices, into slots b * SPLIT_SLOTS onwards (those past SPLIT_SLOTS are dropped); slot_n[2 b] = how
    many are above t, slot_n[2 b + 1] = how many equal to t are listed (min(n, those in the chunk)). Each thread takes
    GPU_UNROLL consecutive values; a block scan of the threads' counts (above t in the high half, equal in the low
    half of one int32) places them."""
    r: T.let = b // split_parts(vocab)
    base: T.let = b % split_parts(vocab) * SPLIT_CHUNK
    t: T.let = row_t[r]
    xs = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
    own = T.alloc_buffer((1,), "int32", scope="local")
    part = T.alloc_buffer((1,), "int32", scope="local")
    run = T.alloc_buffer((2,), "int32", scope="local")  # above t, equal to t: before the current value
    offs = T.alloc_buffer((SPLIT_THREADS,), "int32", scope="shared")
    own[0] = 0
    for u in T.unroll(GPU_UNROLL):
        xs[u] = T.if_then_else(split_live(n) and base + tx * GPU_UNROLL + u < vocab,
                               x[r, T.min(base + tx * GPU_UNROLL + u, vocab - 1)], neg_inf())
        own[0] = own[0] + T.Select(split_live(n) and base + tx * GPU_UNROLL + u < vocab,
                                   T.Select(xs[u] > t, 1 << _HALF, T.Select(xs[u] == t, 1, 0)), 0)
    offs[tx] = own[0]
    T.tvm_storage_sync("shared")
    _chunk_scan(offs, part, tx)
    before: T.let = offs[tx] - own[0]
    above: T.let = T.shift_right(offs[SPLIT_THREADS - 1], _HALF)
    ties: T.let = T.bitwise_and(offs[SPLIT_THREADS - 1], (1 << _HALF) - 1)
    run[0] = T.shift_right(before, _HALF)
    run[1] = T.bitwise_and(before, (1 << _HALF) - 1)
    for u in T.unroll(GPU_UNROLL):
        if split_live(n) and base + tx * GPU_UNROLL + u < vocab:
            if xs[u] > t:
                if run[0] < SPLIT_SLOTS:
                    slot_v[b * SPLIT_SLOTS + T.min(T.max(run[0], 0), SPLIT_SLOTS - 1)] = xs[u]
                    slot_i[b * SPLIT_SLOTS + T.min(T.max(run[0], 0), SPLIT_SLOTS - 1)] = base + tx * GPU_UNROLL + u
                run[0] = run[0] + 1
            elif xs[u] == t:
                if run[1] < n and above + run[1] < SPLIT_SLOTS:
                    slot_v[b * SPLIT_SLOTS + T.min(T.max(above + run[1], 0), SPLIT_SLOTS - 1)] = xs[u]
                    slot_i[b * SPLIT_SLOTS + T.min(T.max(above + run[1], 0), SPLIT_SLOTS - 1)] = (
                        base + tx * GPU_UNROLL + u)
                run[1] = run[1] + 1
    if tx == 0:
        slot_n[2 * b] = above
        slot_n[2 * b + 1] = T.min(ties, n)


def merge_macro(threads: int, uniform_loops: bool, cap: int):
    """The macro ``merge(x, vocab, n, r, tx, slot_v, slot_i, slot_n, values, indices)``, one block of ``threads``
    per row: from each chunk's slots its values above the bound and, of its values equal to the bound, those among the
    row's first n (a block scan of the chunks' counts of them), gathered into shared memory (a second scan places
    them); each ranked by counting the entries that rank before it, those ranked below n written out. A row the split
    does not serve (n > SPLIT_TOP_MAX, a chunk whose candidates overflow its slots, a list past the shared memory,
    more chunks than threads) runs ``row_top_gpu``'s rounds over the row instead. ``uniform_loops`` (WGSL): those
    rounds' barriers run in every row (idle where the split served it). ``cap``: the list's entries."""
    scan = gpu_inclusive_scan(threads.bit_length() - 1)
    assert threads == 1 << (threads.bit_length() - 1), "the scan needs a power-of-two block size"

    @T.macro
    def merge(x, vocab, n, r, tx, slot_v, slot_i, slot_n, values, indices):
        parts: T.let = split_parts(vocab)
        offs = T.alloc_buffer((threads,), "int32", scope="shared")
        lst_v = T.alloc_buffer((cap,), "float32", scope="shared")
        lst_i = T.alloc_buffer((cap,), "int32", scope="shared")
        part = T.alloc_buffer((1,), "int32", scope="local")
        mine = T.alloc_buffer((3,), "int32", scope="local")  # this thread's chunk: above, ties listed, kept
        worst = T.alloc_buffer((1,), "int32", scope="local")
        st = T.alloc_buffer((2,), "int32", scope="local")  # 0: the list's length, 1: the split serves the row
        rank = T.alloc_buffer((1,), "int32", scope="local")
        span = T.alloc_buffer((2,), "int32", scope="local")  # a chunk's entries in the list: [span[0], span[1])
        fits: T.let = split_live(n) and parts <= threads
        mine[0] = T.Select(fits and tx < parts, slot_n[2 * (r * parts + T.min(tx, parts - 1))], 0)
        mine[1] = T.Select(fits and tx < parts, slot_n[2 * (r * parts + T.min(tx, parts - 1)) + 1], 0)
        block_all(maximum, T.int32(0), mine[0] + mine[1], worst, tx)
        # the row's first n values equal to the bound: the chunks' listed ones, in chunk order, up to n
        offs[tx] = mine[1]
        T.tvm_storage_sync("shared")
        scan(offs, part, tx)
        mine[2] = mine[0] + T.max(T.min(mine[1], n - (offs[tx] - mine[1])), 0)
        T.tvm_storage_sync("shared")
        offs[tx] = mine[2]
        T.tvm_storage_sync("shared")
        scan(offs, part, tx)
        st[0] = offs[threads - 1]
        st[1] = T.Select(fits and worst[0] <= SPLIT_SLOTS and st[0] <= cap, 1, 0)
        # gather: slot q of the row's chunks (chunk q // SPLIT_SLOTS, its entry q % SPLIT_SLOTS); a chunk keeps its
        # first ``kept`` slots (those above the bound come first)
        for s in range(T.Select(fits, (parts * SPLIT_SLOTS + threads - 1) // threads, 0)):
            q: T.let = s * threads + tx
            p: T.let = T.min(q // SPLIT_SLOTS, parts - 1)
            # (conditions may not read shared memory: the chunk's place in the list goes through registers)
            span[0] = T.Select(p > 0, offs[T.max(p - 1, 0)], 0)
            span[1] = offs[p]
            if st[1] == 1 and q < parts * SPLIT_SLOTS and span[0] + q % SPLIT_SLOTS < span[1]:
                lst_v[T.min(span[0] + q % SPLIT_SLOTS, cap - 1)] = slot_v[(r * parts + p) * SPLIT_SLOTS
                                                                          + q % SPLIT_SLOTS]
                lst_i[T.min(span[0] + q % SPLIT_SLOTS, cap - 1)] = slot_i[(r * parts + p) * SPLIT_SLOTS
                                                                          + q % SPLIT_SLOTS]
        T.tvm_storage_sync("shared")
        # ranks: an entry's rank among the listed is its rank in the row where it is among the first n
        for k in range((cap + threads - 1) // threads):
            e: T.let = k * threads + tx
            if st[1] == 1 and e < st[0]:
                v: T.let = lst_v[T.min(e, cap - 1)]
                i: T.let = lst_i[T.min(e, cap - 1)]
                rank[0] = 0
                for h in range(st[0]):
                    rank[0] = rank[0] + T.Select(better(lst_v[T.min(h, cap - 1)], lst_i[T.min(h, cap - 1)], v, i),
                                                 1, 0)
                if rank[0] < n:
                    values[r, T.max(rank[0], 0)] = v
                    indices[r, T.max(rank[0], 0)] = i
        # slots past the row (n > vocab, a caller error): -inf and -1, as the rounds write them
        if st[1] == 1 and tx >= st[0] and tx < n:
            values[r, tx] = neg_inf()
            indices[r, tx] = -1
        count: T.let = T.Select(st[1] == 1, 0, n)
        row_top_gpu(row_of(x, r), vocab, n if uniform_loops else count, count, tx, threads, values, indices, r)

    return merge


def split_top_n(threads: int, uniform_loops: bool, cap: int):
    """The macro ``top(x, batch, vocab, n, values, indices)``: the four kernels (see the module docstring), the
    merge's list holding ``cap`` entries (``merge_capacity``)."""
    bound = row_bound_macro(threads)
    merge = merge_macro(threads, uniform_loops, cap)

    @T.macro
    def top(x, batch, vocab, n, values, indices):
        gmax = T.alloc_buffer((batch * split_parts(vocab) * GROUPS,), "float32", scope="global")
        row_t = T.alloc_buffer((batch,), "float32", scope="global")
        slot_v = T.alloc_buffer((batch * split_parts(vocab) * SPLIT_SLOTS,), "float32", scope="global")
        slot_i = T.alloc_buffer((batch * split_parts(vocab) * SPLIT_SLOTS,), "int32", scope="global")
        slot_n = T.alloc_buffer((batch * split_parts(vocab) * 2,), "int32", scope="global")
        for b in T.thread_binding(batch * split_parts(vocab), thread="blockIdx.x"):
            for tx in T.thread_binding(SPLIT_THREADS, thread="threadIdx.x"):
                group_max_chunk(x, vocab, n, b, tx, gmax)
        for r in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                bound(gmax, r, vocab, n, tx, row_t)
        for b in T.thread_binding(batch * split_parts(vocab), thread="blockIdx.x"):
            for tx in T.thread_binding(SPLIT_THREADS, thread="threadIdx.x"):
                candidates_chunk(x, vocab, n, b, tx, row_t, slot_v, slot_i, slot_n)
        for r in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                merge(x, vocab, n, r, tx, slot_v, slot_i, slot_n, values, indices)

    return top


def block_top_macro(threads: int, uniform_loops: bool, cap: int):
    """The macro ``top(value, vocab, rounds, count, tx, values, indices, out_r)``: ``_select.row_top_gpu``'s result
    (values[out_r, j], indices[out_r, j] for j < count, of value(0 .. vocab - 1)) in one block of ``threads``, for
    a row read through a formula (the fused kernel's processed top-n). Rows asking for more than GPU_TOP_LOCAL
    entries (at most SPLIT_TOP_MAX) take three passes over the row instead of one per entry past GPU_TOP_LOCAL: each
    thread's maximum of its segment of consecutive values, t = the count-th largest of those maxima, each segment's
    values above t and the row's first ``count`` equal to t into a list in shared memory (two block scans place
    them), ranked as in the merge above. Other rows, and rows whose list would not fit ``cap``, take the rounds.
    ``rounds`` (>= count, block-uniform; the output width on WGSL) as ``row_top_gpu``'s."""
    scan = gpu_inclusive_scan(threads.bit_length() - 1)
    assert threads == 1 << (threads.bit_length() - 1), "the scan needs a power-of-two block size"

    @T.macro
    def top(value, vocab, rounds, count, tx, values, indices, out_r):
        peaks = T.alloc_buffer((threads,), "float32", scope="shared")
        g_off = T.alloc_buffer((threads,), "int32", scope="shared")
        e_off = T.alloc_buffer((threads,), "int32", scope="shared")
        lst_v = T.alloc_buffer((cap,), "float32", scope="shared")
        lst_i = T.alloc_buffer((cap,), "int32", scope="shared")
        mine = T.alloc_buffer((1,), "float32", scope="local")
        xv = T.alloc_buffer((1,), "float32", scope="local")  # the value read (a register, not a T.let: see _pick_gpu)
        t = T.alloc_buffer((1,), "float32", scope="local")
        cnt = T.alloc_buffer((2,), "int32", scope="local")  # this segment: above t, equal to t
        run = T.alloc_buffer((2,), "int32", scope="local")  # the row before the current value: above t, equal
        st = T.alloc_buffer((3,), "int32", scope="local")  # the row: above t, equal to t; 1 where the list is used
        part = T.alloc_buffer((1,), "int32", scope="local")
        rank = T.alloc_buffer((1,), "int32", scope="local")
        listed: T.let = count > GPU_TOP_LOCAL and count <= SPLIT_TOP_MAX
        seg: T.let = (vocab + threads - 1) // threads
        begin: T.let = T.min(tx * seg, vocab)
        size: T.let = T.Select(listed, T.min(begin + seg, vocab) - begin, 0)
        # each thread's maximum (-inf for an empty segment: a weaker bound, never a wrong one)
        mine[0] = neg_inf()
        for i in range(size):
            mine[0] = T.max(mine[0], value(begin + i))
        peaks[tx] = mine[0]
        T.tvm_storage_sync("shared")
        cnt[0] = 0
        cnt[1] = 0
        for j in range(threads):
            w: T.let = peaks[j]
            cnt[0] = cnt[0] + T.Select(w > mine[0], 1, 0)
            cnt[1] = cnt[1] + T.Select(w >= mine[0], 1, 0)
        block_all(maximum, neg_inf(), T.Select(listed and cnt[0] < count and cnt[1] >= count, mine[0], neg_inf()),
                  t, tx)
        # each segment's values above t and equal to t, then their places in the row's order
        cnt[0] = 0
        cnt[1] = 0
        for i in range(size):
            xv[0] = value(begin + i)
            cnt[0] = cnt[0] + T.Select(xv[0] > t[0], 1, 0)
            cnt[1] = cnt[1] + T.Select(xv[0] == t[0], 1, 0)
        g_off[tx] = cnt[0]
        e_off[tx] = cnt[1]
        T.tvm_storage_sync("shared")
        scan(g_off, part, tx)
        scan(e_off, part, tx)
        run[0] = g_off[tx] - cnt[0]
        run[1] = e_off[tx] - cnt[1]
        st[0] = g_off[threads - 1]
        st[1] = e_off[threads - 1]
        st[2] = T.Select(listed and st[0] + T.min(st[1], count) <= cap, 1, 0)
        for i in range(T.Select(st[2] == 1, size, 0)):
            xv[0] = value(begin + i)
            if xv[0] > t[0]:
                lst_v[T.max(T.min(run[0] + T.min(run[1], count), cap - 1), 0)] = xv[0]
                lst_i[T.max(T.min(run[0] + T.min(run[1], count), cap - 1), 0)] = begin + i
                run[0] = run[0] + 1
            elif xv[0] == t[0]:
                if run[1] < count:
                    lst_v[T.max(T.min(run[0] + run[1], cap - 1), 0)] = xv[0]
                    lst_i[T.max(T.min(run[0] + run[1], cap - 1), 0)] = begin + i
                run[1] = run[1] + 1
        T.tvm_storage_sync("shared")
        for k in range((cap + threads - 1) // threads):
            e: T.let = k * threads + tx
            if st[2] == 1 and e < st[0] + T.min(st[1], count):
                v: T.let = lst_v[T.min(e, cap - 1)]
                i: T.let = lst_i[T.min(e, cap - 1)]
                rank[0] = 0
                for h in range(st[0] + T.min(st[1], count)):
                    rank[0] = rank[0] + T.Select(better(lst_v[T.min(h, cap - 1)], lst_i[T.min(h, cap - 1)], v, i),
                                                 1, 0)
                if rank[0] < count:
                    values[out_r, T.max(rank[0], 0)] = v
                    indices[out_r, T.max(rank[0], 0)] = i
        # slots past the row (count > vocab): -inf and -1, as the rounds write them
        if st[2] == 1 and tx >= st[0] + T.min(st[1], count) and tx < count:
            values[out_r, tx] = neg_inf()
            indices[out_r, tx] = -1
        rest: T.let = T.Select(st[2] == 1, 0, count)
        row_top_gpu(value, vocab, rounds if uniform_loops else rest, rest, tx, threads, values, indices, out_r)

    return top
