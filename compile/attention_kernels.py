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

from .decode_attention import DECODE_NAMES, carried_heads, decode_attention_kernel
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
                dtype: str = "float32", attention_factor: float = 1.0) -> tirx.PrimFunc:
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
    whatever ``dtype`` (the KV cache's: float32 or float16) and rounded to it once. The cache's q has
    ``carried_heads`` heads: the rotated k and the v of the token are copied into its last ``2 h_kv`` (the exact
    mode of ``paged_prefill_kernel`` reads the new tokens there), and ``qkv`` has as many heads as q, k and v
    together: its last ``2 h_kv`` heads are padding, never read."""
    half, heads = len(inv_freq), carried_heads(h_kv, h_q) + 2 * h_kv
    q_heads = carried_heads(h_kv, h_q)
    if not 0 < 2 * half <= d:
        raise ValueError(f"rope_kernel: {half} inverse frequencies for head size {d} (need 1 to {d // 2})")
    inv_freq = tuple(float(np.float32(f)) for f in inv_freq)
    rest, factor = d - 2 * half, float(attention_factor)

    def wide(qkv, s, h, i):
        return T.Cast("float32", qkv[s, h, i])

    @T.macro
    def rotate(dst, s, h, src_h, qkv, cos, sin, apply_rope):
        for i in T.vectorized(half):
            dst[s, h, i] = T.Cast(dtype, T.Select(
                apply_rope > 0, wide(qkv, s, src_h, i) * cos[i] - wide(qkv, s, src_h, i + half) * sin[i],
                wide(qkv, s, src_h, i)))
            dst[s, h, i + half] = T.Cast(dtype, T.Select(
                apply_rope > 0, wide(qkv, s, src_h, i + half) * cos[i] + wide(qkv, s, src_h, i) * sin[i],
                wide(qkv, s, src_h, i + half)))
        for j in range(rest):
            dst[s, h, 2 * half + j] = qkv[s, src_h, 2 * half + j]

    @T.prim_func(private=True)
    def fused_rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
                   var_v: T.handle, apply_rope: T.int64):
        T.func_attr({"tirx.noalias": True})
        seq_len, position_map_elem_offset = T.int32(), T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, heads, d), dtype)
        q = T.match_buffer(var_q, (seq_len, q_heads, d), dtype)
        k = T.match_buffer(var_k, (seq_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (seq_len, h_kv, d), dtype)
        position_map = T.match_buffer(var_position_map, (seq_len,), "int32", elem_offset=position_map_elem_offset)
        for chunk in T.parallel(_CHUNKS):
            cos = T.alloc_buffer((half,), "float32", scope="local")
            sin = T.alloc_buffer((half,), "float32", scope="local")
            for s in range(chunk * seq_len // _CHUNKS, (chunk + 1) * seq_len // _CHUNKS):
                for i in range(half):
                    freq: T.let = T.Cast("float32", position_map[s]) * _table(inv_freq, i)
                    cos[i] = T.cos(freq) * T.float32(factor)
                    sin[i] = T.sin(freq) * T.float32(factor)
                for h in range(h_q):
                    rotate(q, s, h, h, qkv, cos, sin, apply_rope)
                for h in range(h_kv):
                    rotate(k, s, h, h_q + h, qkv, cos, sin, apply_rope)
                    for j in T.vectorized(d):
                        v[s, h, j] = qkv[s, h_q + h_kv + h, j]
                        q[s, h_q + h, j] = k[s, h, j]
                        q[s, h_q + h_kv + h, j] = v[s, h, j]

    return fused_rope


#: Names TVM's KV cache gives its RoPE kernel (the function names in the exported module).
ROPE_NAMES = ("fused_rope", "tir_split_rotary")


def replace_attention_kernels(mod: tvm.IRModule, h_kv: int, h_q: int, d: int,
                              inv_freq: tuple[float, ...], dtype: str = "float32",
                              attention_factor: float = 1.0) -> tvm.IRModule:
    """``mod`` with the KV cache's CPU attention kernels (prefill, and decode: ``decode_attention.py``) replaced by
    these (same names and signatures), and its RoPE kernel (``rope_kernel``, with ``inv_freq``; the
    cache must use ``RopeMode.NORMAL``; ``attention_factor``: LongRoPE's); ``dtype``: the cache's (its pages, q, k,
    v and the outputs). The cache must be made with ``carried_heads(h_kv, h_q)`` query heads (the kernels read
    the first ``h_q``; see ``rope_kernel``)."""
    functions = {gv.name_hint: gv for gv in mod.get_global_vars()}
    replacements = [(RAGGED_NAMES, ragged_prefill_kernel(h_kv, h_q, d, dtype)),
                    (PAGED_NAMES, paged_prefill_kernel(h_kv, h_q, d, dtype)),
                    (DECODE_NAMES, decode_attention_kernel(h_kv, h_q, d, dtype)),
                    (ROPE_NAMES, rope_kernel(h_kv, h_q, d, inv_freq, dtype, attention_factor))]
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
