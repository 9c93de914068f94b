# fmt: off
# ruff: noqa: F841  (TVMScript: match_buffer declarations)
"""The CPU kernels that replace TVM's in its paged KV cache (``replace_attention_kernels``), and the RoPE one.

TVM's KV cache for llvm brings serial scalar kernels: prefill attention (the new tokens against themselves and
against the pages, merged by their log-sum-exps), decode attention, and RoPE. ``replace_attention_kernels`` puts
in their place, under the same names and signatures, the tiled prefill kernels of ``prefill_attention.py``, the
split-K decode kernel of ``decode_attention.py`` and ``rope_kernel`` here (cos/sin once per token, tokens in
parallel).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from .decode_attention import DECODE_NAMES, decode_attention_kernel
from .kv_layout import Q8_BLOCK, KVLayout
from .prefill_attention import PAGED_NAMES, RAGGED_NAMES, paged_prefill_kernel, ragged_prefill_kernel

_CHUNKS = 64


def _table(values: tuple[float, ...], i: tirx.PrimExpr, lo: int = 0, hi: int | None = None) -> tirx.PrimExpr:
    """``values[i]`` as a float32 expression of the loop variable ``i`` (a balanced tree of selects between
    constants: the table lives in the code, no buffer needed)."""
    hi = len(values) if hi is None else hi
    if hi - lo == 1:
        return tirx.const(values[lo], "float32")
    mid = (lo + hi) // 2
    return tirx.Select(i < mid, _table(values, i, lo, mid), _table(values, i, mid, hi))


def rope_kernel(h_kv: int, h_q: int, d: int, inv_freq: tuple[float, ...],
                kv_dtype: str = "float32", attention_factor: float = 1.0, in_model: bool = False) -> tirx.PrimFunc:
    """RoPE of the fused q/k/v rows: the ``tir_split_rotary`` slot of the KV cache (TVM's computes ``powf`` and
    ``sincosf`` for every element, serially: 35 ms of a 79-token SmolLM2 prefill). Per token ``s`` (tokens in
    parallel chunks) at position ``p = position_map[s]``, with ``inv_freq`` the ``half <= d / 2`` inverse
    frequencies (``rope.RopeScaling.inverse_frequencies``: scaled or not, rounded to float32; ``2 half < d``: partial
    rotary) and ``a = attention_factor`` (LongRoPE's; 1 otherwise)::

        f[i] = p * inv_freq[i];  c, n = a cos(f), a sin(f)                for i < half (once per token)
        q[s, h, i] = x[h, i] c[i] - x[h, i + half] n[i];  q[s, h, i + half] = x[h, i + half] c[i] + x[h, i] n[i]
        q[s, h, j] = x[h, j]                                              for 2 half <= j < d
        (k likewise for heads h_q .. h_q + h_kv - 1 of x = qkv[s]; v[s] = the last h_kv heads, copied)

    When ``apply_rope == 0`` q and k are copied unrotated. The angle and the rotation are computed in float32
    whatever the cache's type (``kv_layout.KVLayout``) and rounded to it once (float32, float16), or k and v are
    quantised into the cache's q8_0 rows (q rounded to float16). The cache's q has ``KVLayout.query_heads`` heads:
    the token's stored k and v rows are copied into its last ones (the exact mode of ``paged_prefill_kernel`` reads
    the new tokens there); ``qkv`` has as many heads as that q, k and v together: the model's q, k, v heads, then
    padding, never read. ``in_model``: the rotation alone, without the ``apply_rope`` argument, for the model to call
    itself (``call_tir`` takes the outputs last): q, k and v of the model's heads in ``KVLayout.dtype`` (Gemma 3
    rotates each layer by its own frequencies before the cache, whose RoPE slot then only copies, quantises and
    carries them)."""
    layout = KVLayout(kv_dtype, h_kv, d)
    dtype, stored, row_bytes = layout.dtype, layout.heads, layout.row_bytes
    q_heads = layout.query_heads(h_q)
    half, heads = len(inv_freq), q_heads + 2 * stored
    if not 0 < 2 * half <= d:
        raise ValueError(f"rope_kernel: {half} inverse frequencies for head size {d} (need 1 to {d // 2})")
    inv_freq = tuple(float(np.float32(f)) for f in inv_freq)
    rest, factor = d - 2 * half, float(attention_factor)

    def wide(qkv, s, h, i):
        return T.Cast("float32", qkv[s, h, i])

    @T.macro
    def rotate(x, s, src_h, qkv, cos, sin, apply_rope):
        """``x[0:d]`` = head ``src_h`` of ``qkv[s]`` rotated, in float32."""
        for i in T.vectorized(half):
            x[i] = T.Select(apply_rope > 0, wide(qkv, s, src_h, i) * cos[i] - wide(qkv, s, src_h, i + half) * sin[i],
                            wide(qkv, s, src_h, i))
            x[i + half] = T.Select(
                apply_rope > 0, wide(qkv, s, src_h, i + half) * cos[i] + wide(qkv, s, src_h, i) * sin[i],
                wide(qkv, s, src_h, i + half))
        for j in range(rest):
            x[2 * half + j] = wide(qkv, s, src_h, 2 * half + j)

    @T.macro
    def store(x, dst, dst8, s, h, amax):
        """KV head ``h`` of token ``s`` from ``x[0:d]``: rounded to the cache's type, or quantised (q8_0: per
        block of 32, ``scale = max|x| / 127`` kept as float16, ``round(x / scale)`` half away from zero)."""
        if layout.quantized:
            for blk in range(d // Q8_BLOCK):
                amax[0] = T.float32(0)
                for i in range(Q8_BLOCK):
                    amax[0] = T.max(amax[0], T.fabs(x[blk * Q8_BLOCK + i]))
                scale: T.let = amax[0] / T.float32(127)
                inverse: T.let = T.Select(scale > T.float32(0), T.float32(1) / scale, T.float32(0))
                for i in T.vectorized(Q8_BLOCK):
                    y: T.let = x[blk * Q8_BLOCK + i] * inverse
                    dst8[s, h // 2, h % 2 * d + blk * Q8_BLOCK + i] = T.Cast(
                        "int8", T.trunc(y + T.Select(y < T.float32(0), T.float32(-0.5), T.float32(0.5))))
                row, e = layout.scale_at(h, blk * Q8_BLOCK)
                dst[s, row, e] = T.Cast(dtype, scale)
        else:
            for j in T.vectorized(d):
                dst[s, h, j] = T.Cast(dtype, x[j])

    @T.prim_func(private=True)
    def fused_rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
                   var_v: T.handle, apply_rope: T.int64):
        T.func_attr({"tirx.noalias": True})
        seq_len, position_map_elem_offset = T.int32(), T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, heads, d), dtype)
        q = T.match_buffer(var_q, (seq_len, q_heads, d), dtype)
        k = T.match_buffer(var_k, (seq_len, stored, d), dtype)
        v = T.match_buffer(var_v, (seq_len, stored, d), dtype)
        position_map = T.match_buffer(var_position_map, (seq_len,), "int32", elem_offset=position_map_elem_offset)
        v8 = T.decl_buffer((seq_len, stored, row_bytes), "int8", data=v.data)
        k8 = T.decl_buffer((seq_len, stored, row_bytes), "int8", data=k.data)
        q8 = T.decl_buffer((seq_len, q_heads, row_bytes), "int8", data=q.data)
        for chunk in T.parallel(_CHUNKS):
            cos = T.alloc_buffer((half,), "float32", scope="local")
            sin = T.alloc_buffer((half,), "float32", scope="local")
            x = T.alloc_buffer((d,), "float32", scope="local")
            amax = T.alloc_buffer((1,), "float32", scope="local")
            for s in range(chunk * seq_len // _CHUNKS, (chunk + 1) * seq_len // _CHUNKS):
                for i in range(half):
                    freq: T.let = T.Cast("float32", position_map[s]) * _table(inv_freq, i)
                    cos[i] = T.cos(freq) * T.float32(factor)
                    sin[i] = T.sin(freq) * T.float32(factor)
                for h in range(h_q):
                    rotate(x, s, h, qkv, cos, sin, apply_rope)
                    for j in T.vectorized(d):
                        q[s, h, j] = T.Cast(dtype, x[j])
                for h in range(h_kv):
                    rotate(x, s, h_q + h, qkv, cos, sin, apply_rope)
                    store(x, k, k8, s, h, amax)
                    for j in T.vectorized(d):
                        x[j] = wide(qkv, s, h_q + h_kv + h, j)
                    store(x, v, v8, s, h, amax)
                for kv, r in T.grid(2, stored):  # the carried rows: bytes (q8_0 rows are no floats)
                    for j in T.vectorized(row_bytes):
                        q8[s, h_q + kv * stored + r, j] = T.Select(kv == 0, k8[s, r, j], v8[s, r, j])

    @T.prim_func(private=True)
    def model_rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
                   var_v: T.handle):
        T.func_attr({"tirx.noalias": True})
        seq_len, position_map_elem_offset = T.int32(), T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, h_q + 2 * h_kv, d), dtype)
        q = T.match_buffer(var_q, (seq_len, h_q, d), dtype)
        k = T.match_buffer(var_k, (seq_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (seq_len, h_kv, d), dtype)
        position_map = T.match_buffer(var_position_map, (seq_len,), "int32", elem_offset=position_map_elem_offset)
        for chunk in T.parallel(_CHUNKS):
            cos = T.alloc_buffer((half,), "float32", scope="local")
            sin = T.alloc_buffer((half,), "float32", scope="local")
            x = T.alloc_buffer((d,), "float32", scope="local")
            for s in range(chunk * seq_len // _CHUNKS, (chunk + 1) * seq_len // _CHUNKS):
                for i in range(half):
                    freq: T.let = T.Cast("float32", position_map[s]) * _table(inv_freq, i)
                    cos[i] = T.cos(freq) * T.float32(factor)
                    sin[i] = T.sin(freq) * T.float32(factor)
                for h in range(h_q):
                    rotate(x, s, h, qkv, cos, sin, T.int64(1))
                    for j in T.vectorized(d):
                        q[s, h, j] = T.Cast(dtype, x[j])
                for h in range(h_kv):
                    rotate(x, s, h_q + h, qkv, cos, sin, T.int64(1))
                    for j in T.vectorized(d):
                        k[s, h, j] = T.Cast(dtype, x[j])
                    for j in T.vectorized(d):
                        v[s, h, j] = qkv[s, h_q + h_kv + h, j]

    return model_rope if in_model else fused_rope


#: Names TVM's KV cache gives its RoPE kernel (the function names in the exported module).
ROPE_NAMES = ("fused_rope", "tir_split_rotary")


def replace_attention_kernels(mod: tvm.IRModule, h_kv: int, h_q: int, d: int,
                              inv_freq: tuple[float, ...], kv_dtype: str = "float32",
                              attention_factor: float = 1.0, softcap: float = 0.0, window: int = 0,
                              vnni: bool = False) -> tvm.IRModule:
    """``mod`` with the KV cache's CPU attention kernels (prefill, and decode: ``decode_attention.py``) replaced by
    these (same names and signatures), and its RoPE kernel (``rope_kernel``, with ``inv_freq``; the
    cache must use ``RopeMode.NORMAL``; ``attention_factor``: LongRoPE's); ``kv_dtype``: the cache's
    (``kv_layout.KVLayout``). The cache must be made with ``KVLayout.query_heads(h_q)`` query heads and
    ``KVLayout.heads`` KV heads of ``KVLayout.dtype`` (the kernels read the first ``h_q``; see ``rope_kernel``).
    ``softcap`` and ``window``: the scores' soft-cap and the sliding window of the layers whose ``sm_scale`` marks
    them windowed (``decode_attention.py``, ``attention_mode.py``; 0: none). ``vnni``: the target has AVX512-VNNI
    (``packed_matvec.has_vnni``): a q8_0 cache's integer scores by ``vpdpbusd`` (the same results)."""
    functions = {gv.name_hint: gv for gv in mod.get_global_vars()}
    replacements = [(RAGGED_NAMES, ragged_prefill_kernel(h_kv, h_q, d, kv_dtype, softcap, window)),
                    (PAGED_NAMES, paged_prefill_kernel(h_kv, h_q, d, kv_dtype, softcap, window, vnni)),
                    (DECODE_NAMES, decode_attention_kernel(h_kv, h_q, d, kv_dtype, softcap, window, vnni)),
                    (ROPE_NAMES, rope_kernel(h_kv, h_q, d, inv_freq, kv_dtype, attention_factor))]
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
