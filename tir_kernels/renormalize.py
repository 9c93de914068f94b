# fmt: off
"""renormalize_probs: min-p, top-k and top-p filtering of probabilities, then rescaling of the kept ones.

Operation, with probs float32 ``[batch, vocab]`` (non-negative), top_k int32 ``[batch]``, top_p, min_p float32
``[batch]`` and out float32 ``[batch, vocab]`` (the numpy definition is ``reference.renormalize``)::

    for r in range(batch):
        p = probs[r]
        keep = p > 0                                          # a row of zeros stays zeros
        if min_p[r] > 0:                                      # 0 = off
            keep &= p >= float32(min_p[r] * max(p))
        if 0 < top_k[r] < vocab:                              # <= 0 or >= vocab = off
            keep &= p >= kth_largest(p[keep], top_k[r])       # ties at the k-th value are kept
        if top_p[r] < 1:                                      # 1 = off
            q = p[keep]
            keep &= p >= max(t in q with sum(q[q >= t]) >= top_p[r] * sum(q))   # ties together
        out[r] = where(keep, p / sum(p[keep]), 0)

Top-p keeps the smallest set of largest values whose mass reaches ``top_p * mass``, equal values together: the
threshold is the largest kept value t with ``G(t) = sum(kept p where p >= t) >= top_p * mass``, which in exact
arithmetic is the reference's "drop values while the ascending cumulative sum is <= (1 - top_p) * mass". The largest
value always stays (top_p <= 0 keeps exactly the values equal to the maximum). The kernel sums in float32 (the
reference in float64): a value whose cumulative mass lies within rounding of the budget may go either way.

How, without sorting: every filter leaves a set of the form ``p >= t``. For non-negative float32 values the int32
bit pattern is monotone in the value, so each threshold is found by bisection over bit patterns ``[lo, hi)`` with
the invariant ``f(lo) >= goal > f(hi)``, f = count (top-k) or G (top-p). One pass over the row per step counts (or
sums) the values at or above the midpoint and also finds the nearest data values on both sides of it, so that the
interval snaps to data values: each step at least halves it (<= 31 steps per filter), and far fewer are needed where
the values near the threshold are sparse (top-k with a small k, top-p after top-k). Per row: one read pass (max,
count, sum), the top-k steps, at most one pass for the kept sum, the top-p steps, one scaling pass: <= 68 passes,
typically 5-15. A row whose filters are all off costs the read pass and the scaling pass.

CPU: each pass is a branch-free vector loop over the row (hot in L2 after the first pass), 64 values a step, with
partials in 32 lanes (two values per lane and step: four accumulators of 64 lanes spill out of the 16 AVX2
registers). The first pass sums the row as is (for non-negative values, the sum of those with bits >= 1) and also
records the maximum of each block of 256 values (up to 1024 blocks) and of each of its 32 lanes (8 values: the group
maxima). Then, before any threshold pass, the row is usually reduced to a
candidate list: the values >= lb, a lower bound of the final threshold, in index order (a branch-free scalar copy
that reads only the blocks, and the lanes of 8 values in them, holding such a value), used when it has at most 8192
values. lb is the k-th largest block maximum with top-k, with top-p alone a group maximum t whose group maxima >= t
alone reach the top-p goal (they bound G(t) from below; searched over the block maxima, then over the group maxima of
the blocks reaching the midpoint, first probed 12 binades below the row maximum, to within half a binade), the min-p
threshold with min-p alone; the top-p bound is checked on the list (G(lb) >= goal) and the row passes are used where
it fails. Every count, sum, minimum and
maximum that the searches below need is then a pass over the short list instead of the row (the same values, so the
same threshold; sums in list order). Without the list (long lists: flat distributions, top_p near 1), later passes
skip the blocks whose maximum is below the midpoint, and top-k first bisects over the block maxima (the k-th largest
block maximum is a lower bound of the k-th largest value), so that its steps only read the < k blocks that can hold
the top k.
CPU top-p probes better points than the midpoint, since any point of ``(lo, hi)`` keeps the invariant: the first is
the largest block maximum t whose block maxima alone reach the goal (their sum bounds G(t) from below, so t lies
just under the threshold when the kept values are few; found over the block maxima, without reading the row); the
others interpolate G linearly between the interval's ends in the coordinate value**(1/4), projected (as in the ITP
method) close enough to the midpoint that the interval is at most 2**34 / 2**k wide after k steps: <= 34 steps
whatever the data. Each step is the same exact pass, so the threshold found (the largest data value with G >= goal,
G as this kernel sums it) is the one bisection finds: on softmaxes of Gaussian logits (top_p 0.5-0.95, vocab 128256)
2.4-7.6 top-p passes on average instead of 6.9-19 (with and without top-k).
GPU: the passes over whole rows are split over blocks (``_threshold_split``: each block one chunk of SPLIT_CHUNK
values, partials in workspaces, combined per row in chunk order): the first pass (count, sum and maximum of the
positive values), the bound pass (count and sum at or above GPU_PIVOTS pivots: the min-p threshold and 1, 2, 4 and 8
binades below the maximum), and the copy of the values at or above lb, a lower bound of the final threshold (the
highest pivot holding k values with top-k, or whose values alone reach top_p of the mass at or above the min-p
threshold with top-p alone, else the min-p threshold), into the row's candidate list in a workspace, in index order,
where they fit (``gpu_list_capacity``: 4 per thread of the search's block on CUDA, 4096 values). Then one block per
row (``gpu_row_threshold``) loads the list into shared memory and runs every search step and the kept sum on it
(every thread holding the same search state, each count, sum, minimum and maximum ending with a block reduction);
rows whose list would overflow (flat rows, top_p near 1) bisect over the row in that block. The bound pass's sums
give the kept mass after min-p and top-p's starting point. The rescaling is the last kernel, each row split over
blocks of SPLIT_THREADS (``_reductions.split_map``), the row's threshold and kept sum passed through workspaces.
CUDA, ROCm and Metal bisect in while loops; WGSL runs a fixed 31 steps per bisection (idle, without reading the row,
once converged) because its uniformity analysis only allows barriers in uniform control flow. Sums of subnormal
values assume no flush-to-zero (Metal flushes: rows whose whole mass is subnormal are not supported there). The
list's sums are in another order than the row's (the same kept set, within float32 rounding of the budget).

The per-row work is written once as TVMScript macros reading the row through ``value(i)`` (``cpu_row_macros``,
``gpu_row_threshold``): this kernel passes ``probs[r, i]``; ``sample_from_logits`` passes the probability it computes,
so that both find the same threshold.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi
from ._common import CALLER_ARRAY_ALIGN, CPU_LANES, is_cpu, max_threads
from ._reductions import GPU_UNROLL, SPLIT_THREADS, row_of, split_map, split_parts
from ._threshold_split import (
    F_MASS,
    F_SUM0,
    F_SUMLB,
    I_COUNT,
    I_EXACT,
    I_JLB,
    I_LB,
    I_LIST,
    I_LO,
    I_MAX,
    I_PIVOT,
    I_TOPK,
    I_TOPP,
    ROW_FLOATS,
    ROW_INTS,
    split_threshold_passes,
)

NAME = kernel_abi.RENORMALIZE

_INT_MAX = 2147483647
_INT_MIN = -2147483647  # not -2**31: WGSL has no literal for it
#: Values per step of the CPU passes: four AVX-512 registers, so that four accumulations run side by side.
_CPU_WIDTH = 4 * CPU_LANES
#: The CPU passes split a row into at most this many blocks of whole steps (at least 4 steps, 256 values, each) and
#: remember each block's largest value: a pass skips every block whose maximum is below its threshold. Blocks also
#: bound float32 sums: each block is summed on its own, then added to the row's partial sums.
_MAX_BLOCKS = 1024
#: Size of the block-maxima scratch (``bmax``) that the CPU row macros take.
CPU_MAX_BLOCKS = _MAX_BLOCKS
_MIN_BLOCK_STEPS = 4
#: The CPU passes run on a list of candidates (the values at or above a lower bound of the threshold, found from the
#: block maxima) when it holds at most this many values and comes from at most half of the blocks.
_LIST_CAP = 8192
#: The top-p list bound's search over the group maxima stops once its interval is at most this many bit patterns wide
#: (2**22: half a binade).
_BOUND_BITS = 1 << 22
#: ... and probes first this many bit patterns below the row's largest value (12 binades, a factor 4096), unless the
#: midpoint is higher: the bound usually lies there, and probes lower down read nearly every block.
_BOUND_FIRST_REACH = 12 << 23
#: Size of the candidate scratch (``cand``) that the CPU row macros take.
CPU_LIST_SIZE = _LIST_CAP + _CPU_WIDTH
#: Size of the group-maxima scratch (``gmax``: the largest bits of each lane of each block) the CPU row macros take.
CPU_GROUPS = _MAX_BLOCKS * _CPU_WIDTH // 2


#: Size of the GPU state (``st``) the callers of ``gpu_row_threshold`` allocate.
GPU_STATE = 8
#: Candidates per thread the GPU list holds in shared memory, by target kind: CUDA's reductions use warp shuffles,
#: the others a block-sized tree of four arrays, and Metal has 32 KB of threadgroup memory.
_LIST_PER_THREAD = {"cuda": 4.0, "rocm": 2.0, "webgpu": 2.0, "vulkan": 2.0, "opencl": 2.0, "metal": 0.25}


def gpu_list_capacity(target: tvm.target.Target, threads: int) -> int:
    """Entries of the GPU threshold search's candidate list in shared memory on ``target``."""
    return int(_LIST_PER_THREAD[target.kind.name] * threads)


