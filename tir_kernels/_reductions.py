# fmt: off
"""Row reductions and row maps shared by the softmax-family kernels (softmax, log_softmax).

Each is a TVMScript macro (``T.macro``: its body is pasted into the calling kernel at parse time) working on one row
of a ``[batch, vocab]`` problem. The per-element work is a Python callable ``value(v) -> PrimExpr`` built by the
kernel (e.g. ``lambda v: x[r, v]``), so every loop body below is written once. In Python terms::

    cpu_row_fold / gpu_row_fold:
        acc = init
        for v in range(vocab):
            e = value(v)
            store[r, v] = e                 # CPU only, when store is not None
            acc = combine(acc, e)
        out[0] = acc
    cpu_row_map / gpu_row_map:
        for v in range(vocab):
            y[r, v] = value(v)

``combine`` must be associative and commutative (max, min, +): the order of combination differs from the loop above.

CPU macros run inside the caller's per-row ``T.parallel`` loop: full ``CPU_WORD``-wide words are branch-free vector
code updating per-lane partials (four AVX-512 registers, i.e. four independent dependency chains), then a scalar tail,
then a reduction over the lanes. A fold also adds the partials of each ``CPU_BLOCK`` elements into the row total
separately (two-level summation), which keeps a float32 sum over 262144 elements within a few 1e-7 instead of 1e-5.
The scratch buffers (``lanes``, ``block``: ``CPU_WORD`` elements; ``out``: 1) must be ``scope="global"`` buffers
allocated inside the row loop: TVM places small global allocations on the stack, while ``scope="local"`` ones become
a workspace (heap) allocation per row.

GPU macros run with one block per row: thread ``tx`` of ``threads`` visits ``v = tx, tx + threads, ...``, then
``T.tvm_thread_allreduce`` combines the per-thread partials and every thread of the block gets the result in ``out``.
They hold barriers, so they must not be called inside an ``if``; a block-uniform ``active`` condition skips the row
reads instead (the fold then returns ``init``). Scratch buffers are ``scope="local"`` one-element buffers.

Element formulas shared by the kernels: ``shifted_exp`` (the softmax numerator), ``safe_shift`` (the row max, or 0 for
a row of only -inf so that ``x - shift`` never computes ``-inf - -inf``), ``inverse_temperature``, and
``guarded_exp`` (the GPU exp, exactly 0 where float32 exp underflows). CPUs use ``fast_exp`` from ``_common``.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script import tirx as T

from ._common import (
    CPU_LANES,
    EXP_UNDERFLOW,
    LOG2E,
    POS_INF_BITS,
    exp2_nonpositive,
    fast_exp,
    neg_inf,
    pos_inf,
)

#: Elements per step of the CPU loops: four AVX-512 registers of partials, i.e. four independent chains.
CPU_WORD = 4 * CPU_LANES

#: Elements per first-level partial sum of the CPU folds (a multiple of CPU_WORD).
CPU_BLOCK = 16 * CPU_WORD

#: Largest finite float32; the inverse temperature is clamped to it.
FLT_MAX = 3.4028234663852886e38

#: Temperatures at or below this get the inverse temperature FLT_MAX (1 / t would overflow or divide by zero).
MIN_TEMPERATURE = 1e-38

#: Values per chunk of the CPU softmax pass (``cpu_row_softmax_pass``): each chunk's exps are taken against the
#: running maximum of the row up to and including that chunk.
CPU_CHUNK = 1024

#: Lanes of the CPU softmax pass's loops: four AVX2 registers of partial sums (with 64 lanes the exp's temporaries
#: spill to the stack in every step).
_SOFTMAX_WORD = 32

#: Identity of the int32 min reduction.
INT32_MAX = 2**31 - 1

ExpFn = Callable[["tirx.PrimExpr"], "tirx.PrimExpr"]


def guarded_exp(z: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp(z) with the hardware exp, and exactly 0 where float32 exp underflows (z < EXP_UNDERFLOW, z = -inf).
    z is bound once (a ``Let``): inlined twice, a long z (a masked logit read) doubled the kernels' IR."""
    zv = tirx.Var("exp_z", "float32")
    return tirx.Let(zv, z, T.Select(zv < T.float32(EXP_UNDERFLOW), T.float32(0), T.exp(zv)))


