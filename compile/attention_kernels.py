# fmt: off
# ruff: noqa: F841, B023  (TVMScript: match_buffer declarations and parse-time lambdas over loop variables)
"""CPU prefill attention kernels for TVM's paged KV cache, replacing its serial ones (``replace_prefill_attention``).

TVM's KV cache for llvm computes a prefill in two parts, merged by their log-sum-exps: the new tokens against
themselves (``tir_attention_prefill_ragged_cpu``) and against the sequence's earlier tokens in the pages
(``tir_attention_prefill_cpu``). Its CPU kernels for both are serial scalar loops, and the paged one visits every
slot of the whole cache (``max_num_pages * page_size``) for each query and head: a 512-token prompt took 12 s.
These kernels keep the signatures and meaning, and are written for the CPU: the (query token, head) pairs in 64
parallel chunks, dot products and the weighted sum of values vectorised over the head dimension (16 lanes).

Operation, for each query token ``i`` of sequence ``b`` (position ``r = i - q_indptr[b]`` among its
``qo = q_indptr[b + 1] - q_indptr[b]`` new tokens) and each query head ``h`` (KV head ``h // (h_q // h_kv)``)::

    n = kv_len_b - qo + r + 1 if causal else kv_len_b          # keys visible to this query
    s[c] = dot(q[i, h], k[c]) * sm_scale * log2(e)   for c < n
    out[i, h] = sum_c 2^(s[c] - max s) v[c] / sum_c 2^(s[c] - max s)
    lse[i, h] = max s + log2(sum_c 2^(s[c] - max s))          # base 2, as the cache's merge expects

(out = 0 and lse = -5e4 when ``n <= 0``.) RoPE has already been applied to q and k (the model's cache uses
``RopeMode.NORMAL``), so the rotary arguments are unused. Head sizes must be multiples of 16; the paged kernel
assumes pages of 16 tokens and no sliding window (the cache is created that way).
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .decode_attention import DECODE_NAMES, decode_attention_kernel

_LANES = 16
_CHUNKS = 64
PAGE_SIZE = 16
_LOG2E = math.log2(math.e)
_EMPTY_LSE = -5e4


@T.macro
def _attend(q, i, h, n, key, value, d, scores, part, acc, stats, out, lse, sm_scale):
    """out[i, h] and lse[i, h] over keys key(c, j) and values value(c, j) for c < n (see the module doc)."""
    if n <= 0:
        for j in range(d):
            out[i, h, j] = T.Cast(out.dtype, T.float32(0))
        lse[i, h] = T.float32(_EMPTY_LSE)
    else:
        stats[0] = T.min_value("float32")
        for c in range(n):
            for lane in T.vectorized(_LANES):
                part[lane] = T.Cast("float32", q[i, h, lane]) * T.Cast("float32", key(c, lane))
            for blk in range(1, d // _LANES):
                for lane in T.vectorized(_LANES):
                    part[lane] = part[lane] + T.Cast("float32", q[i, h, blk * _LANES + lane]) * T.Cast(
                        "float32", key(c, blk * _LANES + lane))
            for lane in T.vectorized(8):
                part[lane] = part[lane] + part[lane + 8]
            for lane in T.vectorized(4):
                part[lane] = part[lane] + part[lane + 4]
            for lane in T.vectorized(2):
                part[lane] = part[lane] + part[lane + 2]
            scores[c] = (part[0] + part[1]) * (sm_scale * T.float32(_LOG2E))
            stats[0] = T.max(stats[0], scores[c])
        stats[1] = T.float32(0)
        for c in range(n):
            scores[c] = T.exp2(scores[c] - stats[0])
            stats[1] = stats[1] + scores[c]
        for j in T.vectorized(d):
            acc[j] = T.float32(0)
        for c in range(n):
            for j in T.vectorized(d):
                acc[j] = acc[j] + scores[c] * T.Cast("float32", value(c, j))
        for j in T.vectorized(d):
            out[i, h, j] = T.Cast(out.dtype, acc[j] / stats[1])
        lse[i, h] = stats[0] + T.log2(stats[1])


def ragged_prefill_kernel(h_kv: int, h_q: int, d: int, dtype: str = "float32") -> tirx.PrimFunc:
    """New tokens against themselves: the ``tir_attention_prefill_ragged_cpu`` slot of the KV cache."""
    if d % _LANES:
        raise ValueError(f"head size {d} is not a multiple of {_LANES}")
    group = h_q // h_kv

    @T.prim_func(private=True)
    def attention_prefill_ragged(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        batch_size, qo_len, kv_len = T.int32(), T.int32(), T.int32()
        q_indptr_offset, kv_indptr_offset, q_rope_offset, k_rope_offset = T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        k = T.match_buffer(var_k, (kv_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=q_rope_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_offset)
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")
        per_chunk: T.let = (qo_len * h_q + _CHUNKS - 1) // _CHUNKS
        for chunk in T.parallel(_CHUNKS):
            scores = T.alloc_buffer((kv_len,), "float32")
            part = T.alloc_buffer((_LANES,), "float32")
            acc = T.alloc_buffer((d,), "float32")
            stats = T.alloc_buffer((3,), "int32")
            fstats = T.alloc_buffer((2,), "float32")
            for j in range(per_chunk):
                if chunk * per_chunk + j < qo_len * h_q:
                    i: T.let = (chunk * per_chunk + j) // h_q
                    h: T.let = (chunk * per_chunk + j) % h_q
                    stats[0] = 0
                    for b in range(batch_size):
                        if q_indptr[b] <= i:
                            stats[0] = b
                    seq: T.let = stats[0]
                    qo: T.let = q_indptr[seq + 1] - q_indptr[seq]
                    kv_b: T.let = kv_indptr[seq + 1] - kv_indptr[seq]
                    kv0: T.let = kv_indptr[seq]
                    n: T.let = T.Select(causal > 0, T.min(kv_b - qo + (i - q_indptr[seq]) + 1, kv_b), kv_b)
                    _attend(q, i, h, n, lambda c, x: k[kv0 + c, h // group, x],
                            lambda c, x: v[kv0 + c, h // group, x], d, scores, part, acc, fstats, output, lse,
                            sm_scale)

    return attention_prefill_ragged


def paged_prefill_kernel(h_kv: int, h_q: int, d: int, dtype: str = "float32") -> tirx.PrimFunc:
    """New tokens against the cached ones in the pages: the ``tir_attention_prefill_cpu`` slot of the KV cache."""
    if d % _LANES:
        raise ValueError(f"head size {d} is not a multiple of {_LANES}")
    group = h_q // h_kv

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
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, PAGE_SIZE, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_offset)
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_info_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=q_rope_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        per_chunk: T.let = (total_len * h_q + _CHUNKS - 1) // _CHUNKS
        for chunk in T.parallel(_CHUNKS):
            scores = T.alloc_buffer((max_num_pages * PAGE_SIZE,), "float32")
            part = T.alloc_buffer((_LANES,), "float32")
            acc = T.alloc_buffer((d,), "float32")
            stats = T.alloc_buffer((3,), "int32")
            fstats = T.alloc_buffer((2,), "float32")
            for j in range(per_chunk):
                if chunk * per_chunk + j < total_len * h_q:
                    i: T.let = (chunk * per_chunk + j) // h_q
                    h: T.let = (chunk * per_chunk + j) % h_q
                    stats[0] = 0
                    for b in range(batch_size):
                        if q_indptr[b] <= i:
                            stats[0] = b
                    seq: T.let = stats[0]
                    qo: T.let = q_indptr[seq + 1] - q_indptr[seq]
                    first: T.let = page_indptr[seq]
                    n_pages: T.let = page_indptr[seq + 1] - first
                    kv_b: T.let = T.Select(n_pages > 0, (n_pages - 1) * PAGE_SIZE + length_info[seq], 0)
                    n: T.let = T.Select(causal > 0, T.min(kv_b - qo + (i - q_indptr[seq]) + 1, kv_b), kv_b)
                    _attend(q, i, h, n,
                            lambda c, x: pages[page_values[first + c // PAGE_SIZE], 0, h // group, c % PAGE_SIZE, x],
                            lambda c, x: pages[page_values[first + c // PAGE_SIZE], 1, h // group, c % PAGE_SIZE, x],
                            d, scores, part, acc, fstats, output, lse, sm_scale)

    return attention_prefill_paged


def rope_kernel(h_kv: int, h_q: int, d: int, theta: float, dtype: str = "float32") -> tirx.PrimFunc:
    """RoPE of the fused q/k/v rows: the ``tir_split_rotary`` slot of the KV cache (TVM's computes ``powf`` and
    ``sincosf`` for every element, serially: 35 ms of a 79-token SmolLM2 prefill). Per token ``s`` (tokens in
    parallel chunks) at position ``p = position_map[s]``, with ``half = d / 2``::

        f[i] = p / theta ** (2 i / d);  c, n = cos(f), sin(f)             for i < half (once per token)
        q[s, h, i] = x[h, i] c[i] - x[h, i + half] n[i];  q[s, h, i + half] = x[h, i + half] c[i] + x[h, i] n[i]
        (k likewise for heads h_q .. h_q + h_kv - 1 of x = qkv[s]; v[s] = the last h_kv heads, copied)

    When ``apply_rope == 0`` q and k are copied unrotated. The frequency is TVM's float32 expression."""
    half, heads = d // 2, h_q + 2 * h_kv

    @T.macro
    def rotate(dst, s, h, src_h, qkv, cos, sin, apply_rope):
        for i in T.vectorized(half):
            dst[s, h, i] = T.Select(apply_rope > 0, qkv[s, src_h, i] * cos[i] - qkv[s, src_h, i + half] * sin[i],
                                    qkv[s, src_h, i])
            dst[s, h, i + half] = T.Select(apply_rope > 0, qkv[s, src_h, i + half] * cos[i] + qkv[s, src_h, i] * sin[
                i], qkv[s, src_h, i + half])

    @T.prim_func(private=True)
    def fused_rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
                   var_v: T.handle, apply_rope: T.int64):
        T.func_attr({"tirx.noalias": True})
        seq_len, position_map_elem_offset = T.int32(), T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, heads, d), dtype)
        q = T.match_buffer(var_q, (seq_len, h_q, d), dtype)
        k = T.match_buffer(var_k, (seq_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (seq_len, h_kv, d), dtype)
        position_map = T.match_buffer(var_position_map, (seq_len,), "int32", elem_offset=position_map_elem_offset)
        for chunk in T.parallel(_CHUNKS):
            cos = T.alloc_buffer((half,), "float32", scope="local")
            sin = T.alloc_buffer((half,), "float32", scope="local")
            for s in range(chunk * seq_len // _CHUNKS, (chunk + 1) * seq_len // _CHUNKS):
                for i in range(half):
                    freq: T.let = T.Cast("float32", position_map[s]) / T.pow(
                        T.float32(theta), T.Cast("float32", i * 2 % d) / T.float32(d))
                    cos[i] = T.cos(freq)
                    sin[i] = T.sin(freq)
                for h in range(h_q):
                    rotate(q, s, h, h, qkv, cos, sin, apply_rope)
                for h in range(h_kv):
                    rotate(k, s, h, h_q + h, qkv, cos, sin, apply_rope)
                    for j in T.vectorized(d):
                        v[s, h, j] = qkv[s, h_q + h_kv + h, j]

    return fused_rope


#: Names TVM's KV cache gives the CPU prefill kernels these replace (the function names in the exported module).
RAGGED_NAMES = ("batch_prefill_ragged_kv", "tir_attention_prefill_ragged_cpu")
PAGED_NAMES = ("batch_prefill_paged_kv_cpu", "tir_attention_prefill_cpu")
ROPE_NAMES = ("fused_rope", "tir_split_rotary")


def replace_attention_kernels(mod: tvm.IRModule, h_kv: int, h_q: int, d: int,
                              rope_theta: float | None = None) -> tvm.IRModule:
    """``mod`` with the KV cache's CPU attention kernels (prefill, and decode: ``decode_attention.py``) replaced by
    these (same names and signatures), and its RoPE kernel too when ``rope_theta`` is given (the cache must use
    ``RopeMode.NORMAL`` with scale 1)."""
    functions = {gv.name_hint: gv for gv in mod.get_global_vars()}
    replacements = [(RAGGED_NAMES, ragged_prefill_kernel(h_kv, h_q, d)),
                    (PAGED_NAMES, paged_prefill_kernel(h_kv, h_q, d)),
                    (DECODE_NAMES, decode_attention_kernel(h_kv, h_q, d))]
    if rope_theta is not None:
        replacements.append((ROPE_NAMES, rope_kernel(h_kv, h_q, d, rope_theta)))
    for candidates, new in replacements:
        found = [name for name in candidates if name in functions]
        if not found:
            raise ValueError(f"the module has none of {candidates} to replace (TVM's KV cache changed?)")
        gv = functions[found[0]]
        old = mod[gv]
        if len(new.params) != len(old.params):
            raise ValueError(f"{gv.name_hint}: {len(old.params)} parameters in TVM's kernel, {len(new.params)} here")
        if old.attrs is not None and "global_symbol" in old.attrs:
            new = new.with_attr("global_symbol", old.attrs["global_symbol"])
        mod[gv] = new
    return mod
