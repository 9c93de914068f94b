# fmt: off
# ruff: noqa: F841, B007, B023  (TVMScript: match_buffer declarations, loop variables, parse-time lambdas)
"""Split-K decode attention over TVM's paged KV cache: the ``batch_decode_paged_kv_cpu`` slot, for both threads.

TVM's CPU decode kernel is one serial loop over sequences, query heads and keys, reading every key and value once
per query head (three times per KV head with SmolLM2's 9/3 heads): at 3072 tokens of context it took most of a
decode step. Here each sequence's pages are split into ``SPLITS`` page-aligned chunks per KV head
(flash-decoding): the (sequence, KV head, chunk) units run in parallel, each streams its keys and values once for
all the query heads of its group and keeps an online softmax (running max, running sum, rescaled accumulator)
page by page; a short serial pass merges the chunks of each (sequence, query head) by their maxima.

Operation, for each sequence ``b`` (``n`` keys: ``(pages - 1) * page_size + length_info[b]``, 0 when it has no
pages; key ``c`` at ``pages[page_values[page_indptr[b] + c // 16], 0 or 1, kv_head, c % 16]``) and query head
``h`` (KV head ``h // (h_q // h_kv)``)::

    s[c] = dot(q[b, h], k[c]) * sm_scale * log2(e)     for c < n
    out[b, h] = sum_c 2^(s[c] - max s) v[c] / sum_c 2^(s[c] - max s)
    lse[b, h] = max s + log2(sum_c 2^(s[c] - max s))         # base 2, as the cache's merge expects

(out = 0 and lse = -5e4 when ``n == 0``.) Two options, fixed when the kernel is built (Gemma 2/3): ``softcap`` (> 0)
caps every score, ``s[c] = cap tanh(s[c] / cap)`` in natural units before the mask; ``window`` (> 0) is the
sliding window of the layers that pass a negative ``sm_scale`` (TVM's cache hands a kernel nothing per layer but
``sm_scale``: its sign marks a windowed layer and its magnitude carries the scale and the verify's exact mode,
``attention_mode.py``): the query at position ``q_rope_position[b]`` then sees only the keys at positions
``k_rope_pos_offset[b] + c`` less than ``window`` behind it (the pages stay allocated, not reclaimed; decode reads
only the pages from the one holding the window's first key). Keys carry RoPE already (the cache uses
``RopeMode.NORMAL``), so the rotary arguments are unused; pages hold 16 tokens and the head size is a multiple of 8.
"""

from __future__ import annotations

import math
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from ..tir_kernels._common import fast_exp
from . import attention_mode
from .kv_layout import Q8_BLOCK, KVLayout

PAGE_SIZE = 16
#: Chunks per (sequence, KV head): enough for two threads to share one sequence's heads evenly (3 x 8 units).
SPLITS = 8
#: Fewest pages in a chunk (short contexts stay in one or two chunks).
MIN_PAGES = 2
#: Up to this many pages in the whole batch the units run on one thread (tens of microseconds at most).
SERIAL_PAGES = 16
#: Vector lanes of the loops (one AVX2 register; LLVM lowers wider ones with shuffles through scalar registers).
LANES = 8
LOG2E = math.log2(math.e)
CACHE_LINE = 64
LN2 = math.log(2)
EMPTY_LSE = -5e4
#: The score of a key slot past the end of a page (and the running max before any key): far below any real score,
#: its exponential underflows to exactly 0, and it stays finite (no inf - inf).
NO_SCORE = -1e30


def tree_sum(terms: list[Any]) -> Any:
    """The sum of ``terms`` as a balanced tree (short dependency chains: the FMAs of a level run side by side)."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


def _intrin(name: str, dtype: str, *args: Any) -> Any:
    return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(name), *args, dtype=dtype)


def _hadd(a: Any, b: Any) -> Any:
    """AVX's ``vhaddps``: ``[a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]``."""
    return _intrin("llvm.x86.avx.hadd.ps.256", f"float32x{LANES}", a, b)


