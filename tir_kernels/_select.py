# fmt: off
"""The (value, index) selection shared by the argmax and top_n kernels.

Entries of a row are ranked by the total order "larger value first, lower index first among equal values"; the best
entry of a row under that order is what ``reference.argmax`` returns. top_n finds its j-th entry as the best entry
that ranks strictly after the (j-1)-th one, so both kernels need one operation, written here once::

    best = (-inf, NO_INDEX)                       # the identity: ranks after every real entry
    for i in range(vocab):
        v = x[r, i]
        if (prev is None or ranks_after(v, i, *prev)) and better(v, i, *best):
            best = (v, i)

``better`` is commutative and associative (it is the maximum of a total order), so lanes, tails and threads may be
merged in any order. A value of -inf still beats the identity (its index is lower than NO_INDEX), so a row of only
-inf selects index 0; ``NO_INDEX`` comes out only when nothing is left to select (vocab == 0, or top_n asked for more
entries than the row has). NaN compares false both ways and is never selected (logits are never NaN).

TVMScript macros expand this inside the kernels' loop nests (argmax, top_n, and sample_from_logits' top-n):

- ``row_best_cpu``: CPU_WIDTH (4 x 16) per-lane partials updated branch-free in a vectorised loop that visits the row
  in chunks from the last to the first (so one ``>=`` compare keeps the lowest index of equal values), with a single
  compare for top_n's eligibility on every chunk but the one holding the previous pick; then a lane merge and a scalar
  tail.
- ``row_best_gpu``: threads striding over the row (read through a value callable), then two one-value block
  all-reduces (the largest value, then the lowest index holding it).
- ``row_top_cpu``: top_n's first ``count`` entries of a row from block maxima and a short list of the only entries
  that can be selected (``row_best_cpu`` rounds over the row when the list would overflow).
- ``row_top_gpu``: top_n's rounds of ``row_best_gpu``, the previous pick kept apart, thread 0 writing.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script import tirx as T

from ._common import CPU_LANES, neg_inf, pos_inf
from ._reductions import GPU_UNROLL

#: Index of the identity entry: larger than every token id, so any real entry of equal value beats it.
NO_INDEX = 2**31 - 1

#: Lanes of the CPU scan: CPU_ACCUMULATORS independent vector registers of CPU_LANES each, so that the compare-select
#: chains of successive chunks overlap instead of waiting on each other.
CPU_ACCUMULATORS = 4
CPU_WIDTH = CPU_LANES * CPU_ACCUMULATORS

#: Entries per block of ``row_top_cpu``'s block maxima, and the capacity of its list of candidates: at most
#: (count - 1) blocks hold entries above the threshold, so the list holds every candidate for count <= 32.
TOP_BLOCK = 256
TOP_LIST = 8192

def out_index(best_i: tirx.PrimExpr) -> tirx.PrimExpr:
    """The index written out for a selected entry: -1 where nothing was left to select (``NO_INDEX``)."""
    return T.Select(best_i == NO_INDEX, T.int32(-1), best_i)


def better(v: tirx.PrimExpr, i: tirx.PrimExpr, best_v: tirx.PrimExpr, best_i: tirx.PrimExpr) -> tirx.PrimExpr:
    """(v, i) ranks before (best_v, best_i): a larger value, or an equal value and a lower index."""
    return T.Or(v > best_v, T.And(v == best_v, i < best_i))


def ranks_after(v: tirx.PrimExpr, i: tirx.PrimExpr, prev_v: tirx.PrimExpr, prev_i: tirx.PrimExpr) -> tirx.PrimExpr:
    """(v, i) ranks strictly after (prev_v, prev_i): a smaller value, or an equal value and a higher index."""
    return T.Or(v < prev_v, T.And(v == prev_v, i > prev_i))


def _max_reducer() -> tirx.CommReducer:
    """float32 maximum with identity -inf (for the block reduction of the values)."""
    return T.comm_reducer(lambda a, b: T.max(a, b), [neg_inf()])


def _min_reducer() -> tirx.CommReducer:
    """int32 minimum with identity NO_INDEX (for the block reduction of the indices)."""
    return T.comm_reducer(lambda a, b: T.min(a, b), [T.int32(NO_INDEX)])


def _eligible(mode: str, v: tirx.PrimExpr, i: tirx.PrimExpr, prev_v: tirx.PrimExpr | None,
              prev_i: tirx.PrimExpr | None) -> tirx.PrimExpr:
    """Whether (v, i) may be selected, for a stretch of indices whose position relative to prev_i is known.

    ``all``: no previous pick (argmax). ``before``: every index of the stretch is below prev_i, so ranking after the
    previous pick means ``v < prev_v``. ``after``: every index is above prev_i, so it means ``v <= prev_v``. ``any``:
    the stretch may hold prev_i itself: the full ``ranks_after`` rule.
    """
    if mode == "all":
        return T.bool(True)
    if mode == "before":
        return v < prev_v
    if mode == "after":
        return v <= prev_v
    return ranks_after(v, i, prev_v, prev_i)


@T.macro
def _scan_chunk_cpu(x: tirx.Buffer, r: tirx.PrimExpr, c: tirx.PrimExpr, mode: str, prev_v: tirx.PrimExpr | None,
                    prev_i: tirx.PrimExpr | None, lane_v: tirx.Buffer, lane_i: tirx.Buffer, lane_take: tirx.Buffer):
    """Fold the CPU_WIDTH entries of chunk c of row r into the per-lane partials.

    Chunks are visited from the last to the first, so ``v >= lane_v`` (one compare) leaves each lane holding the lowest
    index of its largest eligible value, and an eligible -inf still replaces the identity (-inf, NO_INDEX).
    """
    for a in T.unroll(CPU_ACCUMULATORS):
        for lane in T.vectorized(CPU_LANES):
            lane_take[a * CPU_LANES + lane] = T.Cast("int8", T.And(
                _eligible(mode, x[r, c * CPU_WIDTH + a * CPU_LANES + lane], c * CPU_WIDTH + a * CPU_LANES + lane,
                          prev_v, prev_i),
                x[r, c * CPU_WIDTH + a * CPU_LANES + lane] >= lane_v[a * CPU_LANES + lane]))
            lane_v[a * CPU_LANES + lane] = T.Select(lane_take[a * CPU_LANES + lane] != T.int8(0),
                                                    x[r, c * CPU_WIDTH + a * CPU_LANES + lane],
                                                    lane_v[a * CPU_LANES + lane])
            lane_i[a * CPU_LANES + lane] = T.Select(lane_take[a * CPU_LANES + lane] != T.int8(0),
                                                    c * CPU_WIDTH + a * CPU_LANES + lane,
                                                    lane_i[a * CPU_LANES + lane])


@T.macro
def row_best_cpu(x: tirx.Buffer, r: tirx.PrimExpr, vocab: tirx.PrimExpr, prev_v: tirx.PrimExpr | None,
                 prev_i: tirx.PrimExpr | None, lane_v: tirx.Buffer, lane_i: tirx.Buffer, lane_take: tirx.Buffer,
                 best_v: tirx.Buffer, best_i: tirx.Buffer):
    """best_v[0], best_i[0] = the best entry of x[r, :vocab] (ranking after (prev_v, prev_i) unless those are None).

    lane_v / lane_i / lane_take: local scratch of CPU_WIDTH float32 / int32 / int8 (the per-lane partials and the
    update mask: a vector boolean can be neither bound with T.let nor stored in a bool buffer in this TVM).
    Full chunks of CPU_WIDTH entries are scanned backwards with branch-free vector selects; with a previous pick the
    chunks above and below the one holding prev_i need a single compare for eligibility (see ``_eligible``). The lanes
    are then merged and the vocab % CPU_WIDTH tail is scanned with the full rules.
    """
    for lane in T.vectorized(CPU_WIDTH):
        lane_v[lane] = neg_inf()
        lane_i[lane] = NO_INDEX
    if prev_v is None:
        for c in range(vocab // CPU_WIDTH):
            _scan_chunk_cpu(x, r, vocab // CPU_WIDTH - 1 - c, "all", prev_v, prev_i, lane_v, lane_i, lane_take)
    else:
        # The chunk holding prev_i (-1 before the first round, vocab // CPU_WIDTH when it lies in the tail).
        pc: T.let = T.min(T.max(T.floordiv(prev_i, CPU_WIDTH), -1), vocab // CPU_WIDTH)
        for c in range(vocab // CPU_WIDTH - 1 - pc):
            _scan_chunk_cpu(x, r, vocab // CPU_WIDTH - 1 - c, "after", prev_v, prev_i, lane_v, lane_i, lane_take)
        if pc >= 0 and pc < vocab // CPU_WIDTH:
            _scan_chunk_cpu(x, r, pc, "any", prev_v, prev_i, lane_v, lane_i, lane_take)
        for c in range(T.max(pc, 0)):
            _scan_chunk_cpu(x, r, pc - 1 - c, "before", prev_v, prev_i, lane_v, lane_i, lane_take)
    best_v[0] = neg_inf()
    best_i[0] = NO_INDEX
    for lane in range(CPU_WIDTH):
        if better(lane_v[lane], lane_i[lane], best_v[0], best_i[0]):
            best_v[0] = lane_v[lane]
            best_i[0] = lane_i[lane]
    for t in range(vocab % CPU_WIDTH):
        if T.And(_eligible("all" if prev_v is None else "any", x[r, vocab // CPU_WIDTH * CPU_WIDTH + t],
                           vocab // CPU_WIDTH * CPU_WIDTH + t, prev_v, prev_i),
                 better(x[r, vocab // CPU_WIDTH * CPU_WIDTH + t], vocab // CPU_WIDTH * CPU_WIDTH + t, best_v[0],
                        best_i[0])):
            best_v[0] = x[r, vocab // CPU_WIDTH * CPU_WIDTH + t]
            best_i[0] = vocab // CPU_WIDTH * CPU_WIDTH + t


@T.macro
def _pick_gpu(value, i, prev_v, prev_i, lane_v, lane_i, xs, u):
    """Partial u of a GPU selection takes entry i where it is eligible and better (selects, no branch). The value
    goes through the local xs[u] (a register), not a ``T.let``: TVM's LLVM code generator (ROCm) simplifies each
    bound value again with the earlier ones substituted (docs/kernels.md, Build time)."""
    xs[u] = value(i)
    take: T.let = T.And(_eligible("all" if prev_v is None else "any", xs[u], i, prev_v, prev_i),
                        better(xs[u], i, lane_v[u], lane_i[u]))
    lane_v[u] = T.Select(take, xs[u], lane_v[u])
    lane_i[u] = T.Select(take, i, lane_i[u])


@T.macro
def row_best_gpu(value: Callable[[tirx.PrimExpr], tirx.PrimExpr], vocab: tirx.PrimExpr, prev_v: tirx.PrimExpr | None,
                 prev_i: tirx.PrimExpr | None, tx: tirx.Var, threads: int, part_v: tirx.Buffer, part_i: tirx.Buffer,
                 best_v: tirx.Buffer, best_i: tirx.Buffer):
    """best_v[0], best_i[0] = the best entry of value(0 .. vocab - 1) (e.g. ``row_of(x, r)``), in every thread.

    tx: the threadIdx.x variable (``threads`` threads); part_v / part_i: local (1,) scratch for the thread partials;
    best_v / best_i: local (1,) results, which TVM's lowering replaces by shared memory: read them after the call,
    never before it in a loop (keep a previous pick in other buffers). Each thread scans indices tx, tx + threads, ...
    then the block combines the partials with all-reduces (barriers are placed by TVM's lowering, outside any ``if``).
    """
    lane_v = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
    lane_i = T.alloc_buffer((GPU_UNROLL,), "int32", scope="local")
    xs = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
    for u in T.unroll(GPU_UNROLL):
        lane_v[u] = neg_inf()
        lane_i[u] = NO_INDEX
    # GPU_UNROLL partials per thread (independent loads, as gpu_row_fold; branch-free updates), combined in the same
    # order of preference; the last step checks bounds
    span = threads * GPU_UNROLL
    for k in range(vocab // span):
        for u in T.unroll(GPU_UNROLL):
            _pick_gpu(value, (k * GPU_UNROLL + u) * threads + tx, prev_v, prev_i, lane_v, lane_i, xs, u)
    for u in T.unroll(GPU_UNROLL):
        if vocab // span * span + u * threads + tx < vocab:
            _pick_gpu(value, vocab // span * span + u * threads + tx, prev_v, prev_i, lane_v, lane_i, xs, u)
    part_v[0] = lane_v[0]
    part_i[0] = lane_i[0]
    for u in T.unroll(1, GPU_UNROLL):
        if better(lane_v[u], lane_i[u], part_v[0], part_i[0]):
            part_v[0] = lane_v[u]
            part_i[0] = lane_i[u]
    # Two one-value all-reduces: the largest value, then the lowest index among the threads holding it. (A two-value
    # comm_reducer is not safe here: TVM 0.27 lowers its combine as one store per value, in order, and the later
    # stores read the values already overwritten by the earlier ones.)
    with T.attr(_max_reducer(), "reduce_scope", T.reinterpret("handle", T.uint64(0))):
        T.tvm_thread_allreduce(T.uint32(1), part_v[0], True, best_v[0], tx, dtype="void")
    with T.attr(_min_reducer(), "reduce_scope", T.reinterpret("handle", T.uint64(0))):
        T.tvm_thread_allreduce(T.uint32(1), T.Select(part_v[0] == best_v[0], part_i[0], NO_INDEX), True, best_i[0],
                               tx, dtype="void")


@T.macro
def row_top_cpu(x: tirx.Buffer, r: tirx.PrimExpr, vocab: tirx.PrimExpr, count: tirx.PrimExpr, values: tirx.Buffer,
                indices: tirx.Buffer, out_r: tirx.PrimExpr):
    """values[out_r, j], indices[out_r, j] for j < count: top_n's first ``count`` entries of x[r, :vocab].

    Rather than ``count`` passes over the row: the maximum of each block of TOP_BLOCK entries (one vector pass), then
    t = the count-th largest block maximum (an insertion into a sorted list of ``count``); at least ``count`` entries
    are >= t, so every selected entry is. A scan of the blocks that can hold one lists, in index order, every entry
    above t and the first ``count`` equal to t (ties go to lower indices, so no later one can be selected); the
    rounds then run on that list. The list cannot overflow for count <= 32; if it would, the rounds scan the row
    (``row_best_cpu``). The result is exactly that of ``count`` rounds over the row.
    """
    if count > 0:  # (a zero-width output: nothing to select, nothing read)
        nb: T.let = (vocab + TOP_BLOCK - 1) // TOP_BLOCK
        bmax = T.alloc_buffer((vocab // TOP_BLOCK + 1,), "float32", scope="global")
        tops = T.alloc_buffer((count,), "float32", scope="global")
        list_v = T.alloc_buffer((TOP_LIST,), "float32", scope="global")
        list_i = T.alloc_buffer((TOP_LIST,), "int32", scope="global")
        lanes = T.alloc_buffer((CPU_LANES,), "float32", scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        st = T.alloc_buffer((3,), "int32", scope="local")
        best_v = T.alloc_buffer((1,), "float32", scope="local")
        best_i = T.alloc_buffer((1,), "int32", scope="local")
        # the block maxima
        for b in range(vocab // TOP_BLOCK):
            for lane in T.vectorized(CPU_LANES):
                lanes[lane] = x[r, b * TOP_BLOCK + lane]
            for k in range(1, TOP_BLOCK // CPU_LANES):
                for lane in T.vectorized(CPU_LANES):
                    lanes[lane] = T.max(lanes[lane], x[r, b * TOP_BLOCK + k * CPU_LANES + lane])
            acc[0] = lanes[0]
            for lane in range(1, CPU_LANES):
                acc[0] = T.max(acc[0], lanes[lane])
            bmax[b] = acc[0]
        if vocab % TOP_BLOCK > 0:
            acc[0] = neg_inf()
            for i in range(vocab % TOP_BLOCK):
                acc[0] = T.max(acc[0], x[r, vocab // TOP_BLOCK * TOP_BLOCK + i])
            bmax[nb - 1] = acc[0]
        # t: the count-th largest block maximum (-inf when there are fewer blocks)
        st[0] = 0
        for b in range(nb):
            if st[0] < count or bmax[b] > tops[count - 1]:
                st[1] = T.min(st[0], count - 1)
                while st[1] > 0 and tops[T.max(st[1] - 1, 0)] < bmax[b]:
                    tops[st[1]] = tops[st[1] - 1]
                    st[1] = st[1] - 1
                tops[st[1]] = bmax[b]
                st[0] = T.min(st[0] + 1, count)
        t: T.let = T.Select(st[0] == count, tops[count - 1], neg_inf())
        # the candidates, in index order: st[1] listed (may pass TOP_LIST: overflow), st[2] of them equal to t
        st[1] = 0
        st[2] = 0
        for b in range(nb):
            if bmax[b] > t or (bmax[b] == t and st[2] < count):
                for i in range(T.min(TOP_BLOCK, vocab - b * TOP_BLOCK)):
                    if x[r, b * TOP_BLOCK + i] > t or (x[r, b * TOP_BLOCK + i] == t and st[2] < count):
                        if st[1] < TOP_LIST:
                            list_v[st[1]] = x[r, b * TOP_BLOCK + i]
                            list_i[st[1]] = b * TOP_BLOCK + i
                        st[1] = st[1] + 1
                        if x[r, b * TOP_BLOCK + i] == t:
                            st[2] = st[2] + 1
        best_v[0] = pos_inf()
        best_i[0] = -1
        if st[1] <= TOP_LIST:
            for j in range(count):
                prev_v: T.let = best_v[0]
                prev_i: T.let = best_i[0]
                best_v[0] = neg_inf()
                best_i[0] = NO_INDEX
                for k in range(st[1]):
                    if T.And(ranks_after(list_v[k], list_i[k], prev_v, prev_i),
                             better(list_v[k], list_i[k], best_v[0], best_i[0])):
                        best_v[0] = list_v[k]
                        best_i[0] = list_i[k]
                values[out_r, j] = best_v[0]
                indices[out_r, j] = out_index(best_i[0])
        else:
            lane_v = T.alloc_buffer((CPU_WIDTH,), "float32", scope="local")
            lane_i = T.alloc_buffer((CPU_WIDTH,), "int32", scope="local")
            lane_take = T.alloc_buffer((CPU_WIDTH,), "int8", scope="local")
            for j in range(count):
                prev_v: T.let = best_v[0]
                prev_i: T.let = best_i[0]
                row_best_cpu(x, r, vocab, prev_v, prev_i, lane_v, lane_i, lane_take, best_v, best_i)
                values[out_r, j] = best_v[0]
                indices[out_r, j] = out_index(best_i[0])


#: The most entries a GPU top-n takes in one pass over the row (each thread keeps its best GPU_TOP_LOCAL entries);
#: more take one pass per entry.
GPU_TOP_LOCAL = 8


@T.macro
def _insert_local(x, i, lv, li):
    """Entry (x, i) into a thread's list of its best GPU_TOP_LOCAL entries, in order (selects, no inner branch)."""
    if better(x, i, lv[GPU_TOP_LOCAL - 1], li[GPU_TOP_LOCAL - 1]):
        for d in T.unroll(GPU_TOP_LOCAL - 1):  # positions GPU_TOP_LOCAL - 1 down to 1
            above: T.let = better(x, i, lv[GPU_TOP_LOCAL - 2 - d], li[GPU_TOP_LOCAL - 2 - d])
            here: T.let = better(x, i, lv[GPU_TOP_LOCAL - 1 - d], li[GPU_TOP_LOCAL - 1 - d])
            lv[GPU_TOP_LOCAL - 1 - d] = T.Select(above, lv[GPU_TOP_LOCAL - 2 - d],
                                                 T.Select(here, x, lv[GPU_TOP_LOCAL - 1 - d]))
            li[GPU_TOP_LOCAL - 1 - d] = T.Select(above, li[GPU_TOP_LOCAL - 2 - d],
                                                 T.Select(here, i, li[GPU_TOP_LOCAL - 1 - d]))
        if better(x, i, lv[0], li[0]):
            lv[0] = x
            li[0] = i


@T.macro
def _row_top_gpu_local(value, vocab, rounds, count, tx, threads, values, indices, out_r, prev_v, prev_i):
    """The first min(rounds, GPU_TOP_LOCAL) rounds of row_top_gpu (the last pick left in prev_v / prev_i): each
    thread keeps its best GPU_TOP_LOCAL entries (value descending,
    then index ascending) in one pass over its elements, without barriers; then the merges: the best of the threads'
    heads by two all-reduces, whose thread moves to its next entry. An entry among the row's first GPU_TOP_LOCAL is
    among its own thread's, so the lists hold them all."""
    lv = T.alloc_buffer((GPU_TOP_LOCAL,), "float32", scope="local")
    li = T.alloc_buffer((GPU_TOP_LOCAL,), "int32", scope="local")
    xs = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
    head = T.alloc_buffer((1,), "int32", scope="local")
    cand_v = T.alloc_buffer((1,), "float32", scope="local")
    cand_i = T.alloc_buffer((1,), "int32", scope="local")
    # results of this macro's own all-reduces (TVM's lowering rewrites a result buffer per all-reduce site)
    best_v = T.alloc_buffer((1,), "float32", scope="local")
    best_i = T.alloc_buffer((1,), "int32", scope="local")
    for k in T.unroll(GPU_TOP_LOCAL):
        lv[k] = neg_inf()
        li[k] = NO_INDEX
    if count > 0:
        # GPU_UNROLL values a step, their loads issued together (one load at a time left the pass latency-bound),
        # then inserted one by one (the insertion order does not matter: ``better`` is a total order)
        span = threads * GPU_UNROLL
        for k in range((vocab + span - 1) // span):
            for u in T.unroll(GPU_UNROLL):
                xs[u] = T.if_then_else((k * GPU_UNROLL + u) * threads + tx < vocab,
                                       value(T.min((k * GPU_UNROLL + u) * threads + tx, vocab - 1)), neg_inf())
            for u in T.unroll(GPU_UNROLL):
                if (k * GPU_UNROLL + u) * threads + tx < vocab:
                    _insert_local(xs[u], (k * GPU_UNROLL + u) * threads + tx, lv, li)
    head[0] = 0
    for j in range(T.min(rounds, GPU_TOP_LOCAL)):
        cand_v[0] = T.Select(head[0] < GPU_TOP_LOCAL, lv[T.min(head[0], GPU_TOP_LOCAL - 1)], neg_inf())
        cand_i[0] = T.Select(head[0] < GPU_TOP_LOCAL, li[T.min(head[0], GPU_TOP_LOCAL - 1)], NO_INDEX)
        with T.attr(_max_reducer(), "reduce_scope", T.reinterpret("handle", T.uint64(0))):
            T.tvm_thread_allreduce(T.uint32(1), cand_v[0], True, best_v[0], tx, dtype="void")
        with T.attr(_min_reducer(), "reduce_scope", T.reinterpret("handle", T.uint64(0))):
            T.tvm_thread_allreduce(T.uint32(1), T.Select(cand_v[0] == best_v[0], cand_i[0], NO_INDEX), True,
                                   best_i[0], tx, dtype="void")
        prev_v[0] = best_v[0]
        prev_i[0] = best_i[0]
        if cand_i[0] == prev_i[0] and cand_i[0] != NO_INDEX:
            head[0] = head[0] + 1
        if tx == 0 and j < count:
            values[out_r, j] = prev_v[0]
            indices[out_r, j] = out_index(prev_i[0])


@T.macro
def row_top_gpu(value: Callable[[tirx.PrimExpr], tirx.PrimExpr], vocab: tirx.PrimExpr, rounds: tirx.PrimExpr,
                count: tirx.PrimExpr, tx: tirx.Var, threads: int, values: tirx.Buffer, indices: tirx.Buffer,
                out_r: tirx.PrimExpr):
    """values[out_r, j], indices[out_r, j] for j < count: top_n's entries of value(0 .. vocab - 1), one block.

    The first GPU_TOP_LOCAL rounds (``_row_top_gpu_local``): one pass over the row, then merges of the threads' own
    lists; each round after those is one ``row_best_gpu`` pass. ``rounds`` (>= count, the same in every thread)
    rounds run; those past ``count`` only keep the barriers in uniform control flow (WGSL). Every thread holds the
    previous pick (the all-reduce result), so all scan the same eligibility; the all-reduce result buffers are
    rewritten by TVM's lowering, so the previous pick lives apart. Thread 0 writes.
    """
    part_v = T.alloc_buffer((1,), "float32", scope="local")
    part_i = T.alloc_buffer((1,), "int32", scope="local")
    best_v = T.alloc_buffer((1,), "float32", scope="local")
    best_i = T.alloc_buffer((1,), "int32", scope="local")
    prev_v = T.alloc_buffer((1,), "float32", scope="local")
    prev_i = T.alloc_buffer((1,), "int32", scope="local")
    prev_v[0] = pos_inf()
    prev_i[0] = -1
    _row_top_gpu_local(value, vocab, rounds, count, tx, threads, values, indices, out_r, prev_v, prev_i)
    for j in range(T.max(rounds - GPU_TOP_LOCAL, 0)):
        row_best_gpu(value, vocab, prev_v[0], prev_i[0], tx, threads, part_v, part_i, best_v, best_i)
        prev_v[0] = best_v[0]
        prev_i[0] = best_i[0]
        if tx == 0 and j + GPU_TOP_LOCAL < count:
            values[out_r, j + GPU_TOP_LOCAL] = best_v[0]
            indices[out_r, j + GPU_TOP_LOCAL] = out_index(best_i[0])