def shifted_exp(x: tirx.PrimExpr, shift: tirx.PrimExpr, scale: tirx.PrimExpr, exp: ExpFn) -> tirx.PrimExpr:
    """The softmax numerator ``exp((x - shift) * scale)``: 1 at the row max, exactly 0 for x = -inf."""
    return exp((x - shift) * scale)


def safe_shift(row_max: tirx.PrimExpr) -> tirx.PrimExpr:
    """The value subtracted before exp: the row max, or 0 when the row is all -inf (so no -inf - -inf = NaN)."""
    return T.Select(row_max == neg_inf(), T.float32(0), row_max)


def inverse_temperature(t: tirx.PrimExpr) -> tirx.PrimExpr:
    """1 / t, or FLT_MAX for t <= MIN_TEMPERATURE (then exp((x - max) * scale) is 1 at the max and 0 elsewhere)."""
    return T.Select(t > T.float32(MIN_TEMPERATURE), T.float32(1) / t, T.float32(FLT_MAX))


def exp2_scale(t: tirx.PrimExpr) -> tirx.PrimExpr:
    """log2(e) / t, the factor of ``x - max`` in the CPU softmax's ``exp2_nonpositive`` (clamped to FLT_MAX, which
    temperatures <= MIN_TEMPERATURE get: then the exps are 1 at the maximum and 0 elsewhere)."""
    return T.min(inverse_temperature(t) * T.float32(LOG2E), T.float32(FLT_MAX))


def prefetch(buf: tirx.Buffer, r: tirx.PrimExpr, i: tirx.PrimExpr) -> tirx.PrimExpr:
    """Ask for the cache line holding buf[r, i] (CPU only: ``llvm.prefetch``, a read, kept in every cache level)."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(buf[r, i]), T.int32(0), T.int32(3),
                              T.int32(1))


def row_of(buf: tirx.Buffer, r: tirx.PrimExpr) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """``v -> buf[r, v]``: row r of a [batch, vocab] buffer as the per-token value the row macros take."""
    return lambda v: buf[r, v]


def index_where(value: Callable[[tirx.PrimExpr], tirx.PrimExpr], target: tirx.PrimExpr,
                none: tirx.PrimExpr) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """``v -> v if value(v) == target else none``: folded with ``minimum``, the first index of ``target``."""
    return lambda v: T.Select(value(v) == target, v, none)


def flagging(value: Callable[[tirx.PrimExpr], tirx.PrimExpr],
             raw: Callable[[tirx.PrimExpr], tirx.PrimExpr]) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """value(i), but +inf where raw(i) (the logit itself, before any mask) is NaN or +inf: a row's maximum of it is
    +inf exactly when the row's logits hold a NaN or a +inf, and value's maximum otherwise. It flags the rows that
    have no distribution to sample from. The test is on the bits (exponent all ones: +inf, or NaN of either sign):
    TVM's simplifier folds ``x != x`` to false, and WGSL lets a compiler assume there is no NaN."""
    return lambda i: T.Select(_nan_or_plus_inf(T.reinterpret("int32", raw(i))), pos_inf(), value(i))


def _nan_or_plus_inf(bits: tirx.PrimExpr) -> tirx.PrimExpr:
    """float32 bits (as int32) of a NaN or +inf: |bits| above +inf's (a NaN), or +inf's itself."""
    return T.Or(T.bitwise_and(bits, T.int32(0x7FFFFFFF)) > T.int32(POS_INF_BITS), bits == T.int32(POS_INF_BITS))


