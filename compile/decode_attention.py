# fmt: off
# ruff: noqa: F841, B007  (TVMScript: match_buffer declarations and loop variables read as unused)
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

(out = 0 and lse = -5e4 when ``n == 0``.) Keys carry RoPE already (the cache uses ``RopeMode.NORMAL``), so the
rotary arguments are unused; pages hold 16 tokens and the head size is a multiple of 8.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ..tir_kernels._common import fast_exp

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
LN2 = math.log(2)
EMPTY_LSE = -5e4
#: The score of a key slot past the end of a page (and the running max before any key): far below any real score,
#: its exponential underflows to exactly 0, and it stays finite (no inf - inf).
NO_SCORE = -1e30


@T.macro
def reduce_lanes(x, g, op, h4, out):
    """out[0] = op over the 8 lanes x[g, 0:8]: one 4-lane step, then scalars."""
    for lane in T.vectorized(4):
        h4[lane] = op(x[g, lane], x[g, lane + 4])
    out[0] = op(op(h4[0], h4[2]), op(h4[1], h4[3]))


@T.macro
def fold_scores(s, vec, run, row, h4, red):
    """Online softmax over one tile of scores ``s[row, 0:16]`` (log2 units, 16 = 2 x LANES): the running max
    ``run[0, row]`` and sum ``run[1, row]`` take the tile in, the scores become their weights, and ``run[2, row]``
    is the factor that rescales what was accumulated before the tile."""
    for lane in T.vectorized(LANES):
        vec[row, lane] = T.max(s[row, lane], s[row, lane + LANES])
    reduce_lanes(vec, row, T.max, h4, red)
    new_max: T.let = T.max(run[0, row], red[0])
    rescale: T.let = fast_exp((run[0, row] - new_max) * T.float32(LN2))
    for t in T.vectorized(2 * LANES):
        s[row, t] = fast_exp((s[row, t] - new_max) * T.float32(LN2))
    for lane in T.vectorized(LANES):
        vec[row, lane] = s[row, lane] + s[row, lane + LANES]
    reduce_lanes(vec, row, T.Add, h4, red)
    run[0, row] = new_max
    run[1, row] = run[1, row] * rescale + red[0]
    run[2, row] = rescale