def _hadd_int(a: Any, b: Any) -> Any:
    """AVX2's ``vphaddd``: ``_hadd`` of int32 lanes."""
    return _intrin("llvm.x86.avx2.phadd.d", f"int32x{LANES}", a, b)


def transposed_sums(sums: list[Any], hadd: Any) -> Any:
    """The 8 lanes' sums of each of the 8 vectors ``sums`` as one vector (lane ``i``: the sum of ``sums[i]``): a
    transposing tree of ``hadd`` (``_hadd`` or ``_hadd_int``), then the two 128-bit halves added."""
    pairs = [hadd(sums[2 * i], sums[2 * i + 1]) for i in range(4)]
    low, high = hadd(pairs[0], pairs[1]), hadd(pairs[2], pairs[3])
    return (T.Shuffle([low, high], [0, 1, 2, 3, 8, 9, 10, 11])
            + T.Shuffle([low, high], [4, 5, 6, 7, 12, 13, 14, 15]))


def block_dot(q_abs: Any, q_codes: Any, keys: Any, vnni: bool) -> Any:
    """int32x8 whose lanes sum to ``dot(q_codes, keys)`` over one q8_0 block (int8x32 each; ``q_abs`` the codes'
    magnitudes as uint8x32): ``vpsignb`` gives the keys the codes' signs, then ``vpmaddubsw`` (unsigned x signed
    bytes, adjacent pairs into int16: at most 2 x 127 x 127, no saturation) and ``vpmaddwd`` with ones, or with
    ``vnni`` one ``vpdpbusd`` (AVX512-VNNI on 256 bits): the same int32 lanes."""
    signed = _intrin("llvm.x86.avx2.psign.b", "int8x32", keys, q_codes)
    if vnni:
        return _intrin("llvm.x86.avx512.vpdpbusd.256", f"int32x{LANES}", T.broadcast(T.int32(0), LANES), q_abs,
                       signed)
    return _intrin("llvm.x86.avx2.pmadd.wd", f"int32x{LANES}",
                   _intrin("llvm.x86.avx2.pmadd.ub.sw", "int16x16", q_abs, signed), T.broadcast(T.int16(1), 16))