def _from_list(use: tirx.PrimExpr, lst: tirx.Buffer, cap: int,
               value: Callable[[tirx.PrimExpr], tirx.PrimExpr]) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """i -> the list's entry i where ``use``, else value(i) (``if_then_else``: CUDA reads only the one it needs)."""
    return lambda i: T.if_then_else(use, lst[T.min(i, cap - 1)], value(i))


def _bits(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """int32 bit pattern of a float32 value (monotone in the value for non-negative floats)."""
    return T.reinterpret("int32", x)


def rescaled(x: tirx.PrimExpr, lo: tirx.PrimExpr, mass: tirx.PrimExpr) -> tirx.PrimExpr:
    """The renormalized value of x where kept (bits >= lo), else 0: ``(x * s) * (1 / (mass * s))``, with s = 2**64
    when mass < 2**-60 (so that 1 / mass neither overflows nor loses digits for subnormal masses), else 1. Products,
    not a quotient (vector division is several times slower); every kernel that renormalizes uses this formula.
    Powers of two are written as bit patterns, which every code generator prints exactly."""
    tiny = mass < T.reinterpret("float32", T.uint32(0x21800000))  # 2**-60
    s = T.Select(tiny, T.reinterpret("float32", T.uint32(0x5F800000)), T.float32(1))  # 2**64
    return T.Select(_bits(x) >= lo, (x * s) * (T.float32(1) / (mass * s)), T.float32(0))


#: ITP bound of the CPU top-p search: the interval [lo, hi) (< 2**31 wide) is at most _ITP_BUDGET / 2**k wide after
#: step k, so the search ends within log2(_ITP_BUDGET) = 34 passes whatever the data (bisection: 31).
_ITP_BUDGET = 2.0**34


def _top_p_guess(lo: tirx.PrimExpr, hi: tirx.PrimExpr, f_lo: tirx.PrimExpr, f_hi: tirx.PrimExpr,
                 half: tirx.PrimExpr) -> tirx.PrimExpr:
    """Bit pattern where the line through (lo, f_lo) and (hi, f_hi) crosses 0, in the coordinate value**(1/4).

    f = G - goal (float64): f_lo >= 0 > f_hi. A fourth root sits between the value (linear interpolation in the value
    suits mass spread evenly over log-values) and the bit pattern (a logarithm: suits mass concentrated at the top),
    and needed the fewest passes on the distributions tried. ``half`` where the line is not defined (top_p <= 0,
    a non-finite end). Only ever a guess: every decision comes from a pass.
    """
    u_lo = T.sqrt(T.sqrt(T.Cast("float64", T.reinterpret("float32", lo))))
    u_hi = T.sqrt(T.sqrt(T.Cast("float64", T.reinterpret("float32", hi))))
    u = u_lo + (u_hi - u_lo) * (f_lo / (f_lo - f_hi))
    guess = _bits(T.Cast("float32", (u * u) * (u * u)))
    return T.Select(tirx.all(f_lo >= T.float64(0), f_hi < T.float64(0), hi < T.int32(0x7F800000)), guess, half)

def cpu_block_steps(nvec: tirx.PrimExpr) -> tirx.PrimExpr:
    """Steps of _CPU_WIDTH values per block of the CPU passes, for a row of ``nvec`` whole steps: block b holds the
    values of steps b * cpu_block_steps(nvec) onwards, and its largest bits are bmax[b] after ``threshold``."""
    return T.max(_MIN_BLOCK_STEPS, (nvec + _MAX_BLOCKS - 1) // _MAX_BLOCKS)


def cpu_row_macros() -> tuple[Callable[..., None], Callable[..., None]]:
    """The CPU row macros: ``threshold`` (every filter of one row, the kept set as bits >= st[0] and its sum in
    ms[0]) and ``scale`` (the last pass). Both read the row through ``value(i)``, so that the fused sampler runs
    them on its own row of probabilities."""
    w = _CPU_WIDTH
    h = w // 2
    int_max, int_min = T.int32(_INT_MAX), T.int32(_INT_MIN)

    @T.macro
    def reduce_lanes(cnt, ssum, mn, mx):
        for l in range(1, w):
            cnt[0] = cnt[0] + cnt[l]
            ssum[0] = ssum[0] + ssum[l]
            mn[0] = T.min(mn[0], mn[l])
            mx[0] = T.max(mx[0], mx[l])

    @T.macro
    def init_lanes(cnt, ssum, mn, mx):
        for l in T.vectorized(w):
            cnt[l] = 0
            ssum[l] = T.float32(0)
            mn[l] = int_max
            mx[l] = int_min

    @T.macro
    def scan(value, vocab, nvec, bv, nblk, bmax, mid, by_sum, cnt, ssum, inner, mn, mx):
        # One pass over row r, skipping the blocks whose maximum is below mid. With by_sum (a Python bool) ssum[0] =
        # the sum of the values with bits >= mid, otherwise cnt[0] = their count; mn[0] = their smallest bits;
        # mx[0] = the largest bits below mid (int_min where none).
        # Partials in w / 2 lanes, each taking the two values of its lane in both halves of a step (as pass 1):
        # with w lanes the four accumulators spill out of the 16 AVX2 registers.
        below: T.let = mid - 1
        init_lanes(cnt, ssum, mn, mx)
        for blk in range(nblk):
            if bmax[blk] > below:
                for l in T.vectorized(h):
                    inner[l] = T.float32(0)
                for j in range(T.min(bv, nvec - blk * bv)):
                    for l in T.vectorized(h):
                        a: T.let = value((blk * bv + j) * w + l)
                        c: T.let = value((blk * bv + j) * w + h + l)
                        ba: T.let = _bits(a)
                        bc: T.let = _bits(c)
                        if by_sum:
                            inner[l] = inner[l] + (T.Select(ba > below, a, T.float32(0))
                                                   + T.Select(bc > below, c, T.float32(0)))
                        else:
                            cnt[l] = cnt[l] + (T.Select(ba > below, 1, 0) + T.Select(bc > below, 1, 0))
                        mn[l] = T.min(mn[l], T.min(T.Select(ba > below, ba, int_max),
                                                   T.Select(bc > below, bc, int_max)))
                        mx[l] = T.max(mx[l], T.max(T.Select(ba < mid, ba, int_min), T.Select(bc < mid, bc, int_min)))
                if by_sum:
                    for l in T.vectorized(h):
                        ssum[l] = ssum[l] + inner[l]
            else:
                for l in T.vectorized(h):  # whole vectors, so that LLVM can keep mx in registers
                    mx[l] = T.max(mx[l], bmax[blk])
        for t in range(vocab % w):
            x: T.let = value(nvec * w + t)
            b: T.let = _bits(x)
            cnt[0] = T.Select(b >= mid, cnt[0] + 1, cnt[0])
            ssum[0] = T.Select(b >= mid, ssum[0] + x, ssum[0])
            mn[0] = T.Select(b >= mid, T.min(mn[0], b), mn[0])
            mx[0] = T.Select(b < mid, T.max(mx[0], b), mx[0])
        reduce_lanes(cnt, ssum, mn, mx)

    @T.macro
    def fold_bits(l, bits, mid, by_sum, cnt, ssum, mn, mx):
        # lane l takes a maximum's bit pattern: its value's sum (by_sum) or a count where >= mid, the smallest bits
        # >= mid, the largest bits below mid
        b: T.let = bits
        if by_sum:
            ssum[l] = T.Select(b >= mid, ssum[l] + T.reinterpret("float32", b), ssum[l])
        else:
            cnt[l] = T.Select(b >= mid, cnt[l] + 1, cnt[l])
        mn[l] = T.Select(b >= mid, T.min(mn[l], b), mn[l])
        mx[l] = T.Select(b < mid, T.max(mx[l], b), mx[l])

    @T.macro
    def scan_blocks(nblk, bmax, mid, by_sum, cnt, ssum, mn, mx):
        # The pass of scan over the block maxima instead of the values (bmax is padded with int_min).
        init_lanes(cnt, ssum, mn, mx)
        for i in range((nblk + w - 1) // w):
            for l in T.vectorized(w):
                fold_bits(l, bmax[i * w + l], mid, by_sum, cnt, ssum, mn, mx)
        reduce_lanes(cnt, ssum, mn, mx)

    @T.macro
    def scan_groups(nblk, bmax, gmax, mid, by_sum, cnt, ssum, mn, mx):
        # scan_blocks over the group maxima (h per block), reading only the blocks whose maximum is >= mid: the
        # others hold no group maximum >= mid, and their largest bits below mid are their block maximum
        init_lanes(cnt, ssum, mn, mx)
        for blk in range(nblk):
            if bmax[blk] >= mid:
                for l in T.vectorized(h):
                    fold_bits(l, gmax[blk * h + l], mid, by_sum, cnt, ssum, mn, mx)
            else:
                for l in T.vectorized(h):
                    mx[l] = T.max(mx[l], bmax[blk])
        reduce_lanes(cnt, ssum, mn, mx)

    @T.macro
    def compact(value, vocab, nvec, bv, nblk, bmax, gmax, lb, cand, cidx, hit, lanes, st):
        # cand[0 .. st[8]) = the values with bits >= lb, in index order, read only in the blocks whose maximum is
        # >= lb and, inside them, in the lanes whose group maximum is (lanes[0 .. hit[0]), increasing); then zeros
        # up to a whole step. st[8] > _LIST_CAP: the list is incomplete (only the first _LIST_CAP are stored).
        # Branch-free appends (every value is written at the list's end, which moves on only for a kept one): the
        # tests are data-dependent, and as branches they were mispredicted about every other time.
        st[8] = 0
        for blk in range(nblk):
            if bmax[blk] >= lb:
                hit[0] = 0
                for l in range(h):
                    lanes[hit[0]] = l
                    hit[0] = hit[0] + T.Select(gmax[blk * h + l] >= lb, 1, 0)
                hits: T.let = hit[0]
                for j in range(T.min(bv, nvec - blk * bv)):
                    for half in range(2):
                        for e in range(hits):
                            i: T.let = (blk * bv + j) * w + half * h + lanes[e]
                            x: T.let = value(i)
                            at: T.let = T.min(st[8], _LIST_CAP)
                            cand[at] = x
                            if cidx is not None:
                                cidx[at] = i
                            st[8] = st[8] + T.Select(_bits(x) >= lb, 1, 0)
        for t in range(vocab % w):
            x: T.let = value(nvec * w + t)
            at: T.let = T.min(st[8], _LIST_CAP)
            cand[at] = x
            if cidx is not None:
                cidx[at] = nvec * w + t
            st[8] = st[8] + T.Select(_bits(x) >= lb, 1, 0)
        for l in T.vectorized(w):
            cand[T.min(st[8], _LIST_CAP) + l] = T.float32(0)

    @T.macro
    def scan_list(cand, n, mid, by_sum, cnt, ssum, mn, mx):
        # scan's pass over the candidate list (n values, zero-padded to whole steps): the same four results for
        # every mid >= the list's bound, since the list holds every value at or above it.
        below: T.let = mid - 1
        init_lanes(cnt, ssum, mn, mx)
        for j in range(_LIST_CAP // w + 1):  # (a constant extent: TVM hoists loads out of loop bounds)
            if j * w < n:
                for l in T.vectorized(w):
                    x: T.let = cand[j * w + l]
                    b: T.let = _bits(x)
                    if by_sum:
                        ssum[l] = T.Select(b > below, ssum[l] + x, ssum[l])
                    else:
                        cnt[l] = T.Select(b > below, cnt[l] + 1, cnt[l])
                    mn[l] = T.Select(b > below, T.min(mn[l], b), mn[l])
                    mx[l] = T.Select(b < mid, T.max(mx[l], b), mx[l])
        reduce_lanes(cnt, ssum, mn, mx)

    @T.macro
    def scan_any(value, vocab, nvec, bv, nblk, bmax, cand, st, mid, by_sum, cnt, ssum, inner, mn, mx):
        # scan_list where the row has a candidate list (st[7] == 1, st[8] values), else scan
        if st[7] == 1:
            scan_list(cand, st[8], mid, by_sum, cnt, ssum, mn, mx)
        else:
            scan(value, vocab, nvec, bv, nblk, bmax, mid, by_sum, cnt, ssum, inner, mn, mx)

    @T.macro
    def threshold(value, vocab, k, top_p_r, min_p_r, bmax, gmax, cand, cidx, st, ms):
        # The kept set of one row: bits >= st[0]; ms[0] = the sum of the kept values (st[0] = INT_MAX and ms[0] = 1
        # for a row of zeros). k, top_p_r, min_p_r: the row's filters. bmax: int32 scratch of _MAX_BLOCKS, left
        # holding the largest bits of each block (padded with INT_MIN).
        # st: int32 (7,). 0: kept = bits >= st[0]; 1, 2: bisection interval [st[1], st[2]); 3: max bits; 4: ms[0] is
        # the kept sum; 5: top-p first guess; 5, 6: bisection over the block maxima.
        # ms: float32 (2,). 0: sum of the kept values; 1: sum of the values >= st[1] in top-p bisection.
        # Scratch of under 1 KB in "global" scope: TVM puts it on the stack, where LLVM keeps it in registers across
        # loops ("local" buffers of a parallel loop come from the workspace pool and stay in memory).
        cnt = T.alloc_buffer((w,), "int32", scope="global")
        ssum = T.alloc_buffer((w,), "float32", scope="global")
        inner = T.alloc_buffer((w,), "float32", scope="global")
        mn = T.alloc_buffer((w,), "int32", scope="global")
        mx = T.alloc_buffer((w,), "int32", scope="global")
        bl = T.alloc_buffer((w,), "int32", scope="global")  # per-lane largest bits of the current block
        bt = T.alloc_buffer((16,), "int32", scope="global")  # bl's tree of maxima
        # top-p search: 0, 1: G(st[1]) - goal, G(st[2]) - goal; 2: the widest interval allowed after the step
        gf = T.alloc_buffer((3,), "float64", scope="global")
        hit = T.alloc_buffer((2,), "int32", scope="global")
        nvec: T.let = vocab // w
        bv: T.let = cpu_block_steps(nvec)
        nblk: T.let = (nvec + bv - 1) // bv
        # pass 1: sum and maximum of the positive values; block maxima. Partials in w / 2 lanes (each adds the
        # two values of its lane in both halves of a step): fewer registers than w lanes, so none spill on AVX2.
        init_lanes(cnt, ssum, mn, mx)
        for blk in range(nblk):
            for l in T.vectorized(h):
                inner[l] = T.float32(0)
                bl[l] = int_min
            for j in range(T.min(bv, nvec - blk * bv)):
                for l in T.vectorized(h):
                    a: T.let = value((blk * bv + j) * w + l)
                    b: T.let = value((blk * bv + j) * w + h + l)
                    # (the sum of the values with bits >= 1 for non-negative values: adding +0 or -0 changes none)
                    inner[l] = inner[l] + (a + b)
                    bl[l] = T.max(bl[l], T.max(_bits(a), _bits(b)))
            for l in T.vectorized(h):
                ssum[l] = ssum[l] + inner[l]
                mx[l] = T.max(mx[l], bl[l])
                gmax[blk * h + l] = bl[l]
            # the block maximum as a tree of whole-vector maxima (a scalar loop over the lanes made LLVM store the
            # vectors and reload parts of them, a store-forwarding stall every block)
            for l in T.vectorized(16):
                bt[l] = T.max(bl[l], bl[l + 16])
            for l in T.vectorized(8):
                bt[l] = T.max(bt[l], bt[l + 8])
            for l in T.vectorized(4):
                bt[l] = T.max(bt[l], bt[l + 4])
            for l in T.vectorized(2):
                bt[l] = T.max(bt[l], bt[l + 2])
            bmax[blk] = T.max(bt[0], bt[1])
        for i in range(nblk, (nblk + w - 1) // w * w):
            bmax[i] = int_min
        for i in range(nblk * h, (nblk * h + w - 1) // w * w):
            gmax[i] = int_min
        for t in range(vocab % w):
            x: T.let = value(nvec * w + t)
            ssum[0] = T.Select(_bits(x) >= 1, ssum[0] + x, ssum[0])
            mx[0] = T.max(mx[0], _bits(x))
        reduce_lanes(cnt, ssum, mn, mx)
        st[0] = 1
        st[3] = mx[0]
        st[4] = 1
        st[7] = 0
        ms[0] = ssum[0]
        if st[3] >= 1:
            # min-p: the threshold is the float32 product, as in the reference
            if min_p_r > T.float32(0):
                st[0] = T.max(1, _bits(min_p_r * T.reinterpret("float32", st[3])))
                st[4] = 0
            # top-k: the largest t with count(bits >= t) >= k (a data value; ties at it are kept). The k-th
            # largest block maximum is a lower bound (k blocks hold a value >= it): find it first.
            k_on: T.let = k > 0 and k < vocab
            st[1] = st[0]
            st[2] = st[1] + 1
            if k_on:
                st[2] = st[3] + 1
            while st[2] - st[1] > 1:
                mid: T.let = st[1] + (st[2] - st[1]) // 2
                scan_blocks(nblk, bmax, mid, False, cnt, ssum, mn, mx)
                if cnt[0] >= k:
                    st[1] = mn[0]
                else:
                    st[2] = T.max(mx[0] + 1, st[1] + 1)
            # The candidate list: every value >= lb, a lower bound of the final threshold from the block and group
            # maxima (top-k: the k-th largest block maximum; top-p alone: the largest group maximum t whose group
            # maxima >= t alone reach the goal, a lower bound of G(t), checked on the list; min-p: its threshold).
            # Where it is short, the searches below run on it, not on the row.
            p_alone: T.let = not k_on and top_p_r < T.float32(1) and st[4] == 1
            st[5] = st[0]
            st[6] = st[3] + 1
            # first over the block maxima (each is one of its block's group maxima, so the largest t they reach the
            # goal with bounds the group maxima's from below), then over the group maxima of the blocks whose
            # maximum reaches the midpoint
            while p_alone and st[6] - st[5] > 1:
                mid: T.let = st[5] + (st[6] - st[5]) // 2
                scan_blocks(nblk, bmax, mid, True, cnt, ssum, mn, mx)
                if ssum[0] >= top_p_r * ms[0]:
                    st[5] = T.min(mn[0], st[3])  # (no block maximum >= mid when the goal is 0)
                else:
                    st[6] = T.max(mx[0] + 1, st[5] + 1)
            st[6] = st[3] + 1
            st[7] = 1  # the first probe (st[7] is set again below)
            # (a lower bound is all the list needs: stop once the interval is within half a binade, a ratio of at
            # most 1.41 between its ends, instead of closing it)
            while p_alone and st[6] - st[5] > _BOUND_BITS:
                half: T.let = st[5] + (st[6] - st[5]) // 2
                mid: T.let = T.Select(st[7] == 1, T.max(half, st[3] - _BOUND_FIRST_REACH), half)
                st[7] = 0
                scan_groups(nblk, bmax, gmax, mid, True, cnt, ssum, mn, mx)
                if ssum[0] >= top_p_r * ms[0]:
                    st[5] = T.min(mn[0], st[3])
                else:
                    st[6] = T.max(mx[0] + 1, st[5] + 1)
            lb: T.let = T.Select(k_on, st[1], st[5])
            st[7] = 0
            if k_on or top_p_r < T.float32(1) or st[4] == 0:
                # short: few groups (top-p alone) or blocks (otherwise) hold a value >= lb
                if p_alone:
                    scan_groups(nblk, bmax, gmax, lb, False, cnt, ssum, mn, mx)
                else:
                    scan_blocks(nblk, bmax, lb, False, cnt, ssum, mn, mx)
                if (p_alone and cnt[0] * 2 <= _LIST_CAP) or (not p_alone and cnt[0] * 2 <= nblk):
                    compact(value, vocab, nvec, bv, nblk, bmax, gmax, lb, cand, cidx, hit, bl, st)
                    if st[8] <= _LIST_CAP:
                        st[7] = 1
                        st[6] = int_min
                        if p_alone:
                            scan_list(cand, st[8], lb, True, cnt, ssum, mn, mx)
                            st[6] = mn[0]
                            ms[1] = ssum[0]
                            if ssum[0] < top_p_r * ms[0]:
                                st[7] = 0
            # top-k: the largest t with count(bits >= t) >= k, by passes over the list or the row
            if k_on:
                st[2] = st[3] + 1
            while st[2] - st[1] > 1:
                mid: T.let = st[1] + (st[2] - st[1]) // 2
                scan_any(value, vocab, nvec, bv, nblk, bmax, cand, st, mid, False, cnt, ssum, inner, mn, mx)
                if cnt[0] >= k:
                    st[1] = mn[0]
                else:
                    st[2] = T.max(mx[0] + 1, st[1] + 1)
            if st[1] > st[0]:
                st[0] = st[1]
                st[4] = 0
            # top-p: the largest t with sum(kept values with bits >= t) >= top_p * (kept sum)
            st[1] = st[0]
            st[2] = st[3] + 1
            if top_p_r >= T.float32(1):
                st[2] = st[1] + 1
            elif st[4] == 0:
                scan_any(value, vocab, nvec, bv, nblk, bmax, cand, st, st[0], True, cnt, ssum, inner, mn, mx)
                ms[0] = ssum[0]
                st[4] = 1
            goal: T.let = top_p_r * ms[0]
            st[5] = int_min
            if st[7] == 1 and st[6] > st[1]:
                st[1] = st[6]  # top-p alone: G(lb) >= goal was checked on the list, and ms[1] = G(lb)
            else:
                ms[1] = ms[0]  # G(st[1])
            if st[7] == 0:
                # first guess: the largest block maximum t with sum(block maxima >= t) >= goal (a lower bound of
                # G(t), so t is usually just below the threshold); found by bisection over the block maxima
                st[5] = st[1]
                st[6] = st[2]
                while st[6] - st[5] > 1:
                    mid: T.let = st[5] + (st[6] - st[5]) // 2
                    scan_blocks(nblk, bmax, mid, True, cnt, ssum, mn, mx)
                    if ssum[0] >= goal:
                        st[5] = mn[0]
                    else:
                        st[6] = T.max(mx[0] + 1, st[5] + 1)
            # each step evaluates G at one point of (lo, hi) with one pass, as bisection does, but the point is
            # the first guess, then interpolated (_top_p_guess), and kept within the ITP reach of the midpoint
            gf[0] = T.Cast("float64", ms[1]) - T.Cast("float64", goal)  # G(lo) - goal >= 0
            gf[1] = -T.Cast("float64", goal)  # G(max + 1) - goal < 0
            gf[2] = T.float64(_ITP_BUDGET)
            while st[2] - st[1] > 1:
                half: T.let = st[1] + (st[2] - st[1]) // 2
                guess: T.let = T.Select(st[5] > st[1] and st[5] < st[2], st[5],
                                        _top_p_guess(st[1], st[2], gf[0], gf[1], half))
                reach: T.let = T.Cast("int32", T.min(T.max((gf[2] - T.Cast("float64", st[2] - st[1])) * 0.5,
                                                           T.float64(0)), T.float64(_INT_MAX // 2)))
                mid: T.let = half + T.max(T.min(T.max(T.min(guess, st[2] - 1), st[1] + 1) - half, reach), -reach)
                st[5] = int_min
                gf[2] = gf[2] * 0.5
                scan_any(value, vocab, nvec, bv, nblk, bmax, cand, st, mid, True, cnt, ssum, inner, mn, mx)
                if ssum[0] >= goal:
                    st[1] = mn[0]
                    ms[1] = ssum[0]
                    gf[0] = T.Cast("float64", ssum[0]) - T.Cast("float64", goal)
                else:
                    st[2] = T.max(mx[0] + 1, st[1] + 1)
                    gf[1] = T.Cast("float64", ssum[0]) - T.Cast("float64", goal)
            if st[1] > st[0]:
                st[0] = st[1]
                ms[0] = ms[1]
            if st[4] == 0:
                scan_any(value, vocab, nvec, bv, nblk, bmax, cand, st, st[0], True, cnt, ssum, inner, mn, mx)
                ms[0] = ssum[0]
        else:
            st[0] = int_max
            ms[0] = T.float32(1)

    @T.macro
    def scale(value, vocab, lo, mass, out, r):
        # out[r, i] = value(i) / mass where its bits are >= lo, else 0
        nvec: T.let = vocab // w
        for j in range(nvec):
            for l in T.vectorized(w):
                x: T.let = value(j * w + l)
                out[r, j * w + l] = rescaled(x, lo, mass)
        for t in range(vocab % w):
            x: T.let = value(nvec * w + t)
            out[r, nvec * w + t] = rescaled(x, lo, mass)

    return threshold, scale


def _cpu() -> tirx.PrimFunc:
    threshold, scale = cpu_row_macros()

    @T.prim_func
    def renormalize_probs(var_probs: T.handle, var_top_k: T.handle, var_top_p: T.handle, var_min_p: T.handle,
                          var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        probs = T.match_buffer(var_probs, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        top_k = T.match_buffer(var_top_k, (batch,), "int32")
        top_p = T.match_buffer(var_top_p, (batch,), "float32")
        min_p = T.match_buffer(var_min_p, (batch,), "float32")
        out = T.match_buffer(var_out, (batch, vocab), "float32")
        for r in T.parallel(batch):
            bmax = T.alloc_buffer((_MAX_BLOCKS,), "int32", scope="local")
            gmax = T.alloc_buffer((CPU_GROUPS,), "int32", scope="local")
            cand = T.alloc_buffer((CPU_LIST_SIZE,), "float32", scope="local")
            st = T.alloc_buffer((9,), "int32", scope="global")
            ms = T.alloc_buffer((2,), "float32", scope="global")
            threshold(row_of(probs, r), vocab, top_k[r], top_p[r], min_p[r], bmax, gmax, cand, None, st, ms)
            scale(row_of(probs, r), vocab, st[0], ms[0], out, r)
    return renormalize_probs


def gpu_row_threshold(threads: int, uniform_loops: bool, shuffle_reduce: bool, list_cap: int) -> Callable[..., None]:
    """The GPU row macro ``threshold`` (as ``cpu_row_macros``' one), for one block per row.

    ``uniform_loops`` (WGSL): bisections run a fixed 31 steps, idle once converged, so that every barrier sits in
    uniform control flow as WGSL's uniformity analysis demands (Tint enforces it); elsewhere they are while loops that
    stop as soon as the interval closes. ``shuffle_reduce`` (CUDA): block reductions through warp shuffles.
    """
    int_max, int_min = T.int32(_INT_MAX), T.int32(_INT_MIN)
    tree_size = 1 if shuffle_reduce else threads
    log_threads = threads.bit_length() - 1
    assert threads == 1 << log_threads, "the tree reductions need a power-of-two block size"
    @T.macro
    def pair_reduce(tx, acc_i, acc_f, s_i, s_f):
        # block_reduce of the (count, sum) pair alone
        if shuffle_reduce:
            r_i = T.alloc_buffer((1,), "int32", scope="local")
            r_f = T.alloc_buffer((1,), "float32", scope="local")
            with T.attr(T.comm_reducer(lambda a, b: a + b, [T.int32(0)]), "reduce_scope",
                        T.reinterpret("handle", T.uint64(0))):
                T.tvm_thread_allreduce(T.uint32(1), acc_i[0], True, r_i[0], tx, dtype="handle")
            with T.attr(T.comm_reducer(lambda a, b: a + b, [T.float32(0)]), "reduce_scope",
                        T.reinterpret("handle", T.uint64(0))):
                T.tvm_thread_allreduce(T.uint32(1), acc_f[0], True, r_f[0], tx, dtype="handle")
            acc_i[0] = r_i[0]
            acc_f[0] = r_f[0]
        else:
            s_i[tx] = acc_i[0]
            s_f[tx] = acc_f[0]
            T.tvm_storage_sync("shared")
            for step in T.unroll(log_threads):
                if tx < T.shift_right(threads, step + 1):
                    s_i[tx] = s_i[tx] + s_i[tx + T.shift_right(threads, step + 1)]
                    s_f[tx] = s_f[tx] + s_f[tx + T.shift_right(threads, step + 1)]
                T.tvm_storage_sync("shared")
            acc_i[0] = s_i[0]
            acc_f[0] = s_f[0]
            T.tvm_storage_sync("shared")

    @T.macro
    def block_reduce(tx, acc_i, acc_f, acc_mn, acc_mx, s_i, s_f, s_mn, s_mx):
        # Combine every thread's (count, sum, min, max); every thread gets the result in its acc_*[0]. CUDA: four
        # one-value all-reduces (warp shuffles, one value per warp through shared memory). Elsewhere a tree through
        # the shared arrays s_*, which ends with a barrier so they can be reused at once (an all-reduce per call site
        # takes a block-sized shared buffer there: the fused kernel's would exceed ROCm's 64 KB of LDS).
        if shuffle_reduce:
            pair_reduce(tx, acc_i, acc_f, s_i, s_f)
            r_mn = T.alloc_buffer((1,), "int32", scope="local")
            r_mx = T.alloc_buffer((1,), "int32", scope="local")
            with T.attr(T.comm_reducer(lambda a, b: T.min(a, b), [int_max]), "reduce_scope",
                        T.reinterpret("handle", T.uint64(0))):
                T.tvm_thread_allreduce(T.uint32(1), acc_mn[0], True, r_mn[0], tx, dtype="handle")
            with T.attr(T.comm_reducer(lambda a, b: T.max(a, b), [int_min]), "reduce_scope",
                        T.reinterpret("handle", T.uint64(0))):
                T.tvm_thread_allreduce(T.uint32(1), acc_mx[0], True, r_mx[0], tx, dtype="handle")
            acc_mn[0] = r_mn[0]
            acc_mx[0] = r_mx[0]
        else:
            s_i[tx] = acc_i[0]
            s_f[tx] = acc_f[0]
            s_mn[tx] = acc_mn[0]
            s_mx[tx] = acc_mx[0]
            T.tvm_storage_sync("shared")
            for step in T.unroll(log_threads):
                if tx < T.shift_right(threads, step + 1):
                    s_i[tx] = s_i[tx] + s_i[tx + T.shift_right(threads, step + 1)]
                    s_f[tx] = s_f[tx] + s_f[tx + T.shift_right(threads, step + 1)]
                    s_mn[tx] = T.min(s_mn[tx], s_mn[tx + T.shift_right(threads, step + 1)])
                    s_mx[tx] = T.max(s_mx[tx], s_mx[tx + T.shift_right(threads, step + 1)])
                T.tvm_storage_sync("shared")
            acc_i[0] = s_i[0]
            acc_f[0] = s_f[0]
            acc_mn[0] = s_mn[0]
            acc_mx[0] = s_mx[0]
            T.tvm_storage_sync("shared")

    @T.macro
    def scan_one(value, i, mid, max_all, l_i, l_f, l_mn, l_mx, xs, u):
        # branch-free: the loads of a step's GPU_UNROLL values do not wait on each other's comparisons. The value
        # goes through the local xs[u] (a register), not a ``T.let``: TVM's LLVM code generator (ROCm) simplifies
        # each bound value again with the earlier ones substituted (docs/kernels.md, Build time); the lets below
        # bind short expressions of it.
        xs[u] = value(i)
        b: T.let = _bits(xs[u])
        above: T.let = b >= mid
        l_i[u] = l_i[u] + T.Select(above, 1, 0)
        l_f[u] = l_f[u] + T.Select(above, xs[u], T.float32(0))
        l_mn[u] = T.Select(above, T.min(l_mn[u], b), l_mn[u])
        l_mx[u] = T.Select(max_all or not above, T.max(l_mx[u], b), l_mx[u])

    @T.macro
    def scan(value, vocab, tx, mid, max_all, live, acc_i, acc_f, acc_mn, acc_mx, s_i, s_f, s_mn, s_mx):
        # Count, sum and smallest bits of the values with bits >= mid, and the largest bits below mid (of all values
        # with max_all, a Python bool). The row is read only where live; the reduction always runs. Each thread
        # reads GPU_UNROLL values per step into as many partials (independent loads), as gpu_row_fold.
        l_i = T.alloc_buffer((GPU_UNROLL,), "int32", scope="local")
        l_f = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
        l_mn = T.alloc_buffer((GPU_UNROLL,), "int32", scope="local")
        l_mx = T.alloc_buffer((GPU_UNROLL,), "int32", scope="local")
        xs = T.alloc_buffer((GPU_UNROLL,), "float32", scope="local")
        for u in T.unroll(GPU_UNROLL):
            l_i[u] = 0
            l_f[u] = T.float32(0)
            l_mn[u] = int_max
            l_mx[u] = int_min
        span: T.let = threads * GPU_UNROLL
        for k in range(T.Select(live, vocab // span, 0)):
            for u in T.unroll(GPU_UNROLL):
                scan_one(value, (k * GPU_UNROLL + u) * threads + tx, mid, max_all, l_i, l_f, l_mn, l_mx, xs, u)
        if live:
            for u in T.unroll(GPU_UNROLL):
                if vocab // span * span + u * threads + tx < vocab:
                    scan_one(value, vocab // span * span + u * threads + tx, mid, max_all, l_i, l_f, l_mn, l_mx, xs, u)
        acc_i[0] = l_i[0]
        acc_f[0] = l_f[0]
        acc_mn[0] = l_mn[0]
        acc_mx[0] = l_mx[0]
        for u in T.unroll(1, GPU_UNROLL):
            acc_i[0] = acc_i[0] + l_i[u]
            acc_f[0] = acc_f[0] + l_f[u]
            acc_mn[0] = T.min(acc_mn[0], l_mn[u])
            acc_mx[0] = T.max(acc_mx[0], l_mx[u])
        block_reduce(tx, acc_i, acc_f, acc_mn, acc_mx, s_i, s_f, s_mn, s_mx)

    @T.macro
    def step(value, vocab, tx, by_sum, goal, live, st, ms, acc_i, acc_f, acc_mn, acc_mx, s_i, s_f, s_mn, s_mx):
        # One bisection step on [st[1], st[2]): f(mid) >= goal moves the low end up to the data value at or above
        # mid, otherwise the high end down past the data value below it. f = sum (by_sum) or count.
        scan(value, vocab, tx, st[1] + (st[2] - st[1]) // 2, False, live, acc_i, acc_f, acc_mn, acc_mx,
             s_i, s_f, s_mn, s_mx)
        if live:
            if (by_sum and acc_f[0] >= goal) or (not by_sum and acc_i[0] >= goal):
                st[1] = acc_mn[0]
                ms[1] = acc_f[0]
            else:
                st[2] = T.max(acc_mx[0] + 1, st[1] + 1)

    @T.macro
    def bisect(value, vocab, tx, by_sum, goal, st, ms, acc_i, acc_f, acc_mn, acc_mx, s_i, s_f, s_mn, s_mx):
        if uniform_loops:
            for it in range(31):  # each step at least halves an interval narrower than 2**31
                live: T.let = st[2] - st[1] > 1
                step(value, vocab, tx, by_sum, goal, live, st, ms, acc_i, acc_f, acc_mn, acc_mx,
                     s_i, s_f, s_mn, s_mx)
        else:
            while st[2] - st[1] > 1:
                step(value, vocab, tx, by_sum, goal, True, st, ms, acc_i, acc_f, acc_mn, acc_mx,
                     s_i, s_f, s_mn, s_mx)

    @T.macro
    def threshold(value, vocab, tx, k, top_p_r, min_p_r, st, ms, r, row_i, row_f, cand):
        # The kept set of one row (as the CPU macro): bits >= st[0], its sum in ms[0]; every thread of the block
        # holds the same st (int32 (GPU_STATE,), local) and ms (float32 (2,), local). The first pass, the bound
        # pass and the list's copy ran before, split over blocks (``_threshold_split``): their results are row r's
        # record (row_i, row_f) and its list (cand, list_cap entries from r * list_cap), loaded here into shared
        # memory. A row whose record has no positive maximum (a row of zeros, or one the caller does not search)
        # reads nothing.
        # st: 0: kept = bits >= st[0]; 1, 2: bisection interval; 3: max bits; 4: ms[0] is the kept sum; 5: the list's
        # bound lb; 6: the values >= lb; 7: lb's pivot.
        # the shared tree's arrays (one element where the reductions go through warp shuffles, which never use them)
        s_i = T.alloc_buffer((tree_size,), "int32", scope="shared")
        s_f = T.alloc_buffer((tree_size,), "float32", scope="shared")
        s_mn = T.alloc_buffer((tree_size,), "int32", scope="shared")
        s_mx = T.alloc_buffer((tree_size,), "int32", scope="shared")
        lst = T.alloc_buffer((list_cap,), "float32", scope="shared")  # the candidate list
        acc_i = T.alloc_buffer((1,), "int32", scope="local")
        acc_f = T.alloc_buffer((1,), "float32", scope="local")
        acc_mn = T.alloc_buffer((1,), "int32", scope="local")
        acc_mx = T.alloc_buffer((1,), "int32", scope="local")
        fl = T.alloc_buffer((3,), "int32", scope="local")  # 0: top-k on, 1: top-p on, 2: the list is used
        ri: T.let = r * ROW_INTS
        st[0] = row_i[ri + I_LO]
        st[3] = row_i[ri + I_MAX]
        st[4] = row_i[ri + I_EXACT]
        st[5] = row_i[ri + I_LB]
        st[6] = row_i[ri + I_COUNT]
        st[7] = row_i[ri + I_JLB]
        fl[0] = row_i[ri + I_TOPK]
        fl[1] = row_i[ri + I_TOPP]
        fl[2] = row_i[ri + I_LIST]
        ms[0] = row_f[r * ROW_FLOATS + F_MASS]
        for j in range(list_cap // threads):
            if fl[2] == 1 and j * threads + tx < st[6]:
                lst[j * threads + tx] = cand[r * list_cap + j * threads + tx]
        T.tvm_storage_sync("shared")
        # the searches read the list where it is used, else the row
        on_list: T.let = fl[2] == 1
        n_src: T.let = T.Select(on_list, st[6], vocab)
        # top-k (from lb on the list: lb holds at least k values there)
        st[1] = T.Select(on_list and fl[0] == 1, st[5], st[0])
        st[2] = st[1] + 1
        if fl[0] == 1:
            st[2] = st[3] + 1
        bisect(_from_list(on_list, lst, list_cap, value), n_src, tx, False, k, st, ms, acc_i, acc_f, acc_mn,
               acc_mx, s_i, s_f, s_mn, s_mx)
        if st[1] > st[0]:
            st[0] = st[1]
            st[4] = 0
        # the kept sum, where a filter changed the kept set (the bound pass summed it at the min-p threshold)
        mass_pass: T.let = st[4] == 0 and st[3] >= 1 and st[0] != row_i[ri + I_PIVOT]
        scan(_from_list(on_list, lst, list_cap, value), n_src, tx, st[0], False, mass_pass, acc_i, acc_f, acc_mn,
             acc_mx, s_i, s_f, s_mn, s_mx)
        if mass_pass:
            ms[0] = acc_f[0]
        elif st[4] == 0 and st[3] >= 1:
            ms[0] = row_f[r * ROW_FLOATS + F_SUM0]
        # top-p (from lb on the list when top-p set it: G(lb) reaches the goal, and its sum is the bound pass's)
        st[1] = T.Select(on_list, T.max(st[0], st[5]), st[0])
        ms[1] = row_f[r * ROW_FLOATS + F_SUMLB]
        st[2] = st[1] + 1
        if fl[1] == 1:
            st[2] = st[3] + 1
        bisect(_from_list(on_list, lst, list_cap, value), n_src, tx, True, top_p_r * ms[0], st, ms, acc_i, acc_f,
               acc_mn, acc_mx, s_i, s_f, s_mn, s_mx)
        if st[1] > st[0]:
            st[0] = st[1]
            ms[0] = ms[1]
        if st[3] < 1:
            st[0] = int_max
            ms[0] = T.float32(1)

    return threshold


def _rescaled_rows(probs: tirx.Buffer, lo: tirx.Buffer, mass: tirx.Buffer
                   ) -> Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr]:
    """(r, i) -> probs[r, i] renormalized with row r's kept set (bits >= lo[r]) and its sum mass[r]."""
    return lambda r, i: rescaled(probs[r, i], lo[r], mass[r])


def _gpu(threads: int, uniform_loops: bool, shuffle_reduce: bool, list_cap: int) -> tirx.PrimFunc:
    threshold = gpu_row_threshold(threads, uniform_loops, shuffle_reduce, list_cap)
    passes = split_threshold_passes(list_cap)

    @T.prim_func
    def renormalize_probs(var_probs: T.handle, var_top_k: T.handle, var_top_p: T.handle, var_min_p: T.handle,
                          var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, vocab = T.int32(), T.int32()
        probs = T.match_buffer(var_probs, (batch, vocab), "float32", align=CALLER_ARRAY_ALIGN)
        top_k = T.match_buffer(var_top_k, (batch,), "int32")
        top_p = T.match_buffer(var_top_p, (batch,), "float32")
        min_p = T.match_buffer(var_min_p, (batch,), "float32")
        out = T.match_buffer(var_out, (batch, vocab), "float32")
        # workspaces: each row's record and candidate list (the split passes'), its kept set (bits >= row_lo)
        # and its sum
        row_i = T.alloc_buffer((batch * ROW_INTS,), "int32", scope="global")
        row_f = T.alloc_buffer((batch * ROW_FLOATS,), "float32", scope="global")
        cand = T.alloc_buffer((batch * list_cap,), "float32", scope="global")
        row_lo = T.alloc_buffer((batch,), "int32", scope="global")
        row_mass = T.alloc_buffer((batch,), "float32", scope="global")
        # kernels 1-5: the first pass, the bound pass and the list's copy, each row split over blocks
        passes(batch, vocab, lambda r, k: T.int32(0), lambda r, scalars: row_of(probs, r), lambda r: top_k[r],
               lambda r: top_p[r], lambda r: min_p[r], lambda r: True, row_i, row_f, cand, None)
        # kernel 6: each row's threshold search, one block per row
        for r in T.thread_binding(batch, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                # the same state as the CPU kernel, held identically by every thread of the block
                st = T.alloc_buffer((GPU_STATE,), "int32", scope="local")
                ms = T.alloc_buffer((2,), "float32", scope="local")
                threshold(row_of(probs, r), vocab, tx, top_k[r], top_p[r], min_p[r], st, ms, r, row_i, row_f, cand)
                if tx == 0:
                    row_lo[r] = st[0]
                    row_mass[r] = ms[0]
        # kernel 7: the rescaling, each row split over blocks
        for b in T.thread_binding(batch * split_parts(vocab), thread="blockIdx.x"):
            for tx in T.thread_binding(SPLIT_THREADS, thread="threadIdx.x"):
                split_map(out, vocab, b, tx, _rescaled_rows(probs, row_lo, row_mass))
    return renormalize_probs


def get_renormalize_probs(target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel scheduled for ``target``'s kind (see the module docstring for the operation)."""
    if is_cpu(target):
        return _cpu()
    threads = max_threads(target)
    return _gpu(threads, uniform_loops=target.kind.name == "webgpu", shuffle_reduce=target.kind.name == "cuda",
                list_cap=gpu_list_capacity(target, threads))
