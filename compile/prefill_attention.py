# fmt: off
# ruff: noqa: F841, B007, B023  (TVMScript: match_buffer declarations, loop variables, parse-time lambdas)
"""Tiled (flash-attention style) CPU prefill attention for TVM's paged KV cache: its two prefill slots.

TVM's KV cache computes a prefill in two parts, merged by their log-sum-exps: the new tokens against themselves
(``tir_attention_prefill_ragged_cpu``) and against the sequence's earlier tokens in the pages
(``tir_attention_prefill_cpu``). TVM's CPU kernels for both are serial scalar loops. Here the work is split into
units of ``query_block`` consecutive query tokens of one sequence and one KV head (all the query heads of its group:
48 rows with SmolLM2's 9/3 heads, 16 tokens; 32 with Llama 3.2 1B's 32/8, 8 tokens), in parallel; a unit walks the
keys in tiles of 16 (a page, for the paged part), widens each key and value row once for all its rows, which are
the lanes of its score vectors (``_attend_block``), and keeps an online softmax per row (running max, running sum,
rescaled accumulator), so nothing grows with the context. Units are ordered so that both threads get as many early
(short, causal) as late (long) blocks.

Operation, for each query token ``i`` of sequence ``b`` (position ``r = i - q_indptr[b]`` among its
``qo = q_indptr[b + 1] - q_indptr[b]`` new tokens) and each query head ``h`` (KV head ``h // (h_q // h_kv)``)::

    n = min(kv_len_b - qo + r + 1, kv_len_b) if causal else kv_len_b       # keys visible to this query
    s[c] = dot(q[i, h], k[c]) * sm_scale * log2(e)   for c < n
    out[i, h] = sum_c 2^(s[c] - max s) v[c] / sum_c 2^(s[c] - max s)
    lse[i, h] = max s + log2(sum_c 2^(s[c] - max s))          # base 2, as the cache's merge expects

(out = 0 and lse = -5e4 when ``n <= 0``.) ``softcap`` and ``window`` (Gemma 2/3; 0: none) as in
``decode_attention.py``: the scores capped, and in a layer whose ``sm_scale`` marks it windowed
(``attention_mode.py``) each query sees only the keys less than ``window`` positions behind it (by
``q_rope_position`` and ``k_rope_pos_offset``). The keys are ``k[kv_indptr[b] + c]`` (ragged) or the sequence's
pages (paged: ``kv_len_b = (pages - 1) * 16 + length_info[b]``). RoPE has already been applied to q and k (the
cache uses ``RopeMode.NORMAL``), so the rotary arguments are unused; pages hold 16 tokens.
"""

from __future__ import annotations

from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from ..tir_kernels._common import fast_exp
from . import attention_mode
from .decode_attention import (
    EMPTY_LSE,
    LANES,
    LN2,
    LOG2E,
    NO_SCORE,
    PAGE_SIZE,
    SERIAL_PAGES,
    SPLITS,
    RowAttention,
    check_heads,
    check_options,
    first_visible,
    quantise_query,
    soft_capped,
)
from .kv_layout import Q8_BLOCK, KVLayout

#: Fewest query tokens per unit of work (times the query heads of a KV head: the rows sharing each key tile).
QUERY_BLOCK = 8
#: Keys per tile (a page).
TILE = PAGE_SIZE
#: The rows of a unit are the lanes of the scores' vectors: a multiple of this (one AVX-512 register of float32;
#: LLVM splits vectors of other widths, 24 lanes, into pieces that ran SmolLM2's block at a third of the speed).
ROW_LANES = 16


def query_block(group: int) -> int:
    """Query tokens per unit with ``group`` query heads per KV head: ``QUERY_BLOCK``, or twice that where its rows
    (``QUERY_BLOCK * group``) would not be a multiple of ``ROW_LANES``."""
    return QUERY_BLOCK if QUERY_BLOCK * group % ROW_LANES == 0 else 2 * QUERY_BLOCK