@T.macro
def quantise_query(x, row, codes, q_abs, q_scale, amax, d):
    """Row ``row`` of ``x`` (float32, ``d`` values) as q8_0 blocks, as ``packed_matvec`` quantises activations
    (GGML's Q8_1 without the sums): per block ``b`` of 32, ``q_scale[row, b] = max|x| / 127`` and
    ``codes[row, j] = nearbyint(x[row, j] / q_scale)`` (int8, round half to even; 0 for an all-zero block),
    ``q_abs`` their magnitudes (uint8); ``amax``: a local float32 scratch of 8."""
    for b in range(d // Q8_BLOCK):
        for lane in T.vectorized(LANES):
            amax[lane] = T.max(T.max(T.abs(x[row, b * Q8_BLOCK + lane]), T.abs(x[row, b * Q8_BLOCK + 8 + lane])),
                               T.max(T.abs(x[row, b * Q8_BLOCK + 16 + lane]), T.abs(x[row, b * Q8_BLOCK + 24 + lane])))
        scale: T.let = T.max(T.max(T.max(amax[0], amax[1]), T.max(amax[2], amax[3])),
                             T.max(T.max(amax[4], amax[5]), T.max(amax[6], amax[7]))) / T.float32(127)
        inverse: T.let = T.Select(scale > T.float32(0), T.float32(1) / T.max(scale, T.float32(1e-30)), T.float32(0))
        for j in T.vectorized(Q8_BLOCK):
            codes[row, b * Q8_BLOCK + j] = T.Cast("int8", T.nearbyint(x[row, b * Q8_BLOCK + j] * inverse))
            q_abs[row, b * Q8_BLOCK + j] = T.Cast("uint8", T.abs(T.nearbyint(x[row, b * Q8_BLOCK + j] * inverse)))
        q_scale[row, b] = scale


@T.macro
def reduce_lanes(x, g, op, h4, out):
    """out[0] = op over the 8 lanes x[g, 0:8]: one 4-lane step, then scalars."""
    for lane in T.vectorized(4):
        h4[lane] = op(x[g, lane], x[g, lane + 4])
    out[0] = op(op(h4[0], h4[2]), op(h4[1], h4[3]))


@T.macro
def fold_scores(s, vec, run, row, head, h4, red):
    """Online softmax over one tile of scores ``s[row, 0:16]`` (log2 units, 16 = 2 x LANES): the running max
    ``run[0, head]`` and sum ``run[1, head]`` take the tile in, the scores become their weights, and
    ``run[2, head]`` is the factor that rescales what was accumulated before the tile."""
    for lane in T.vectorized(LANES):
        vec[row, lane] = T.max(s[row, lane], s[row, lane + LANES])
    reduce_lanes(vec, row, T.max, h4, red)
    new_max: T.let = T.max(run[0, head], red[0])
    rescale: T.let = fast_exp((run[0, head] - new_max) * T.float32(LN2))
    for t in T.vectorized(2 * LANES):
        s[row, t] = fast_exp((s[row, t] - new_max) * T.float32(LN2))
    for lane in T.vectorized(LANES):
        vec[row, lane] = s[row, lane] + s[row, lane + LANES]
    reduce_lanes(vec, row, T.Add, h4, red)
    run[0, head] = new_max
    run[1, head] = run[1, head] * rescale + red[0]
    run[2, head] = rescale


def soft_capped(score: Any, softcap: float, lanes: int = 1) -> Any:
    """``score`` (log2 units: natural times log2(e)) capped at ``softcap`` natural units (0: unchanged)."""
    if not softcap:
        return score
    cap = T.float32(softcap * LOG2E) if lanes == 1 else T.broadcast(T.float32(softcap * LOG2E), lanes)
    return cap * T.tanh(score / cap)


def first_visible(sm_scale: Any, q_position: Any, k_offset: Any, window: int) -> Any:
    """The index of the first key a query sees in a windowed layer (``attention_mode.windowed``: see the module doc),
    the keys' positions starting at ``k_offset``; 0 otherwise."""
    if not window:
        return T.int32(0)
    return T.Select(attention_mode.windowed(sm_scale), q_position - window + 1 - k_offset, 0)


def in_window(key: Any, first: Any, window: int, lanes: int, score: Any) -> Any:
    """``score`` where key index ``key`` >= ``first`` (``first_visible``), else ``NO_SCORE`` (no window: ``score``)."""
    if not window:
        return score
    no_score = T.float32(NO_SCORE) if lanes == 1 else T.broadcast(T.float32(NO_SCORE), lanes)
    return T.Select(key >= (first if lanes == 1 else T.broadcast(first, lanes)), score, no_score)


def check_options(softcap: float, window: int) -> None:
    """Refuses a negative ``softcap`` or ``window`` (0: none)."""
    if softcap < 0 or window < 0:
        raise ValueError(f"softcap {softcap} and window {window} must not be negative")


def check_heads(layout: KVLayout, h_q: int) -> int:
    """The query heads per KV head, after checking the sizes."""
    if layout.d % LANES:
        raise ValueError(f"head size {layout.d} is not a multiple of {LANES}")
    if layout.h_kv < 1 or h_q % layout.h_kv:
        raise ValueError(f"query heads {h_q} are not a multiple of KV heads {layout.h_kv}")
    return h_q // layout.h_kv


class RowAttention:
    """The decode algorithm for one query row, as TIR macros that the decode kernel and the exact (verify) mode of
    the paged prefill kernel share, so that a row's output does not depend on which of them computes it.

    A row ``row`` of ``q`` sees ``n`` keys laid out in pages of 16: page ``p < tail_from`` is
    ``pages[page_values[first + p]]``, page ``p >= tail_from`` is ``tail[tail_first + p - tail_from]`` (a copy of
    the last cached page completed with the row's sequence's new tokens; ``pages8``/``tail8``: the same memory as
    int8, for q8_0 pages). ``chunk`` computes unit ``unit % SPLITS``
    of the row (pages ``[c per, (c + 1) per)``, ``per = max(ceil(pages / SPLITS), MIN_PAGES)``) into
    ``part_*[unit]``; ``merge`` combines the row's ``SPLITS`` parts into its output and log-sum-exp. Every query
    head of the row goes through the same operations in the same order whichever kernel runs them. With a
    ``window``, ``first_key`` is the index of the row's first visible key (``first_visible``; 0 otherwise): the keys
    before it are masked and the chunks split only the pages from the one that holds it; ``softcap`` caps the
    scores (see the module doc).

    On a q8_0 cache the scores are integer dot products, as llama.cpp's ``vec_dot_q8_0_q8_0``: each query head's
    scaled q (``q sm_scale log2(e)``) is quantised once per chunk into q8_0 blocks (``quantise_query``), and a key's
    score is ``sum_b q_scale[b] k_scale[b] sum_j q_code[32 b + j] k_code[32 b + j]`` (the int8 products summed in
    int32 per block, ``block_dot``; 8 keys' block sums transposed into one vector by ``vphaddd``, then one
    conversion and one multiply by the 8 keys' scale products). A value row is widened once for the query heads of
    its KV head, its scale folded into each head's weight (``vnni``: the block sums by ``vpdpbusd``, the same
    integers)."""

    def __init__(self, layout: KVLayout, h_q: int, softcap: float = 0.0, window: int = 0,
                 vnni: bool = False) -> None:
        group = check_heads(layout, h_q)
        check_options(softcap, window)
        d, dtype, h_kv = layout.d, layout.dtype, layout.h_kv
        blocks = d // LANES
        q8_blocks = max(1, d // Q8_BLOCK)  # q8_0 blocks of a head (the q8_0 buffers' size; 1 unused otherwise)
        words = 2 * layout.heads * PAGE_SIZE * d  # elements of a page (keys and values of every KV head)
        page_lines = words * layout.row_bytes // d // CACHE_LINE

        def prefetch(pages, page, line):
            """Ask for cache line ``line`` of page ``page`` (``llvm.prefetch``: read, keep in all cache levels)."""
            return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(pages[page, 0, 0, 0, line * (
                words // page_lines)]), T.int32(0), T.int32(3), T.int32(1))

        def key_sum(qs, h, pages, pages8, page, hk, t):
            """float32x8 whose lanes sum to key ``t``'s dot product with ``qs[h]`` (float caches)."""
            at = lambda r, o: [page, 0, r, t, o]  # noqa: E731
            return tree_sum([qs.vload([h, blk * LANES], f"float32x{LANES}") * layout.raw(pages, pages8, at, hk,
                                                                                          blk * LANES)
                             for blk in range(blocks)])

        def scores8(qs, h, pages, pages8, page, hk, t0):
            """float32x8: the scores of keys ``t0 .. t0 + 7`` of a page of KV head ``hk`` against ``qs``: each key's
            8-lane products summed as a tree, then the 8 keys' lanes summed by a transposing ``vhaddps`` tree."""
            return transposed_sums([key_sum(qs, h, pages, pages8, page, hk, t0 + i) for i in range(LANES)], _hadd)

        def scores8_q8(codes, q_abs, q_scale, k_scale, h, pages8, page, hk, t0):
            """float32x8: the scores of keys ``t0 .. t0 + 7`` of a q8_0 page of KV head ``hk`` against query head
            ``h``'s codes: per block the 8 keys' int32 sums (``block_dot``, transposed by ``vphaddd``) converted
            once and scaled by ``q_scale[h, b] * k_scale[hk, b, t]``, the blocks summed as a tree."""
            parts = []
            for b in range(d // Q8_BLOCK):
                sums = [block_dot(q_abs.vload([h, b * Q8_BLOCK], "uint8x32"), codes.vload([h, b * Q8_BLOCK], "int8x32"),
                                  pages8.vload([page, 0, hk // 2, t0 + i, hk % 2 * d + b * Q8_BLOCK], "int8x32"), vnni)
                        for i in range(LANES)]
                parts.append(T.Cast(f"float32x{LANES}", transposed_sums(sums, _hadd_int))
                             * (T.broadcast(q_scale[h, b], LANES) * k_scale[hk, b, T.ramp(t0, 1, LANES)]))
            return tree_sum(parts)

        def weighted_rows(s, h, pages, pages8, page, hk, t0, blk):
            """float32x8: lanes ``blk * 8 ..`` of ``sum_t s[h, t] v[t]`` over value rows ``t0 .. t0 + 7`` (float
            caches)."""
            return tree_sum([T.broadcast(s[h, t0 + t], LANES) * layout.raw(
                pages, pages8, lambda r, o: [page, 1, r, t0 + t, o], hk, blk * LANES) for t in range(LANES)])

        def masked(scores, p, half, first_key, valid):
            """float32x8: tile ``half`` of page ``p``'s scores, capped, ``NO_SCORE`` past ``valid`` slots and
            outside the window."""
            return T.Select(T.ramp(half * LANES, 1, LANES) < T.broadcast(valid, LANES),
                            in_window(T.ramp(p * PAGE_SIZE + half * LANES, 1, LANES), first_key, window, LANES,
                                      soft_capped(scores, softcap, LANES)),
                            T.broadcast(T.float32(NO_SCORE), LANES))

        @T.macro
        def partial_values(src, src8, page, valid, acc, s, run):
            """The values of the sequence's last page, partly filled (the slots past it may hold anything)."""
            for h in range(h_q):
                for j in T.vectorized(d):
                    acc[h, j] = acc[h, j] * run[2, h]
                for t in range(valid):
                    for j in T.vectorized(d):
                        acc[h, j] = acc[h, j] + s[h, t] * layout.value(
                            src, src8, lambda r, o: [page, 1, r, t, o], h // group, j)

        @T.macro
        def one_page(src, src8, page, p, first_key, valid, qs, codes, q_abs, q_scale, k_scale, weights, values, row,
                     acc, s, vec, h4, red, run):
            """Page ``page`` of a float cache ``src`` (its first ``valid`` slots; the row's page ``p``): the scores of
            every query head (its scaled q in 8 registers, the key rows from L1; capped, and masked outside the
            window), then the online softmax of every head (independent chains that the CPU overlaps), then the
            values of every head."""
            for h in range(h_q):
                for half in T.unroll(PAGE_SIZE // LANES):
                    s[h, T.ramp(half * LANES, 1, LANES)] = masked(
                        scores8(qs, h, src, src8, page, h // group, half * LANES), p, half, first_key, valid)
            for h in range(h_q):
                fold_scores(s, vec, run, h, h, h4, red)
            if valid == PAGE_SIZE:  # a full page: 8 weights broadcast into registers, 8 value rows per FMA tree
                for h in range(h_q):
                    for half in T.unroll(PAGE_SIZE // LANES):
                        for blk in T.unroll(blocks):
                            acc[h, T.ramp(blk * LANES, 1, LANES)] = (
                                acc[h, T.ramp(blk * LANES, 1, LANES)]
                                * T.broadcast(T.Select(half == 0, run[2, h], T.float32(1)), LANES)
                                + weighted_rows(s, h, src, src8, page, h // group, half * LANES, blk))
            else:
                partial_values(src, src8, page, valid, acc, s, run)

        @T.macro
        def scales_of(src, page, kv, k_scale):
            """``k_scale[hk, b, t]``: the q8_0 scales of block ``b`` of KV head ``hk``'s keys (``kv`` 0) or values
            (1) in the 16 slots of page ``page``."""
            for hk in T.unroll(h_kv):
                for b in T.unroll(d // Q8_BLOCK):
                    for t in T.vectorized(PAGE_SIZE):  # strided float16 loads, one conversion per 8
                        k_scale[hk, b, t] = layout.scale(src, lambda r, o: [page, kv, r, t, o], hk, b * Q8_BLOCK)

        @T.macro
        def one_page_q8(src, src8, page, p, first_key, valid, qs, codes, q_abs, q_scale, k_scale, weights, values,
                        row, acc, s, vec, h4, red, run):
            """``one_page`` for a q8_0 cache: integer-dot scores (the class doc); with a full page, each value row
            widened once for the query heads of its KV head and added with their weights times its scale."""
            scales_of(src, page, 0, k_scale)
            for h in range(h_q):
                for half in T.unroll(PAGE_SIZE // LANES):
                    s[h, T.ramp(half * LANES, 1, LANES)] = masked(
                        scores8_q8(codes, q_abs, q_scale, k_scale, h, src8, page, h // group, half * LANES), p, half,
                        first_key, valid)
            for h in range(h_q):
                fold_scores(s, vec, run, h, h, h4, red)
            if valid == PAGE_SIZE:
                scales_of(src, page, 1, k_scale)
                for h in range(h_q):
                    for b in range(d // Q8_BLOCK):
                        for t in T.vectorized(PAGE_SIZE):
                            weights[h, b, t] = s[h, t] * k_scale[h // group, b, t]
                for hk in range(h_kv):
                    for blk in T.unroll(blocks):
                        for g in T.unroll(group):
                            for lane in T.vectorized(LANES):
                                values[g, lane] = acc[hk * group + g, blk * LANES + lane] * run[2, hk * group + g]
                        for t in T.unroll(PAGE_SIZE):
                            for lane in T.vectorized(LANES):
                                row[lane] = T.Cast("float32", src8[page, 1, hk // 2, t, hk % 2 * d + blk * LANES
                                                                   + lane])
                            for g in T.unroll(group):
                                for lane in T.vectorized(LANES):
                                    values[g, lane] = values[g, lane] + weights[
                                        hk * group + g, blk // (Q8_BLOCK // LANES), t] * row[lane]
                        for g in T.unroll(group):
                            for lane in T.vectorized(LANES):
                                acc[hk * group + g, blk * LANES + lane] = values[g, lane]
            else:
                partial_values(src, src8, page, valid, acc, s, run)

        attend_page = one_page_q8 if layout.quantized else one_page

        @T.macro
        def chunk(unit, q, q_row, n, first_key, first, tail_from, tail_first, page_values, pages, pages8, tail,
                  tail8, part_acc, part_max, part_sum, scale):
            """Unit ``unit`` of row ``q_row``: the online softmax of every query head over its pages, page after
            page (a page of every head is contiguous: the chunk streams from memory in order, and the next page is
            prefetched while this one is read)."""
            qs = T.alloc_buffer((h_q, d), "float32", scope="local")
            codes = T.alloc_buffer((h_q, d), "int8", scope="local")  # q8_0: the query's codes, scales
            q_abs = T.alloc_buffer((h_q, d), "uint8", scope="local")
            q_scale = T.alloc_buffer((h_q, q8_blocks), "float32", scope="local")
            k_scale = T.alloc_buffer((h_kv, q8_blocks, PAGE_SIZE), "float32", scope="local")
            weights = T.alloc_buffer((h_q, q8_blocks, PAGE_SIZE), "float32", scope="local")
            values = T.alloc_buffer((group, LANES), "float32", scope="local")  # q8_0: value accumulators
            row = T.alloc_buffer((LANES,), "float32", scope="local")
            acc = T.alloc_buffer((h_q, d), "float32", scope="local")
            s = T.alloc_buffer((h_q, PAGE_SIZE), "float32", scope="local")
            vec = T.alloc_buffer((h_q, LANES), "float32", scope="local")
            h4 = T.alloc_buffer((4,), "float32", scope="local")
            red = T.alloc_buffer((1,), "float32", scope="local")
            amax = T.alloc_buffer((LANES,), "float32", scope="local")
            run = T.alloc_buffer((3, h_q), "float32", scope="local")  # running max, running sum, last rescale
            n_pages: T.let = (n + PAGE_SIZE - 1) // PAGE_SIZE
            p_first: T.let = T.min(T.max(first_key, 0) // PAGE_SIZE, n_pages)
            per: T.let = T.max((n_pages - p_first + SPLITS - 1) // SPLITS, MIN_PAGES)
            p_begin: T.let = p_first + unit % SPLITS * per
            p_end: T.let = T.min(p_begin + per, n_pages)
            cached_end: T.let = T.min(p_end, tail_from)
            for h in range(h_q):
                run[0, h] = T.float32(NO_SCORE)
                run[1, h] = T.float32(0)
                for j in T.vectorized(d):
                    qs[h, j] = T.Cast("float32", q[q_row, h, j]) * (scale * T.float32(LOG2E))
                    acc[h, j] = T.float32(0)
                if layout.quantized:
                    quantise_query(qs, h, codes, q_abs, q_scale, amax, d)
            for p in range(p_begin, p_end):
                valid: T.let = T.min(PAGE_SIZE, n - p * PAGE_SIZE)
                if p < tail_from:
                    if p + 1 < cached_end:
                        for line in range(page_lines):
                            prefetch(pages, page_values[first + p + 1], line)
                    attend_page(pages, pages8, page_values[first + p], p, first_key, valid, qs, codes, q_abs, q_scale,
                                k_scale, weights, values, row, acc, s, vec, h4, red, run)
                else:
                    attend_page(tail, tail8, tail_first + p - tail_from, p, first_key, valid, qs, codes, q_abs,
                                q_scale, k_scale, weights, values, row, acc, s, vec, h4, red, run)
            for h in range(h_q):
                part_max[unit, h] = run[0, h]
                part_sum[unit, h] = run[1, h]
                for j in T.vectorized(d):
                    part_acc[unit, h, j] = acc[h, j]

        @T.macro
        def merge(unit0, out_row, h, part_acc, part_max, part_sum, output, lse):
            """Query head ``h`` of a row from its ``SPLITS`` parts ``unit0 ..``: ``output[out_row, h]`` and
            ``lse[out_row, h]`` (0 and ``EMPTY_LSE`` when the row sees no key)."""
            total = T.alloc_buffer((d,), "float32", scope="local")
            stats = T.alloc_buffer((2,), "float32", scope="local")  # max over the chunks, weighted sum
            stats[0] = T.float32(NO_SCORE)
            stats[1] = T.float32(0)
            for sp in range(SPLITS):
                stats[0] = T.max(stats[0], part_max[unit0 + sp, h])
            for j in T.vectorized(d):
                total[j] = T.float32(0)
            for sp in range(SPLITS):
                weight: T.let = fast_exp((part_max[unit0 + sp, h] - stats[0]) * T.float32(LN2))
                stats[1] = stats[1] + weight * part_sum[unit0 + sp, h]
                for j in T.vectorized(d):
                    total[j] = total[j] + weight * part_acc[unit0 + sp, h, j]
            if stats[0] > T.float32(NO_SCORE):  # some key seen (none: every score masked)
                for j in T.vectorized(d):
                    output[out_row, h, j] = T.Cast(dtype, total[j] / stats[1])
                lse[out_row, h] = stats[0] + T.log2(stats[1])
            else:
                for j in T.vectorized(d):
                    output[out_row, h, j] = T.Cast(dtype, T.float32(0))
                lse[out_row, h] = T.float32(EMPTY_LSE)

        self.chunk = chunk
        self.merge = merge


def decode_attention_kernel(h_kv: int, h_q: int, d: int, kv_dtype: str = "float32", softcap: float = 0.0,
                            window: int = 0, vnni: bool = False) -> tirx.PrimFunc:
    """The decode attention kernel for ``h_q`` query heads over ``h_kv`` KV heads of size ``d`` (see the module
    doc): TVM's ``batch_decode_paged_kv`` signature; pages ``[max_pages, 2, heads, 16, d]``, q and the output
    with ``query_heads`` heads (the carried ones are not read, nor written), all of the cache's element type
    (``kv_layout.KVLayout``: float32 or float16, widened to float32 as they are loaded, F16C's ``vcvtph2ps``; q8_0
    blocks: integer dot products with q quantised per block, ``RowAttention``; AVX2, ``vnni``: AVX512-VNNI's
    ``vpdpbusd``, the same results). ``sm_scale`` carries the scale, the window switch and the exact mode
    (``attention_mode.py``; a decode step is exact whichever: the verify forward may reach this kernel);
    ``softcap`` and ``window`` as the module doc says (0: none)."""
    layout = KVLayout(kv_dtype, h_kv, d)
    rows = RowAttention(layout, h_q, softcap, window, vnni)
    heads, dtype, stored = layout.query_heads(h_q), layout.dtype, layout.heads
    row_bytes = layout.row_bytes

    @T.prim_func(private=True)
    def batch_decode_paged_kv(
        var_q: T.handle, var_pages: T.handle, var_page_indptr: T.handle, var_page_values: T.handle,
        var_length_info: T.handle, var_k_rope_pos_offset: T.handle, var_q_rope_position: T.handle,
        var_output: T.handle, var_lse: T.handle,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        batch_size, nnz_pages, max_num_pages = T.int32(), T.int32(), T.int32()
        page_indptr_offset, page_values_offset, length_info_offset = T.int32(), T.int32(), T.int32()
        k_rope_offset, q_rope_offset = T.int32(), T.int32()
        q = T.match_buffer(var_q, (batch_size, heads, d), dtype)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, stored, PAGE_SIZE, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_offset)
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_info_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (batch_size,), "int32", elem_offset=q_rope_offset)
        output = T.match_buffer(var_output, (batch_size, heads, d), dtype)
        lse = T.match_buffer(var_lse, (batch_size, heads), "float32")
        pages8 = T.decl_buffer((max_num_pages, 2, stored, PAGE_SIZE, row_bytes), "int8", data=pages.data)
        # Per unit (sequence, chunk) and query head: accumulator, running max, running sum.
        part_acc = T.alloc_buffer((batch_size * SPLITS, h_q, d), "float32")
        part_max = T.alloc_buffer((batch_size * SPLITS, h_q), "float32")
        part_sum = T.alloc_buffer((batch_size * SPLITS, h_q), "float32")
        scale: T.let = attention_mode.scale(sm_scale)
        if nnz_pages <= SERIAL_PAGES:  # little work: no fork-join (which costs a time slice on a busy machine)
            for unit in range(batch_size * SPLITS):
                b: T.let = unit // SPLITS
                n_pages: T.let = page_indptr[b + 1] - page_indptr[b]
                rows.chunk(unit, q, b, T.Select(n_pages > 0, (n_pages - 1) * PAGE_SIZE + length_info[b], 0),
                           first_visible(sm_scale, q_rope_position[b], k_rope_pos_offset[b], window),
                           page_indptr[b], n_pages, 0, page_values, pages, pages8, pages, pages8, part_acc,
                           part_max, part_sum, scale)
        else:
            for unit in T.parallel(batch_size * SPLITS):
                b: T.let = unit // SPLITS
                n_pages: T.let = page_indptr[b + 1] - page_indptr[b]
                rows.chunk(unit, q, b, T.Select(n_pages > 0, (n_pages - 1) * PAGE_SIZE + length_info[b], 0),
                           first_visible(sm_scale, q_rope_position[b], k_rope_pos_offset[b], window),
                           page_indptr[b], n_pages, 0, page_values, pages, pages8, pages, pages8, part_acc,
                           part_max, part_sum, scale)
        for bh in range(batch_size * h_q):  # serial: a few microseconds, one fork-join less per layer
            rows.merge(bh // h_q * SPLITS, bh // h_q, bh % h_q, part_acc, part_max, part_sum, output, lse)

    return batch_decode_paged_kv


#: Names TVM's KV cache gives the CPU decode kernel this replaces (the function names in the exported module).
DECODE_NAMES = ("batch_decode_paged_kv_cpu", "tir_attention_decode_cpu")