def decode_attention_kernel(h_kv: int, h_q: int, d: int, dtype: str = "float32") -> tirx.PrimFunc:
    """The decode attention kernel for ``h_q`` query heads over ``h_kv`` KV heads of size ``d`` (see the module
    doc): TVM's ``batch_decode_paged_kv`` signature, pages ``[max_pages, 2, h_kv, 16, d]`` of ``dtype``."""
    if d % LANES:
        raise ValueError(f"head size {d} is not a multiple of {LANES}")
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"query heads {h_q} are not a multiple of KV heads {h_kv}")
    group = h_q // h_kv
    blocks = d // LANES

    @T.macro
    def chunk(unit, q, pages, page_indptr, page_values, length_info, part_acc, part_max, part_sum, sm_scale):
        """Unit ``unit`` = (sequence, KV head, chunk): its online softmax over its pages, into part_*."""
        qs = T.alloc_buffer((group, d), "float32", scope="local")
        acc = T.alloc_buffer((group, d), "float32", scope="local")
        s = T.alloc_buffer((group, PAGE_SIZE), "float32", scope="local")
        vec = T.alloc_buffer((group, LANES), "float32", scope="local")  # dot products, then V rows
        h4 = T.alloc_buffer((4,), "float32", scope="local")
        red = T.alloc_buffer((1,), "float32", scope="local")
        run = T.alloc_buffer((3, group), "float32", scope="local")  # running max, running sum, last rescale
        b: T.let = unit // (h_kv * SPLITS)
        hk: T.let = unit // SPLITS % h_kv
        first: T.let = page_indptr[b]
        n_pages: T.let = page_indptr[b + 1] - first
        n: T.let = T.Select(n_pages > 0, (n_pages - 1) * PAGE_SIZE + length_info[b], 0)
        per: T.let = T.max((n_pages + SPLITS - 1) // SPLITS, MIN_PAGES)
        p_begin: T.let = unit % SPLITS * per
        p_end: T.let = T.min(p_begin + per, n_pages)
        for g in range(group):
            run[0, g] = T.float32(NO_SCORE)
            run[1, g] = T.float32(0)
            for j in T.vectorized(d):
                qs[g, j] = T.Cast("float32", q[b, hk * group + g, j]) * (sm_scale * T.float32(LOG2E))
                acc[g, j] = T.float32(0)
        for p in range(p_begin, p_end):
            page: T.let = page_values[first + p]
            valid: T.let = T.min(PAGE_SIZE, n - p * PAGE_SIZE)
            # scores of the page's keys for the group's query heads (each key row read once)
            for t in range(PAGE_SIZE):
                for g in range(group):
                    for lane in T.vectorized(LANES):
                        vec[g, lane] = qs[g, lane] * T.Cast("float32", pages[page, 0, hk, t, lane])
                for blk in range(1, blocks):
                    for g in range(group):
                        for lane in T.vectorized(LANES):
                            vec[g, lane] = vec[g, lane] + qs[g, blk * LANES + lane] * T.Cast(
                                "float32", pages[page, 0, hk, t, blk * LANES + lane])
                for g in range(group):
                    reduce_lanes(vec, g, T.Add, h4, red)
                    s[g, t] = T.Select(t < valid, red[0], T.float32(NO_SCORE))
            # online softmax: new running max, rescale of what came before, this page's weights
            for g in range(group):
                fold_scores(s, vec, run, g, h4, red)
            # values: each accumulator block kept in registers over the page's rows
            for blk in range(blocks):
                for g in range(group):
                    for lane in T.vectorized(LANES):
                        vec[g, lane] = acc[g, blk * LANES + lane] * run[2, g]
                for t in range(valid):
                    for g in range(group):
                        for lane in T.vectorized(LANES):
                            vec[g, lane] = vec[g, lane] + s[g, t] * T.Cast(
                                "float32", pages[page, 1, hk, t, blk * LANES + lane])
                for g in range(group):
                    for lane in T.vectorized(LANES):
                        acc[g, blk * LANES + lane] = vec[g, lane]
        for g in range(group):
            part_max[unit, g] = run[0, g]
            part_sum[unit, g] = run[1, g]
            for j in T.vectorized(d):
                part_acc[unit, g, j] = acc[g, j]

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
        q = T.match_buffer(var_q, (batch_size, h_q, d), dtype)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, PAGE_SIZE, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_offset)
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_info_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (batch_size,), "int32", elem_offset=q_rope_offset)
        output = T.match_buffer(var_output, (batch_size, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (batch_size, h_q), "float32")
        # Per unit (sequence, KV head, chunk) and query head of the group: accumulator, running max, running sum.
        part_acc = T.alloc_buffer((batch_size * h_kv * SPLITS, group, d), "float32")
        part_max = T.alloc_buffer((batch_size * h_kv * SPLITS, group), "float32")
        part_sum = T.alloc_buffer((batch_size * h_kv * SPLITS, group), "float32")
        if nnz_pages <= SERIAL_PAGES:  # little work: no fork-join (which costs a time slice on a busy machine)
            for unit in range(batch_size * h_kv * SPLITS):
                chunk(unit, q, pages, page_indptr, page_values, length_info, part_acc, part_max, part_sum,
                      sm_scale)
        else:
            for unit in T.parallel(batch_size * h_kv * SPLITS):
                chunk(unit, q, pages, page_indptr, page_values, length_info, part_acc, part_max, part_sum,
                      sm_scale)
        for bh in range(batch_size * h_q):  # serial: a few microseconds, one fork-join less per layer
            total = T.alloc_buffer((d,), "float32", scope="local")
            stats = T.alloc_buffer((2,), "float32", scope="local")  # max over the chunks, weighted sum
            b: T.let = bh // h_q
            g: T.let = bh % h_q % group
            base: T.let = (b * h_kv + bh % h_q // group) * SPLITS
            stats[0] = T.float32(NO_SCORE)
            stats[1] = T.float32(0)
            for sp in range(SPLITS):
                stats[0] = T.max(stats[0], part_max[base + sp, g])
            for j in T.vectorized(d):
                total[j] = T.float32(0)
            for sp in range(SPLITS):
                weight: T.let = fast_exp((part_max[base + sp, g] - stats[0]) * T.float32(LN2))
                stats[1] = stats[1] + weight * part_sum[base + sp, g]
                for j in T.vectorized(d):
                    total[j] = total[j] + weight * part_acc[base + sp, g, j]
            if stats[1] > T.float32(0):
                for j in T.vectorized(d):
                    output[b, bh % h_q, j] = T.Cast(dtype, total[j] / stats[1])
                lse[b, bh % h_q] = stats[0] + T.log2(stats[1])
            else:
                for j in T.vectorized(d):
                    output[b, bh % h_q, j] = T.Cast(dtype, T.float32(0))
                lse[b, bh % h_q] = T.float32(EMPTY_LSE)

    return batch_decode_paged_kv


#: Names TVM's KV cache gives the CPU decode kernel this replaces (the function names in the exported module).
DECODE_NAMES = ("batch_decode_paged_kv_cpu", "tir_attention_decode_cpu")
