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

from ._common import CPU_LANES, EXP_UNDERFLOW, fast_exp, neg_inf

#: Elements per step of the CPU loops: four AVX-512 registers of partials, i.e. four independent chains.
CPU_WORD = 4 * CPU_LANES

#: Elements per first-level partial sum of the CPU folds (a multiple of CPU_WORD).
CPU_BLOCK = 16 * CPU_WORD

#: Largest finite float32; the inverse temperature is clamped to it.
FLT_MAX = 3.4028234663852886e38

#: Temperatures at or below this get the inverse temperature FLT_MAX (1 / t would overflow or divide by zero).
MIN_TEMPERATURE = 1e-38

#: Identity of the int32 min reduction.
INT32_MAX = 2**31 - 1

ExpFn = Callable[["tirx.PrimExpr"], "tirx.PrimExpr"]


def guarded_exp(z: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp(z) with the hardware exp, and exactly 0 where float32 exp underflows (z < EXP_UNDERFLOW, z = -inf)."""
    return T.Select(z < T.float32(EXP_UNDERFLOW), T.float32(0), T.exp(z))


def shifted_exp(x: tirx.PrimExpr, shift: tirx.PrimExpr, scale: tirx.PrimExpr, exp: ExpFn) -> tirx.PrimExpr:
    """The softmax numerator ``exp((x - shift) * scale)``: 1 at the row max, exactly 0 for x = -inf."""
    return exp((x - shift) * scale)


def safe_shift(row_max: tirx.PrimExpr) -> tirx.PrimExpr:
    """The value subtracted before exp: the row max, or 0 when the row is all -inf (so no -inf - -inf = NaN)."""
    return T.Select(row_max == neg_inf(), T.float32(0), row_max)


def inverse_temperature(t: tirx.PrimExpr) -> tirx.PrimExpr:
    """1 / t, or FLT_MAX for t <= MIN_TEMPERATURE (then exp((x - max) * scale) is 1 at the max and 0 elsewhere)."""
    return T.Select(t > T.float32(MIN_TEMPERATURE), T.float32(1) / t, T.float32(FLT_MAX))


def row_of(buf: tirx.Buffer, r: tirx.PrimExpr) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """``v -> buf[r, v]``: row r of a [batch, vocab] buffer as the per-token value the row macros take."""
    return lambda v: buf[r, v]


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
    cpu_row_fold(vocab, vocab, minimum, lambda v: T.Select(x[r, v] == value, v, vocab), None, r, lanes, block, out)


# ---------------------------------------------------------------------------------------------------------------- GPU


@T.macro
def gpu_row_fold(vocab, tx, threads, init, identity, combine, value, active, part, out):
    """out[0] = fold of value(v) over v < vocab in every thread of the block (``init`` if ``active`` is false).

    ``identity`` is a constant identity of ``combine`` for the allreduce (``init`` may be a variable).
    """
    part[0] = init
    if active:
        for k in range((vocab + threads - 1) // threads):
            if k * threads + tx < vocab:
                part[0] = combine(part[0], value(k * threads + tx))
    with T.attr(T.comm_reducer(combine, [identity]), "reduce_scope", T.reinterpret("handle", T.uint64(0))):
        T.tvm_thread_allreduce(T.uint32(1), part[0], True, out[0], tx, dtype="handle")


@T.macro
def gpu_row_map(y, r, vocab, tx, threads, value):
    """y[r, v] = value(v) for v < vocab, threads striding over the row."""
    for k in range((vocab + threads - 1) // threads):
        if k * threads + tx < vocab:
            y[r, k * threads + tx] = value(k * threads + tx)


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
                 lambda v: T.Select(x[r, v] == value, v, vocab), active, part, out)