def key_group(rows: int) -> int:
    """Keys scored side by side (independent accumulator chains: keys x the rows' vectors, at most 16 registers)."""
    return max(1, min(4, 16 * ROW_LANES // rows))


def _over_keys(s: Any, r: Any, op: Any) -> Any:
    """``op`` over ``s[t, r]`` for the tile's keys ``t`` (a balanced tree: short dependency chains)."""
    terms = [s[t, r] for t in range(TILE)]
    while len(terms) > 1:
        terms = [op(terms[i], terms[i + 1]) for i in range(0, len(terms), 2)]
    return terms[0]


def _visible(c: Any, limit: Any, first: Any, r: Any, window: int) -> Any:
    """Whether row ``r`` sees key ``c``: before its ``limit`` and, with a ``window``, from its ``first`` key on."""
    if not window:
        return c < limit[r]
    return T.And(c < limit[r], c >= first[r])


@T.macro
def _attend_block(q, i0, rows_q, hk, group, d, limit, n_max, key, value, output, lse, scale, dtype, first_key,
                  window, softcap, quantized, q8_blocks, rows, kg_size):
    """Rows (query token i0 + tq, head hk * group + g) for tq < rows_q, each seeing keys c < limit[tq] (and, with a
    ``window``, c >= first_key[tq]), against keys key(c, j) and values value(c, j) (float32) for c < n_max, the
    scores scaled by ``scale`` and capped by ``softcap``; writes output and lse of those rows. ``rows``: the
    block's rows (``query_block(group) * group``; those past ``rows_q * group`` are computed on zero queries and
    dropped); ``kg_size`` keys scored side by side (``key_group``).
    ``quantized`` (a q8_0 cache): the scaled q rounded through q8_0 blocks as the decode kernel quantises it
    (``quantise_query``, ``q8_blocks`` of them), so that both kernels score with the same query.

    The rows are the vector lanes of the scores and of the online softmax: the scaled queries are transposed once
    (``qt[j, r]``), the tile's keys and values widened to float32 once (``kt``, ``vt``: shared by all the rows), a
    key's scores are ``sum_j qt[j, :] * kt[c, j]`` (one FMA per dimension for 16 rows, the key's element broadcast;
    ``kg_size`` keys side by side), and the tile's scores ``s[t, r]`` are folded into every row's running max and
    sum at once; then each row's accumulator takes the tile's values (two rows at a time, sharing each value load)."""
    qs = T.alloc_buffer((rows, d), "float32")
    qt = T.alloc_buffer((d, rows), "float32")
    codes = T.alloc_buffer((rows, d), "int8", scope="local")
    q_abs = T.alloc_buffer((rows, d), "uint8", scope="local")
    q_scale = T.alloc_buffer((rows, q8_blocks), "float32", scope="local")
    amax = T.alloc_buffer((LANES,), "float32", scope="local")
    lim = T.alloc_buffer((rows,), "int32")
    first = T.alloc_buffer((rows,), "int32")
    acc = T.alloc_buffer((rows, d), "float32")
    s = T.alloc_buffer((TILE, rows), "float32")
    sacc = T.alloc_buffer((kg_size, rows), "float32", scope="local")
    kt = T.alloc_buffer((TILE, d), "float32")
    vt = T.alloc_buffer((TILE, d), "float32")
    run = T.alloc_buffer((3, rows), "float32")  # running max, running sum, last rescale
    new_max = T.alloc_buffer((rows,), "float32")
    acc_row = T.alloc_buffer((2, d), "float32", scope="local")
    for r in range(rows):
        if r < rows_q * group:
            lim[r] = limit[r // group]
            first[r] = first_key[r // group]
            for j in T.vectorized(d):
                qs[r, j] = T.Cast("float32", q[i0 + r // group, hk * group + r % group, j]) * (
                    scale * T.float32(LOG2E))
            if quantized:
                quantise_query(qs, r, codes, q_abs, q_scale, amax, d)
                for j in T.vectorized(d):
                    qs[r, j] = T.Cast("float32", codes[r, j]) * q_scale[r, j // Q8_BLOCK]
        else:
            lim[r] = 0
            first[r] = 0
            for j in T.vectorized(d):
                qs[r, j] = T.float32(0)
        run[0, r] = T.float32(NO_SCORE)
        run[1, r] = T.float32(0)
        for j in T.vectorized(d):
            acc[r, j] = T.float32(0)
    for j, r in T.grid(d, rows):
        qt[j, r] = qs[r, j]
    for tile in range((n_max + TILE - 1) // TILE):
        c0: T.let = tile * TILE
        in_tile: T.let = T.min(TILE, n_max - c0)
        # the tile's keys and values in float32 (slots past n_max: the last key again, its scores masked)
        for t in range(TILE):
            for j in T.vectorized(d):
                kt[t, j] = key(T.min(c0 + t, n_max - 1), j)
        for t in range(in_tile):
            for j in T.vectorized(d):
                vt[t, j] = value(c0 + t, j)
        # scores: every row of kg_size keys at once (the rows in vectors of ROW_LANES)
        for kg in range(TILE // kg_size):
            if kg * kg_size < in_tile:
                for kk, rc in T.grid(kg_size, rows // ROW_LANES):
                    for r in T.vectorized(ROW_LANES):
                        sacc[kk, rc * ROW_LANES + r] = T.float32(0)
                for j in range(d):
                    for kk in T.unroll(kg_size):
                        for rc in T.unroll(rows // ROW_LANES):
                            for r in T.vectorized(ROW_LANES):
                                sacc[kk, rc * ROW_LANES + r] = sacc[kk, rc * ROW_LANES + r] + qt[
                                    j, rc * ROW_LANES + r] * kt[kg * kg_size + kk, j]
                for kk in T.unroll(kg_size):
                    c: T.let = c0 + kg * kg_size + kk
                    for rc in T.unroll(rows // ROW_LANES):
                        for r in T.vectorized(ROW_LANES):
                            s[kg * kg_size + kk, rc * ROW_LANES + r] = T.Select(
                                _visible(c, lim, first, rc * ROW_LANES + r, window),
                                soft_capped(sacc[kk, rc * ROW_LANES + r], softcap), T.float32(NO_SCORE))
            else:
                for kk, rc in T.grid(kg_size, rows // ROW_LANES):
                    for r in T.vectorized(ROW_LANES):
                        s[kg * kg_size + kk, rc * ROW_LANES + r] = T.float32(NO_SCORE)
        # online softmax, every row at once
        for rc in range(rows // ROW_LANES):
            for r in T.vectorized(ROW_LANES):
                new_max[rc * ROW_LANES + r] = T.max(run[0, rc * ROW_LANES + r],
                                                    _over_keys(s, rc * ROW_LANES + r, T.max))
            for r in T.vectorized(ROW_LANES):
                run[2, rc * ROW_LANES + r] = fast_exp(
                    (run[0, rc * ROW_LANES + r] - new_max[rc * ROW_LANES + r]) * T.float32(LN2))
            for t in T.unroll(TILE):
                for r in T.vectorized(ROW_LANES):
                    s[t, rc * ROW_LANES + r] = fast_exp(
                        (s[t, rc * ROW_LANES + r] - new_max[rc * ROW_LANES + r]) * T.float32(LN2))
            for r in T.vectorized(ROW_LANES):
                run[1, rc * ROW_LANES + r] = run[1, rc * ROW_LANES + r] * run[2, rc * ROW_LANES + r] + _over_keys(
                    s, rc * ROW_LANES + r, T.Add)
                run[0, rc * ROW_LANES + r] = new_max[rc * ROW_LANES + r]
        # values: two rows' accumulators (d lanes each) in registers over the tile
        for r2 in range(rows // 2):
            for h in T.unroll(2):
                for j in T.vectorized(d):
                    acc_row[h, j] = acc[2 * r2 + h, j] * run[2, 2 * r2 + h]
            for t in range(in_tile):
                for j in T.vectorized(d):
                    acc_row[0, j] = acc_row[0, j] + s[t, 2 * r2] * vt[t, j]
                    acc_row[1, j] = acc_row[1, j] + s[t, 2 * r2 + 1] * vt[t, j]
            for h in T.unroll(2):
                for j in T.vectorized(d):
                    acc[2 * r2 + h, j] = acc_row[h, j]
    for r in range(rows_q * group):
        if run[0, r] > T.float32(NO_SCORE):  # some key seen (none: every score masked)
            for j in T.vectorized(d):
                output[i0 + r // group, hk * group + r % group, j] = T.Cast(dtype, acc[r, j] / run[1, r])
            lse[i0 + r // group, hk * group + r % group] = run[0, r] + T.log2(run[1, r])
        else:
            for j in T.vectorized(d):
                output[i0 + r // group, hk * group + r % group, j] = T.Cast(dtype, T.float32(0))
            lse[i0 + r // group, hk * group + r % group] = T.float32(EMPTY_LSE)


def ragged_prefill_kernel(h_kv: int, h_q: int, d: int, kv_dtype: str = "float32", softcap: float = 0.0,
                          window: int = 0) -> tirx.PrimFunc:
    """New tokens against themselves: the ``tir_attention_prefill_ragged_cpu`` slot of the KV cache. In the
    exact mode (``attention_mode.exact``: the verify forward) every row's output is 0 and its lse ``EMPTY_LSE``:
    the paged kernel computes the rows whole (the cache's merge then passes its result through unchanged)."""
    layout = KVLayout(kv_dtype, h_kv, d)
    group = check_heads(layout, h_q)
    check_options(softcap, window)
    heads, dtype, stored, row_bytes = layout.query_heads(h_q), layout.dtype, layout.heads, layout.row_bytes
    q8_blocks = max(1, d // Q8_BLOCK)
    qb = query_block(group)

    @T.prim_func(private=True)
    def attention_prefill_ragged(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        batch_size, qo_len, kv_len = T.int32(), T.int32(), T.int32()
        q_indptr_offset, kv_indptr_offset, q_rope_offset, k_rope_offset = T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (qo_len, heads, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        k = T.match_buffer(var_k, (kv_len, stored, d), dtype)
        v = T.match_buffer(var_v, (kv_len, stored, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=q_rope_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_offset)
        output = T.match_buffer(var_output, (qo_len, heads, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, heads), "float32")
        v8 = T.decl_buffer((kv_len, stored, row_bytes), "int8", data=v.data)
        k8 = T.decl_buffer((kv_len, stored, row_bytes), "int8", data=k.data)
        blocks: T.let = (qo_len + qb - 1) // qb  # at most, per sequence
        if attention_mode.exact(sm_scale):
            for i, h in T.grid(qo_len, heads):
                for j in T.vectorized(d):
                    output[i, h, j] = T.Cast(dtype, T.float32(0))
                lse[i, h] = T.float32(EMPTY_LSE)
        else:
            for unit in T.parallel(batch_size * blocks * h_kv):
                limit = T.alloc_buffer((qb,), "int32", scope="local")
                first_key = T.alloc_buffer((qb,), "int32", scope="local")
                b: T.let = unit // (blocks * h_kv)
                zig: T.let = unit // h_kv % blocks
                blk: T.let = T.Select(zig % 2 == 0, zig // 2, blocks - 1 - zig // 2)
                hk: T.let = unit % h_kv
                qo: T.let = q_indptr[b + 1] - q_indptr[b]
                kv_b: T.let = kv_indptr[b + 1] - kv_indptr[b]
                kv0: T.let = kv_indptr[b]
                if blk * qb < qo:
                    rows_q: T.let = T.min(qb, qo - blk * qb)
                    for tq in range(qb):
                        limit[tq] = T.Select(causal > 0, T.min(kv_b - qo + blk * qb + tq + 1, kv_b), kv_b)
                    for tq in range(rows_q):
                        first_key[tq] = first_visible(
                            sm_scale, q_rope_position[q_indptr[b] + blk * qb + tq], k_rope_pos_offset[b],
                            window)
                    n_max: T.let = T.Select(causal > 0, T.min(kv_b - qo + blk * qb + rows_q, kv_b), kv_b)
                    _attend_block(q, q_indptr[b] + blk * qb, rows_q, hk, group, d, limit, n_max,
                                  lambda c, x: layout.value(k, k8, lambda r, o: [kv0 + c, r, o], hk, x),
                                  lambda c, x: layout.value(v, v8, lambda r, o: [kv0 + c, r, o], hk, x),
                                  output, lse, attention_mode.scale(sm_scale), dtype, first_key, window, softcap,
                                  layout.quantized, q8_blocks, qb * group, key_group(qb * group))

    return attention_prefill_ragged


def paged_prefill_kernel(h_kv: int, h_q: int, d: int, kv_dtype: str = "float32", softcap: float = 0.0,
                         window: int = 0, vnni: bool = False) -> tirx.PrimFunc:
    """New tokens against the cached ones in the pages: the ``tir_attention_prefill_cpu`` slot of the KV cache.

    In the exact mode (``attention_mode.exact``: the verify forward, windowed layers too) each row is computed by
    the decode kernel's algorithm (``RowAttention``), so that a verified token's output is bit for bit the one a
    decode step gives it. Where the pages are the row's sequence's last block (it ends at the row's first new
    token: ``k_rope_pos_offset[b] + kv_b == q_rope_position[q_indptr[b]]``), the row also sees its sequence's new
    tokens up to itself, read from the carried heads of ``q`` (``KVLayout.query_heads``) and laid out in pages as a
    decode step finds them (the cache appends them after the attention); the ragged kernel's part is then empty.
    Otherwise (a block its sequence shares with others, or none) every row sees the block's keys. ``vnni``: the
    exact mode's q8_0 scores by AVX512-VNNI (``RowAttention``; the same results)."""
    layout = KVLayout(kv_dtype, h_kv, d)
    group = check_heads(layout, h_q)
    heads, dtype, stored, row_bytes = layout.query_heads(h_q), layout.dtype, layout.heads, layout.row_bytes
    q8_blocks = max(1, d // Q8_BLOCK)
    qb = query_block(group)
    rows = RowAttention(layout, h_q, softcap, window, vnni)

    @T.macro
    def entry(b, q_indptr, page_indptr, length_info, k_rope_pos_offset, q_rope_position, info):
        """``info`` of entry ``b``: its first page, its keys in the pages, whether they are its sequence's last
        block, the page index from which its tail holds them (its page count when not the last block) and the
        first page of its tail in the tail buffer."""
        n_pages: T.let = page_indptr[b + 1] - page_indptr[b]
        kv_b: T.let = T.Select(n_pages > 0, (n_pages - 1) * PAGE_SIZE + length_info[b], 0)
        info[0] = page_indptr[b]
        info[1] = kv_b
        info[2] = 0
        info[3] = n_pages
        info[4] = q_indptr[b] // PAGE_SIZE + 2 * b  # at most qo // 16 + 2 pages each: the tails do not overlap
        if q_indptr[b + 1] > q_indptr[b] and kv_b > 0:
            if k_rope_pos_offset[b] + kv_b == q_rope_position[q_indptr[b]]:
                info[2] = 1
                info[3] = kv_b // PAGE_SIZE

    @T.macro
    def row_unit(unit, row_entry, q, q_indptr, pages, pages8, page_indptr, page_values, length_info,
                 k_rope_pos_offset, q_rope_position, tail, tail8, part_acc, part_max, part_sum, sm_scale):
        info = T.alloc_buffer((5,), "int32", scope="local")
        i: T.let = unit // SPLITS
        b: T.let = row_entry[i]
        entry(b, q_indptr, page_indptr, length_info, k_rope_pos_offset, q_rope_position, info)
        rows.chunk(unit, q, i, info[1] + info[2] * (i - q_indptr[b] + 1),
                   first_visible(sm_scale, q_rope_position[i], k_rope_pos_offset[b], window), info[0], info[3],
                   info[4], page_values, pages, pages8, tail, tail8, part_acc, part_max, part_sum,
                   attention_mode.scale(sm_scale))

    @T.macro
    def exact(q, q8, q_indptr, pages, pages8, page_indptr, page_values, length_info, k_rope_pos_offset,
              q_rope_position, output, lse, sm_scale, batch_size, total_len, nnz_pages):
        row_entry = T.alloc_buffer((total_len,), "int32")
        tail = T.alloc_buffer((total_len // PAGE_SIZE + 2 * batch_size, 2, stored, PAGE_SIZE, d), dtype)
        tail8 = T.decl_buffer((total_len // PAGE_SIZE + 2 * batch_size, 2, stored, PAGE_SIZE, row_bytes), "int8",
                              data=tail.data)
        part_acc = T.alloc_buffer((total_len * SPLITS, h_q, d), "float32")
        part_max = T.alloc_buffer((total_len * SPLITS, h_q), "float32")
        part_sum = T.alloc_buffer((total_len * SPLITS, h_q), "float32")
        for b in range(batch_size):  # each row's entry; each last block's tail: its last page's keys, new tokens
            info = T.alloc_buffer((5,), "int32", scope="local")
            entry(b, q_indptr, page_indptr, length_info, k_rope_pos_offset, q_rope_position, info)
            row0: T.let = q_indptr[b]
            qo: T.let = q_indptr[b + 1] - row0
            for i in range(qo):
                row_entry[row0 + i] = b
            if info[2] == 1:
                for tp in range((info[1] % PAGE_SIZE + qo + PAGE_SIZE - 1) // PAGE_SIZE):
                    for t in range(PAGE_SIZE):
                        pos: T.let = (info[3] + tp) * PAGE_SIZE + t
                        if pos < info[1]:  # bytes: q8_0 rows are no floats
                            for kv, r in T.grid(2, stored):
                                for j in T.vectorized(row_bytes):
                                    tail8[info[4] + tp, kv, r, t, j] = pages8[
                                        page_values[info[0] + info[3]], kv, r, t, j]
                        elif pos < info[1] + qo:
                            for kv, r in T.grid(2, stored):
                                for j in T.vectorized(row_bytes):
                                    tail8[info[4] + tp, kv, r, t, j] = q8[
                                        row0 + pos - info[1], h_q + kv * stored + r, j]
        if total_len * (nnz_pages + 1) <= SERIAL_PAGES:  # little work: no fork-join
            for unit in range(total_len * SPLITS):
                row_unit(unit, row_entry, q, q_indptr, pages, pages8, page_indptr, page_values, length_info,
                         k_rope_pos_offset, q_rope_position, tail, tail8, part_acc, part_max, part_sum, sm_scale)
        else:
            for unit in T.parallel(total_len * SPLITS):
                row_unit(unit, row_entry, q, q_indptr, pages, pages8, page_indptr, page_values, length_info,
                         k_rope_pos_offset, q_rope_position, tail, tail8, part_acc, part_max, part_sum, sm_scale)
        for ih in range(total_len * h_q):
            rows.merge(ih // h_q * SPLITS, ih // h_q, ih % h_q, part_acc, part_max, part_sum, output, lse)

    @T.prim_func(private=True)
    def attention_prefill_paged(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        batch_size, total_len, nnz_pages, max_num_pages = T.int32(), T.int32(), T.int32(), T.int32()
        q_indptr_offset, page_indptr_offset, page_values_offset = T.int32(), T.int32(), T.int32()
        k_rope_offset, q_rope_offset, length_info_offset = T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (total_len, heads, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, stored, PAGE_SIZE, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_offset)
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_info_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=q_rope_offset)
        output = T.match_buffer(var_output, (total_len, heads, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, heads), "float32")
        pages8 = T.decl_buffer((max_num_pages, 2, stored, PAGE_SIZE, row_bytes), "int8", data=pages.data)
        q8 = T.decl_buffer((total_len, heads, row_bytes), "int8", data=q.data)
        blocks: T.let = (total_len + qb - 1) // qb  # at most, per sequence
        if attention_mode.exact(sm_scale):
            exact(q, q8, q_indptr, pages, pages8, page_indptr, page_values, length_info, k_rope_pos_offset,
                  q_rope_position, output, lse, sm_scale, batch_size, total_len, nnz_pages)
        else:
            for unit in T.parallel(batch_size * blocks * h_kv):
                limit = T.alloc_buffer((qb,), "int32", scope="local")
                first_key = T.alloc_buffer((qb,), "int32", scope="local")
                b: T.let = unit // (blocks * h_kv)
                zig: T.let = unit // h_kv % blocks
                blk: T.let = T.Select(zig % 2 == 0, zig // 2, blocks - 1 - zig // 2)
                hk: T.let = unit % h_kv
                qo: T.let = q_indptr[b + 1] - q_indptr[b]
                first: T.let = page_indptr[b]
                n_pages: T.let = page_indptr[b + 1] - first
                kv_b: T.let = T.Select(n_pages > 0, (n_pages - 1) * PAGE_SIZE + length_info[b], 0)
                if blk * qb < qo:
                    rows_q: T.let = T.min(qb, qo - blk * qb)
                    for tq in range(qb):
                        limit[tq] = T.Select(causal > 0, T.min(kv_b - qo + blk * qb + tq + 1, kv_b), kv_b)
                    for tq in range(rows_q):
                        first_key[tq] = first_visible(
                            sm_scale, q_rope_position[q_indptr[b] + blk * qb + tq], k_rope_pos_offset[b],
                            window)
                    n_max: T.let = T.Select(causal > 0, T.min(kv_b - qo + blk * qb + rows_q, kv_b), kv_b)
                    _attend_block(q, q_indptr[b] + blk * qb, rows_q, hk, group, d, limit, n_max,
                                  lambda c, x: layout.value(pages, pages8, lambda r, o: [
                                      page_values[first + c // PAGE_SIZE], 0, r, c % PAGE_SIZE, o], hk, x),
                                  lambda c, x: layout.value(pages, pages8, lambda r, o: [
                                      page_values[first + c // PAGE_SIZE], 1, r, c % PAGE_SIZE, o], hk, x),
                                  output, lse, attention_mode.scale(sm_scale), dtype, first_key, window, softcap,
                                  layout.quantized, q8_blocks, qb * group, key_group(qb * group))

    return attention_prefill_paged


#: Names TVM's KV cache gives the CPU prefill kernels these replace (the function names in the exported module).
RAGGED_NAMES = ("batch_prefill_ragged_kv", "tir_attention_prefill_ragged_cpu")
PAGED_NAMES = ("batch_prefill_paged_kv_cpu", "tir_attention_prefill_cpu")
