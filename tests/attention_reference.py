"""The numpy attention and the paged KV cache the attention kernels' tests check the kernels against
(``test_decode_attention.py``, ``test_prefill_attention.py``): the reference attention (outputs and base-2
log-sum-exps, as the cache's merge uses both), caches of scattered pages of float32, float16 and q8_0 (the query
quantised as the kernels do, ``numpy_llama.q8_0_query``), the carried heads and the comparison."""

from __future__ import annotations

import math

import numpy as np
import tvm
from kernel_harness import built_for_cpu
from logitproc.compile import attention_mode
from logitproc.compile.decode_attention import PAGE_SIZE
from logitproc.compile.kv_layout import KVLayout
from logitproc.serve.numpy_llama import q8_0_query, q8_0_roundtrip

H_Q, H_KV, D = 9, 3, 64
DTYPES = ["float32", "float16", "q8_0"]
SM_SCALE = 1 / math.sqrt(D)
#: the verify forward's ``sm_scale``: the exact mode asked for (``compile/attention_mode.py``)
EXACT = attention_mode.encode(SM_SCALE, exact=True)
EMPTY_LSE = -5e4
DEV = tvm.cpu()


def compiled(factory, *args, **kwargs):
    """The kernel ``factory(*args, **kwargs)`` compiled for this CPU, as a callable (once, in the build cache)."""
    return built_for_cpu(factory, *args, **kwargs)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Reference: ``q [m, H_Q, D]`` against ``k, v [n, H_KV, D]``, query ``i`` seeing keys ``< visible[i]``; the
    output and the base-2 log-sum-exp (0 and -5e4 for a query that sees nothing)."""
    out = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:2], EMPTY_LSE)
    group = q.shape[1] // k.shape[1]
    for i, n in enumerate(visible):
        if n <= 0:
            continue
        for h in range(q.shape[1]):
            s = k[:n, h // group].astype(np.float64) @ q[i, h] * SM_SCALE * math.log2(math.e)
            w = np.exp2(s - s.max())
            out[i, h] = w @ v[:n, h // group] / w.sum()
            lse[i, h] = s.max() + math.log2(w.sum())
    return out, lse


def store(x: np.ndarray, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Keys or values ``x [..., h_kv, d]`` (float32) as a cache of ``kv_dtype`` stores them (``[..., heads, d]`` of
    its element type: q8_0 blocks packed as ``compile/kv_layout.py`` describes), and the values it holds (float32,
    ``[..., h_kv, d]``)."""
    h_kv, d = x.shape[-2:]
    layout = KVLayout(kv_dtype, h_kv, d)
    if not layout.quantized:
        rows = x.astype(kv_dtype)
        return rows, rows.astype(np.float32)
    held = q8_0_roundtrip(x.astype(np.float16).astype(np.float32))
    blocks = x.astype(np.float16).astype(np.float32).reshape(*x.shape[:-1], d // 32, 32)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inverse = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, np.float32(1)), np.float32(0))
    y = (blocks * inverse).astype(np.float32)
    q = np.trunc(y + np.where(y < 0, np.float32(-0.5), np.float32(0.5))).astype(np.int8).reshape(x.shape)
    stream = np.zeros((*x.shape[:-2], layout.heads * layout.row_bytes), np.uint8)
    stream[..., : h_kv * d] = q.view(np.uint8).reshape(*x.shape[:-2], h_kv * d)
    scales = scale.astype(np.float16).reshape(*x.shape[:-2], h_kv * (d // 32))
    stream[..., h_kv * d: h_kv * d + scales.shape[-1] * 2] = scales.view(np.uint8)
    rows = stream.view(np.float16).reshape(*x.shape[:-2], layout.heads, d)
    return rows, held


class PagedCache:
    """Sequences of the given lengths in a cache of scattered pages ``[pages, 2, heads, 16, d]`` of ``kv_dtype``,
    with the page table arrays the kernels read (unused pages hold garbage, so reading past a sequence shows)."""

    def __init__(self, lengths: list[int], rng: np.random.Generator, spare_pages: int = 5,
                 dtype: str = "float32", poison: bool = False, h_kv: int = H_KV, d: int = D) -> None:
        counts = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in lengths]
        total = sum(counts) + spare_pages
        self.h_kv, self.d = h_kv, d
        raw = (rng.standard_normal((total, 2, PAGE_SIZE, h_kv, d)) * 3).astype(np.float32)
        rows, self.held = store(raw, dtype)  # [total, 2, 16, heads, D], [total, 2, 16, H_KV, D]
        self.pages = np.ascontiguousarray(rows.transpose(0, 1, 3, 2, 4))
        order = rng.permutation(total).astype(np.int32)
        self.indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        self.values = order[: self.indptr[-1]]
        self.last_len = np.array([n - (c - 1) * PAGE_SIZE if c else 0 for n, c in zip(lengths, counts, strict=True)],
                                 np.int32)
        self.lengths = lengths
        if poison:  # the slots past each sequence's end in its last page: NaN bits (never read, never weighted)
            for b, c in enumerate(counts):
                if c:
                    last = self.values[self.indptr[b + 1] - 1]
                    self.pages.view(np.uint8)[last, :, :, self.last_len[b]:] = 0xFF

    def kv(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of sequence ``b`` as the cache holds them, ``[n, H_KV, D]`` each (float32)."""
        ids = self.values[self.indptr[b]: self.indptr[b + 1]]
        k = self.held[ids, 0].reshape(-1, self.h_kv, self.d)[: self.lengths[b]]
        v = self.held[ids, 1].reshape(-1, self.h_kv, self.d)[: self.lengths[b]]
        return k, v

    def rows(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """The stored key and value rows of sequence ``b``, ``[n, heads, D]`` each."""
        ids = self.values[self.indptr[b]: self.indptr[b + 1]]
        shape = (-1, self.pages.shape[2], self.pages.shape[4])
        k = self.pages[ids, 0].transpose(0, 2, 1, 3).reshape(shape)
        v = self.pages[ids, 1].transpose(0, 2, 1, 3).reshape(shape)
        return k[: self.lengths[b]], v[: self.lengths[b]]

    def args(self) -> list[tvm.runtime.Tensor]:
        return [tvm.runtime.tensor(a, DEV) for a in (self.pages, self.indptr, self.values, self.last_len)]


def tensor(a: np.ndarray) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(a, DEV)


def element(kv_dtype: str) -> str:
    """The cache's element type: q, the outputs, the pages."""
    return KVLayout(kv_dtype, H_KV, D).dtype


def queries(rng: np.random.Generator, n: int, kv_dtype: str) -> np.ndarray:
    return rng.standard_normal((n, H_Q, D)).astype(element(kv_dtype))


def seen(q: np.ndarray, kv_dtype: str) -> np.ndarray:
    """The query as the kernels score it: on a q8_0 cache through q8_0 blocks (``numpy_llama.q8_0_query``, the
    kernels' quantisation exactly: the reference then differs only by float32 rounding), else ``q`` itself."""
    return q8_0_query(q.astype(np.float32), SM_SCALE) if kv_dtype == "q8_0" else q


def carried(q: np.ndarray, kv_dtype: str, k: np.ndarray | None = None, v: np.ndarray | None = None) -> np.ndarray:
    """``q [n, H_Q, D]`` with the carried heads: the tokens' stored ``k`` and ``v`` rows (NaN bits when not given:
    unread)."""
    heads = KVLayout(kv_dtype, H_KV, D).heads
    extra = np.full((q.shape[0], 2 * heads, D), np.nan, q.dtype)
    if k is not None and v is not None:
        extra = np.concatenate([k, v], axis=1).astype(q.dtype)
    return np.concatenate([q, extra], axis=1)


def outputs(rows: int, kv_dtype: str) -> tuple[tvm.runtime.Tensor, tvm.runtime.Tensor]:
    """NaN-filled output and lse buffers with the carried heads."""
    heads = KVLayout(kv_dtype, H_KV, D).query_heads(H_Q)
    return (tensor(np.full((rows, heads, D), np.nan, element(kv_dtype))),
            tensor(np.full((rows, heads), np.nan, np.float32)))


def check(out, lse, want_out, want_lse, dtype: str = "float32") -> None:
    """Outputs of the query heads within 2e-5 of the largest (float32 arithmetic), float16 ones also rounded once
    (half an ulp: 2^-11 relative)."""
    rtol = 2.0**-11 if dtype != "float32" else 0
    np.testing.assert_allclose(out.numpy()[:, :H_Q].astype(np.float64), want_out, rtol=rtol,
                               atol=2e-5 * max(1.0, np.abs(want_out).max()))
    np.testing.assert_allclose(lse.numpy()[:, :H_Q], want_lse, rtol=1e-5, atol=1e-4)