def add(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """The sum combiner (a plain function so that folds and comm_reducers can take it)."""
    return a + b


def maximum(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """The max combiner."""
    return T.max(a, b)


def minimum(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """The min combiner."""
    return T.min(a, b)


# ---------------------------------------------------------------------------------------------------------------- CPU


@T.macro
def block_all(combine, identity, value, out, tx):
    """out[0] = combine of ``value`` over the block's threads, in every thread."""
    with T.attr(T.comm_reducer(combine, [identity]), "reduce_scope", T.reinterpret("handle", T.uint64(0))):
        T.tvm_thread_allreduce(T.uint32(1), value, True, out[0], tx, dtype="handle")


@T.macro
def _cpu_span(base, count, loop, value, store, r, lanes, combine):
    # Elements base .. base + count - 1: lanes[l] = combine(lanes[l], e) and/or store[r, base + l] = e.
    for l in loop(count):
        e: T.let = value(base + l)
        if store is not None:
            store[r, base + l] = e
        if lanes is not None:
            lanes[l] = combine(lanes[l], e)


@T.macro
def cpu_row_fold(vocab, init, combine, value, store, r, lanes, block, out):
    """out[0] = fold of value(v) over v < vocab; also store[r, v] = value(v) unless store is None (see module doc)."""
    for l in T.vectorized(CPU_WORD):
        lanes[l] = init
    for b in range(vocab // CPU_BLOCK):
        for l in T.vectorized(CPU_WORD):
            block[l] = init
        for c in range(CPU_BLOCK // CPU_WORD):
            _cpu_span(b * CPU_BLOCK + c * CPU_WORD, CPU_WORD, T.vectorized, value, store, r, block, combine)
        for l in T.vectorized(CPU_WORD):
            lanes[l] = combine(lanes[l], block[l])
    for c in range(vocab % CPU_BLOCK // CPU_WORD):
        _cpu_span(vocab // CPU_BLOCK * CPU_BLOCK + c * CPU_WORD, CPU_WORD, T.vectorized, value, store, r, lanes,
                  combine)
    _cpu_span(vocab // CPU_WORD * CPU_WORD, vocab % CPU_WORD, T.serial, value, store, r, lanes, combine)
    out[0] = init
    for l in range(CPU_WORD):
        out[0] = combine(out[0], lanes[l])


@T.macro
def cpu_row_map(y, r, vocab, value):
    """y[r, v] = value(v) for v < vocab: branch-free vector words, then a scalar tail."""
    for c in range(vocab // CPU_WORD):
        _cpu_span(c * CPU_WORD, CPU_WORD, T.vectorized, value, y, r, None, None)
    _cpu_span(vocab // CPU_WORD * CPU_WORD, vocab % CPU_WORD, T.serial, value, y, r, None, None)


@T.macro
def cpu_row_peak(value, vocab, lanes, out):
    """out[0] = max(value(v) for v < vocab): vector words, then a scalar tail. For a ``flagging`` value: in
    ``cpu_row_fold`` its vector Select, bound by the span's ``T.let``, comes out wrong in TVM 0.27 (tested)."""
    for l in T.vectorized(CPU_WORD):
        lanes[l] = neg_inf()
    for c in range(vocab // CPU_WORD):
        for l in T.vectorized(CPU_WORD):
            lanes[l] = T.max(lanes[l], value(c * CPU_WORD + l))
    for t in range(vocab % CPU_WORD):
        lanes[0] = T.max(lanes[0], value(vocab // CPU_WORD * CPU_WORD + t))
    out[0] = lanes[0]
    for l in range(1, CPU_WORD):
        out[0] = T.max(out[0], lanes[l])


@T.macro
def cpu_row_max(x, r, vocab, lanes, block, out):
    """out[0] = max(x[r, :vocab]) (-inf for vocab 0)."""
    cpu_row_fold(vocab, neg_inf(), maximum, lambda v: x[r, v], None, r, lanes, block, out)


@T.macro
def cpu_row_sum_exp(x, r, vocab, shift, scale, store, lanes, block, out):
    """out[0] = sum(exp((x[r, :vocab] - shift) * scale)) with fast_exp; the exps go to store[r, :] unless None."""
    cpu_row_fold(vocab, T.float32(0), add, lambda v: shifted_exp(x[r, v], shift, scale, fast_exp), store, r, lanes,
                 block, out)


@T.macro
def cpu_first_index_of(x, r, vocab, value, lanes, block, out):
    """out[0] = lowest v with x[r, v] == value, vocab if none (int32 scratch buffers)."""
    cpu_row_fold(vocab, vocab, minimum, index_where(row_of(x, r), value, vocab), None, r, lanes, block, out)


@T.macro
def _lane_total(lanes, out):
    # out[0] = the sum of the _SOFTMAX_WORD lanes, as a tree in whole vectors
    if _SOFTMAX_WORD == 32:
        for l in T.vectorized(16):
            lanes[l] = lanes[l] + lanes[l + 16]
    for l in T.vectorized(8):
        lanes[l] = lanes[l] + lanes[l + 8]
    out[0] = lanes[0]
    for l in range(1, 8):
        out[0] = out[0] + lanes[l]


def _non_finite_key(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """An int32 key of float32 x that is >= POS_INF_BITS exactly for a NaN (either sign) or +inf: |bits|, less 1
    for a negative x (so -inf falls just below +inf's bits). Three integer vector operations, no select."""
    bits = T.reinterpret("int32", x)
    return T.bitwise_and(bits, T.int32(0x7FFFFFFF)) + T.shift_right(bits, T.int32(31))


@T.macro
def _chunk_peak(mx, run):
    # run[1] = the largest of the _SOFTMAX_WORD lanes of mx, as a tree of whole-vector maxima
    if _SOFTMAX_WORD == 32:
        for l in T.vectorized(16):
            mx[l] = T.max(mx[l], mx[l + 16])
    for l in T.vectorized(8):
        mx[l] = T.max(mx[l], mx[l + 8])
    run[1] = mx[0]
    for l in range(1, 8):
        run[1] = T.max(run[1], mx[l])


@T.macro
def _chunk_exps(x, r, value, raw, vocab, base, steps, tail, shift, scale2, store, sr, part, mx, bad):
    # part[l] = the sum of the chunk's exps 2 ** ((value(i) - shift) * scale2) in lane l, each stored to store[sr, i]
    # unless store is None; with mx not None, the lanes' maxima of value(i) too (and of the keys of raw(i) in bad)
    for l in T.vectorized(_SOFTMAX_WORD):
        part[l] = T.float32(0)
    for s in range(steps):
        # the same 128 bytes of the next chunk: it streams in while this chunk's exps are computed
        prefetch(x, r, T.min(base + CPU_CHUNK + s * _SOFTMAX_WORD, vocab - 1))
        prefetch(x, r, T.min(base + CPU_CHUNK + s * _SOFTMAX_WORD + 16, vocab - 1))
        for l in T.vectorized(_SOFTMAX_WORD):
            v: T.let = value(base + s * _SOFTMAX_WORD + l)
            if mx is not None:
                mx[l] = T.max(mx[l], v)
                if raw is not None:
                    bad[l] = T.max(bad[l], _non_finite_key(raw(base + s * _SOFTMAX_WORD + l)))
            e: T.let = exp2_nonpositive((v - shift) * scale2)
            if store is not None:
                store[sr, base + s * _SOFTMAX_WORD + l] = e
            part[l] = part[l] + e
    for t in range(tail):
        v: T.let = value(base + steps * _SOFTMAX_WORD + t)
        if mx is not None:
            mx[0] = T.max(mx[0], v)
            if raw is not None:
                bad[0] = T.max(bad[0], _non_finite_key(raw(base + steps * _SOFTMAX_WORD + t)))
        e: T.let = exp2_nonpositive((v - shift) * scale2)
        if store is not None:
            store[sr, base + steps * _SOFTMAX_WORD + t] = e
        part[0] = part[0] + e


@T.macro
def _softmax_chunk(x, r, value, raw, vocab, base, steps, tail, c, scale2, store, sr, shifts, lanes, part, mx, run,
                   bad):
    # Values base .. base + steps * w + tail - 1 of row r (w = _SOFTMAX_WORD): raise the running maximum run[0] to
    # the chunk's (of value(i), rescaling the lanes' partial sums), record it in shifts[c], add the chunk's exps of
    # value(i) against it to the lanes (summed in ``part`` first) and store them to store[sr, :] unless store is None.
    # Where raw is not None, bad[l] takes the largest _non_finite_key(raw(i)) of its lane.
    for l in T.vectorized(_SOFTMAX_WORD):
        mx[l] = neg_inf()
    if run[0] == neg_inf():
        # no value above -inf yet: the chunk's maximum first, then its exps
        for s in range(steps):
            for l in T.vectorized(_SOFTMAX_WORD):
                mx[l] = T.max(mx[l], value(base + s * _SOFTMAX_WORD + l))
                if raw is not None:
                    bad[l] = T.max(bad[l], _non_finite_key(raw(base + s * _SOFTMAX_WORD + l)))
        for t in range(tail):
            mx[0] = T.max(mx[0], value(base + steps * _SOFTMAX_WORD + t))
            if raw is not None:
                bad[0] = T.max(bad[0], _non_finite_key(raw(base + steps * _SOFTMAX_WORD + t)))
        _chunk_peak(mx, run)
        if run[1] > run[0]:  # (the lanes hold only zeros)
            run[0] = run[1]
        if run[0] != neg_inf():
            _chunk_exps(x, r, value, None, vocab, base, steps, tail, run[0], scale2, store, sr, part, None, None)
            for l in T.vectorized(_SOFTMAX_WORD):
                lanes[l] = lanes[l] + part[l]
        elif store is not None:
            for i in range(steps * _SOFTMAX_WORD + tail):
                store[sr, base + i] = T.float32(0)
    else:
        # the exps against the running maximum and the chunk's maximum in one loop (the logits are read once); a
        # chunk that raises the maximum (rarely, after the first few) has its exps taken again against the new one,
        # so every chunk's exps are those against the maximum up to and including it, as if it were found first
        _chunk_exps(x, r, value, raw, vocab, base, steps, tail, run[0], scale2, store, sr, part, mx, bad)
        _chunk_peak(mx, run)
        if run[1] > run[0]:
            grow: T.let = exp2_nonpositive((run[0] - run[1]) * scale2)
            for l in T.vectorized(_SOFTMAX_WORD):
                lanes[l] = lanes[l] * grow
            run[0] = run[1]
            _chunk_exps(x, r, value, None, vocab, base, steps, tail, run[0], scale2, store, sr, part, None, None)
        for l in T.vectorized(_SOFTMAX_WORD):
            lanes[l] = lanes[l] + part[l]
    shifts[c] = run[0]


@T.macro
def cpu_row_softmax_pass(x, r, value, raw, vocab, scale2, store, sr, shifts, lanes, part, mx, run, out):
    """One pass over row r of x, read as value(i) (x[r, i], or a masked reading of it; x[r, :] is prefetched ahead of
    the reads), online maximum of value(i), chunk by chunk; with ``raw`` (the logit before any mask: raw(i), or None)
    run[0] ends +inf when a raw(i) is NaN or +inf (the other results of such a row are then meaningless)::

        run[0] = max(x[r, :vocab])
        for each chunk c of CPU_CHUNK values (the last one partial, possibly empty):
            shifts[c] = max(x[r, :end of chunk c])                          # the running maximum
            store[sr, chunk c] = 2 ** ((x[r, chunk c] - shifts[c]) * scale2)  # 0 where x = -inf or shifts[c] = -inf
        out[0] = sum over chunks of sum(store[sr, chunk c]) * 2 ** ((shifts[c] - run[0]) * scale2)

    The sum is kept in _SOFTMAX_WORD lanes (each chunk summed apart first), rescaled each time the maximum grows.
    ``cpu_rescale_chunks`` then brings the stored exps of the chunks whose shift is below the maximum to it. Once the
    row has a value above -inf, each chunk is read once: one loop takes its exps against the running maximum and its
    maximum; the few chunks that raise the maximum take their exps again (from L1) against the new one, so the
    results are those of taking each chunk's maximum first.
    shifts: float32 scratch of vocab // CPU_CHUNK + 1; lanes, part, mx: float32 (_SOFTMAX_WORD,); run: float32 (2,).
    """
    bad = T.alloc_buffer((_SOFTMAX_WORD,), "int32", scope="global")
    for l in T.vectorized(_SOFTMAX_WORD):
        lanes[l] = T.float32(0)
        bad[l] = T.int32(0)
    run[0] = neg_inf()
    for c in range(vocab // CPU_CHUNK + 1):  # one body for the whole chunks and the last, partial one (compile time)
        n: T.let = T.min(CPU_CHUNK, vocab - c * CPU_CHUNK)
        _softmax_chunk(x, r, value, raw, vocab, c * CPU_CHUNK, n // _SOFTMAX_WORD, n % _SOFTMAX_WORD, c, scale2,
                       store, sr, shifts, lanes, part, mx, run, bad)
    _lane_total(lanes, out)
    if raw is not None:
        for l in T.vectorized(8):
            bad[l] = T.max(T.max(bad[l], bad[l + 8]), T.max(bad[l + 16], bad[l + 24]))
        for l in range(1, 8):
            bad[0] = T.max(bad[0], bad[l])
        if bad[0] >= T.int32(POS_INF_BITS):
            run[0] = pos_inf()


@T.macro
def cpu_rescale_chunks(store, sr, vocab, scale2, shifts, row_max):
    """store[sr, chunk c] *= 2 ** ((shifts[c] - row_max) * scale2) for the chunks whose shift is below row_max, so
    that every stored exp is 2 ** ((x - row_max) * scale2) as computed after ``cpu_row_softmax_pass``."""
    for c in range(vocab // CPU_CHUNK + 1):
        if shifts[c] < row_max:
            k: T.let = exp2_nonpositive((shifts[c] - row_max) * scale2)
            base: T.let = c * CPU_CHUNK
            n: T.let = T.min(CPU_CHUNK, vocab - base)
            for s in range(n // _SOFTMAX_WORD):
                for l in T.vectorized(_SOFTMAX_WORD):
                    store[sr, base + s * _SOFTMAX_WORD + l] = store[sr, base + s * _SOFTMAX_WORD + l] * k
            for t in range(n % _SOFTMAX_WORD):
                store[sr, base + n // _SOFTMAX_WORD * _SOFTMAX_WORD + t] = (
                    store[sr, base + n // _SOFTMAX_WORD * _SOFTMAX_WORD + t] * k)


# ---------------------------------------------------------------------------------------------------------------- GPU


#: Elements each thread of a GPU row pass reads per step, into as many independent partials: the loads of a step are
#: issued together (one dependent load at a time leaves a block latency-bound, far under its share of bandwidth).
GPU_UNROLL = 8

#: Threads per block of the GPU kernels that split a row over several blocks (the softmax's statistics and writes,
#: renormalize's writes).
SPLIT_THREADS = 256
#: Values of a row each such block reads: GPU_UNROLL per thread, whose loads are issued together. The split depends
#: on the vocabulary alone, so a row's result does not depend on the batch.
SPLIT_CHUNK = SPLIT_THREADS * GPU_UNROLL


def split_parts(vocab: tirx.PrimExpr) -> tirx.PrimExpr:
    """Blocks (chunks of SPLIT_CHUNK values) per row of a split kernel."""
    return (vocab + SPLIT_CHUNK - 1) // SPLIT_CHUNK


@T.macro
def split_map(y, vocab, b, tx, value):
    """Block b of a split kernel (SPLIT_THREADS threads ``tx``; row b // parts, its chunk b % parts):
    y[row, v] = value(row, v) for the chunk's v < vocab (``value`` takes the row and the index)."""
    r: T.let = b // split_parts(vocab)
    base: T.let = b % split_parts(vocab) * SPLIT_CHUNK
    for u in T.unroll(GPU_UNROLL):
        if base + u * SPLIT_THREADS + tx < vocab:
            y[r, base + u * SPLIT_THREADS + tx] = value(r, base + u * SPLIT_THREADS + tx)


@T.macro
def gpu_row_fold(vocab, tx, threads, init, identity, combine, value, active, part, out):
    """out[0] = fold of value(v) over v < vocab in every thread of the block (``init`` if ``active`` is false).

    ``identity`` is a constant identity of ``combine`` for the allreduce (``init`` may be a variable). Each thread
    keeps GPU_UNROLL partials: element ``(k * GPU_UNROLL + u) * threads + tx`` goes to partial u (coalesced steps of
    GPU_UNROLL independent loads), the last partial step checks bounds.
    """
    lanes = T.alloc_buffer((GPU_UNROLL,), part.dtype, scope="local")
    for u in T.unroll(GPU_UNROLL):
        lanes[u] = init
    if active:
        for k in range(vocab // (threads * GPU_UNROLL)):
            for u in T.unroll(GPU_UNROLL):
                x: T.let = value((k * GPU_UNROLL + u) * threads + tx)
                lanes[u] = combine(lanes[u], x)
        for u in T.unroll(GPU_UNROLL):
            if vocab // (threads * GPU_UNROLL) * (threads * GPU_UNROLL) + u * threads + tx < vocab:
                lanes[u] = combine(lanes[u], value(vocab // (threads * GPU_UNROLL) * (threads * GPU_UNROLL)
                                                   + u * threads + tx))
    part[0] = lanes[0]
    for u in T.unroll(1, GPU_UNROLL):
        part[0] = combine(part[0], lanes[u])
    with T.attr(T.comm_reducer(combine, [identity]), "reduce_scope", T.reinterpret("handle", T.uint64(0))):
        T.tvm_thread_allreduce(T.uint32(1), part[0], True, out[0], tx, dtype="handle")


@T.macro
def gpu_row_map(y, r, vocab, tx, threads, value):
    """y[r, v] = value(v) for v < vocab, threads striding over the row, GPU_UNROLL elements per thread and step."""
    for k in range(vocab // (threads * GPU_UNROLL)):
        for u in T.unroll(GPU_UNROLL):
            y[r, (k * GPU_UNROLL + u) * threads + tx] = value((k * GPU_UNROLL + u) * threads + tx)
    for u in T.unroll(GPU_UNROLL):
        if vocab // (threads * GPU_UNROLL) * (threads * GPU_UNROLL) + u * threads + tx < vocab:
            y[r, vocab // (threads * GPU_UNROLL) * (threads * GPU_UNROLL) + u * threads + tx] = value(
                vocab // (threads * GPU_UNROLL) * (threads * GPU_UNROLL) + u * threads + tx)


@T.macro
def gpu_row_max(x, r, vocab, tx, threads, part, out):
    """out[0] = max(x[r, :vocab]) in every thread of the block."""
    gpu_row_fold(vocab, tx, threads, neg_inf(), neg_inf(), maximum, lambda v: x[r, v], True, part, out)


@T.macro
def gpu_row_sum_exp(x, r, vocab, shift, scale, tx, threads, part, out):
    """out[0] = sum(exp((x[r, :vocab] - shift) * scale)) in every thread of the block (guarded_exp)."""
    gpu_row_fold(vocab, tx, threads, T.float32(0), T.float32(0), add,
                 lambda v: shifted_exp(x[r, v], shift, scale, guarded_exp), True, part, out)


@T.macro
def gpu_first_index_of(x, r, vocab, value, active, tx, threads, part, out):
    """out[0] = lowest v with x[r, v] == value (vocab if none, or if the block-uniform ``active`` is false)."""
    gpu_row_fold(vocab, tx, threads, vocab, T.int32(INT32_MAX), minimum,
                 index_where(row_of(x, r), value, vocab), active, part, out)


def gpu_inclusive_scan(log_threads: int):
    """The macro ``scan(buf, part, tx)``: buf[tx] = buf[0] + ... + buf[tx] over a block of 2**log_threads threads
    (Hillis-Steele in shared memory; every thread wrote its buf[tx] and a barrier passed before the call; part: a
    local (1,) scratch of buf's dtype). Its barriers must be reached by the whole block."""

    @T.macro
    def scan(buf, part, tx):
        for k in T.unroll(log_threads):
            part[0] = buf[tx]
            if tx >= T.shift_left(1, k):
                part[0] = part[0] + buf[tx - T.shift_left(1, k)]
            T.tvm_storage_sync("shared")
            buf[tx] = part[0]
            T.tvm_storage_sync("shared")

    return scan
