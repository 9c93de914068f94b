"""The KV cache's attention kernels (``compile/decode_attention.py``, ``compile/prefill_attention.py``) against a
numpy attention on awkward sizes: contexts not a multiple of the page size or of a chunk, one token, partly filled
pages, several sequences of different lengths (one with no pages), pages scattered over the cache, GQA with 9 query
heads over 3 KV heads (and 6 over 3 of 128 on a q8_0 cache; the prefill kernels also with 8 over 2 and 4 over 4);
float32, float16 and q8_0 caches (q8_0: the query quantised as the kernels do, ``numpy_llama.q8_0_query``). Outputs
and base-2 log-sum-exps are compared, as the cache's merge uses both."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from kernel_harness import built_for_cpu
from logitproc.compile import attention_mode
from logitproc.compile.decode_attention import MIN_PAGES, PAGE_SIZE, SERIAL_PAGES, SPLITS, decode_attention_kernel
from logitproc.compile.kv_layout import KVLayout
from logitproc.compile.packed_matvec import has_vnni
from logitproc.compile.prefill_attention import QUERY_BLOCK, paged_prefill_kernel, ragged_prefill_kernel
from logitproc.runtime.targets import build_features, resolve_target
from logitproc.serve.numpy_llama import q8_0_query, q8_0_roundtrip

H_Q, H_KV, D = 9, 3, 64
DTYPES = ["float32", "float16", "q8_0"]
SM_SCALE = 1 / math.sqrt(D)
#: the verify forward's ``sm_scale``: the exact mode asked for (``compile/attention_mode.py``)
EXACT = attention_mode.encode(SM_SCALE, exact=True)
#: a Gemma-style layer's options for the exact mode's test: a window not a multiple of the page size, a soft-cap
WINDOW, SOFTCAP = 37, 2.0
EMPTY_LSE = -5e4
DEV = tvm.cpu()


def compiled(factory, *args, **kwargs):
    """The kernel ``factory(*args, **kwargs)`` compiled for this CPU, as a callable (once, in the build cache)."""
    return built_for_cpu(factory, *args, **kwargs)


@pytest.fixture(scope="module", params=DTYPES)
def decode(request):
    """(the decode kernel over pages of this dtype, the dtype)."""
    return compiled(decode_attention_kernel, H_KV, H_Q, D, request.param), request.param


@pytest.fixture(scope="module", params=DTYPES)
def paged_prefill(request):
    return compiled(paged_prefill_kernel, H_KV, H_Q, D, request.param), request.param


@pytest.fixture(scope="module", params=DTYPES)
def ragged_prefill(request):
    return compiled(ragged_prefill_kernel, H_KV, H_Q, D, request.param), request.param


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


CHUNK = MIN_PAGES * PAGE_SIZE
#: Up to SERIAL_PAGES pages in all the kernel runs on one thread, beyond on both: cases on both sides.
DECODE_CASES = {
    "one token": [1],
    "one partly filled page": [7],
    "exactly one page": [PAGE_SIZE],
    "the most pages run serially": [SERIAL_PAGES * PAGE_SIZE],
    "one token more than that": [SERIAL_PAGES * PAGE_SIZE + 1],
    "a page and one token": [PAGE_SIZE + 1],
    "not a multiple of a chunk": [SPLITS * CHUNK + 5],
    "long, every chunk used": [SPLITS * CHUNK * 3 + 11],
    "several lengths and an empty sequence": [33, 1, 0, 250, 16, 1000],
}


@pytest.mark.parametrize("lengths", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_decode_attention_matches_numpy(decode, lengths: list[int]) -> None:
    """float32 and float16 pages (q and the output in the pages' type, the arithmetic float32); the slots past each
    sequence's end hold NaN and inf."""
    kernel, dtype = decode
    rng = np.random.default_rng(len(lengths) * 1000 + sum(lengths))
    cache = PagedCache(lengths, rng, dtype=dtype, poison=True)
    b = len(lengths)
    q = queries(rng, b, dtype)
    out, lse = outputs(b, dtype)
    zeros = tensor(np.zeros(b, np.int32))
    kernel(tensor(carried(q, dtype)), *cache.args(), zeros, zeros, out, lse, 0, 1.0, 10000.0, SM_SCALE)
    want_out = np.zeros((b, H_Q, D))
    want_lse = np.zeros((b, H_Q))
    for i, n in enumerate(lengths):
        k, v = cache.kv(i)
        want_out[i], want_lse[i] = (x[0] for x in attention(seen(q[i: i + 1], dtype), k, v, [n]))
    check(out, lse, want_out, want_lse, dtype)


PREFILL_CASES = {
    "one new token after one cached": ([1], [1]),
    "new tokens after a partly filled page": ([5], [7]),
    "blocks of new tokens, the last partial": ([2 * QUERY_BLOCK + 3], [100]),
    "several sequences, one without history, one without new tokens": ([3, 17, 0, 1], [40, 0, 9, 16]),
}


@pytest.mark.parametrize(("new", "cached"), PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_paged_prefill_matches_numpy(paged_prefill, new: list[int], cached: list[int]) -> None:
    """New tokens (not causal: all cached keys come before them) against the cached keys in the pages."""
    paged_prefill, dtype = paged_prefill
    rng = np.random.default_rng(sum(new) + 7 * sum(cached))
    cache = PagedCache(cached, rng, dtype=dtype)
    total = sum(new)
    q = queries(rng, total, dtype)
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    out, lse = outputs(total, dtype)
    pages, indptr, values, last_len = cache.args()
    paged_prefill(tensor(carried(q, dtype)), tensor(q_indptr), pages, indptr, values, last_len,
                  tensor(np.zeros(len(new), np.int32)), tensor(np.zeros(total, np.int32)), out, lse,
                  0, 0, 1.0, 10000.0, SM_SCALE)
    want_out, want_lse = np.zeros((total, H_Q, D)), np.zeros((total, H_Q))
    for b, n in enumerate(new):
        k, v = cache.kv(b)
        rows = slice(q_indptr[b], q_indptr[b + 1])
        want_out[rows], want_lse[rows] = attention(seen(q[rows], dtype), k, v, [cached[b]] * n)
    check(out, lse, want_out, want_lse, dtype)


RAGGED_CASES = {"one token": [1], "a block and a bit": [QUERY_BLOCK + 1], "several sequences": [5, 1, 70, 33],
                "long": [300]}


@pytest.mark.parametrize("new", RAGGED_CASES.values(), ids=RAGGED_CASES.keys())
def test_ragged_prefill_is_causal_attention(ragged_prefill, new: list[int]) -> None:
    """New tokens against themselves, causally, each sequence on its own."""
    ragged_prefill, dtype = ragged_prefill
    rng = np.random.default_rng(sum(new))
    total = sum(new)
    q = queries(rng, total, dtype)
    (k_rows, k), (v_rows, v) = (store(rng.standard_normal((total, H_KV, D)).astype(np.float32), dtype)
                                for _ in range(2))
    indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    out, lse = outputs(total, dtype)
    zeros_b, zeros_t = tensor(np.zeros(len(new), np.int32)), tensor(np.zeros(total, np.int32))
    ragged_prefill(tensor(carried(q, dtype)), tensor(indptr), tensor(k_rows), tensor(v_rows), tensor(indptr), zeros_t,
                   zeros_b, out, lse, 1, 0, 1.0, 10000.0, SM_SCALE)
    want_out, want_lse = np.zeros((total, H_Q, D)), np.zeros((total, H_Q))
    for b, n in enumerate(new):
        rows = slice(indptr[b], indptr[b + 1])
        want_out[rows], want_lse[rows] = attention(seen(q[rows], dtype), k[rows], v[rows], list(range(1, n + 1)))
    check(out, lse, want_out, want_lse, dtype)


@pytest.mark.parametrize(("h_q", "h_kv"), [(8, 2), (4, 4)], ids=["4 query heads a KV head", "1 a KV head"])
def test_prefill_with_other_head_groups_matches_numpy(h_q: int, h_kv: int) -> None:
    """The prefill kernels with 32 rows a block (Llama 3.2 1B's 32 / 8 heads: 4 a KV head) and 8 (1 a KV head),
    float16 pages: the new tokens against themselves (causal) and against cached ones."""
    rng = np.random.default_rng(h_q * 10 + h_kv)
    dtype, new, cached = "float16", [70, 1, 33], [100, 5, 0]
    total = sum(new)
    indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    layout = KVLayout(dtype, h_kv, D)
    q = rng.standard_normal((total, h_q, D)).astype(dtype)
    k, v = (rng.standard_normal((total, h_kv, D)).astype(dtype) for _ in range(2))
    q_rows = np.concatenate([q, np.full((total, 2 * layout.heads, D), np.nan, dtype)], axis=1)

    def outs() -> tuple[tvm.runtime.Tensor, tvm.runtime.Tensor]:
        return (tensor(np.full((total, layout.query_heads(h_q), D), np.nan, dtype)),
                tensor(np.full((total, layout.query_heads(h_q)), np.nan, np.float32)))

    def compare(out, lse, want_out, want_lse) -> None:
        np.testing.assert_allclose(out.numpy()[:, :h_q].astype(np.float64), want_out, rtol=2.0**-11,
                                   atol=2e-5 * max(1.0, np.abs(want_out).max()))
        np.testing.assert_allclose(lse.numpy()[:, :h_q], want_lse, rtol=1e-5, atol=1e-4)

    zeros_b, zeros_t = tensor(np.zeros(len(new), np.int32)), tensor(np.zeros(total, np.int32))
    out, lse = outs()
    compiled(ragged_prefill_kernel, h_kv, h_q, D, dtype)(
        tensor(q_rows), tensor(indptr), tensor(k), tensor(v), tensor(indptr), zeros_t, zeros_b, out, lse, 1, 0, 1.0,
        10000.0, SM_SCALE)
    want_out, want_lse = np.zeros((total, h_q, D)), np.zeros((total, h_q))
    for b, n in enumerate(new):
        rows = slice(indptr[b], indptr[b + 1])
        want_out[rows], want_lse[rows] = attention(q[rows], k[rows], v[rows], list(range(1, n + 1)))
    compare(out, lse, want_out, want_lse)

    cache = PagedCache(cached, rng, dtype=dtype, poison=True, h_kv=h_kv)
    out, lse = outs()
    compiled(paged_prefill_kernel, h_kv, h_q, D, dtype)(
        tensor(q_rows), tensor(indptr), *cache.args(), zeros_b, zeros_t, out, lse, 0, 0, 1.0, 10000.0, SM_SCALE)
    for b, n in enumerate(new):
        rows = slice(indptr[b], indptr[b + 1])
        want_out[rows], want_lse[rows] = attention(q[rows], *cache.kv(b), [cached[b]] * n)
    compare(out, lse, want_out, want_lse)


@pytest.fixture(scope="module", params=[(dtype, sliding) for dtype in DTYPES for sliding in (False, True)],
                ids=[f"{dtype}{'-sliding' if sliding else ''}" for dtype in DTYPES for sliding in (False, True)])
def decode_and_paged(request):
    """(the decode kernel, the paged prefill kernel, their dtype, whether a sliding layer: kernels built with a
    ``WINDOW`` and a ``SOFTCAP``, called with the window's switch)."""
    dtype, sliding = request.param
    options = (SOFTCAP, WINDOW) if sliding else (0.0, 0)
    return (compiled(decode_attention_kernel, H_KV, H_Q, D, dtype, *options),
            compiled(paged_prefill_kernel, H_KV, H_Q, D, dtype, *options), dtype, sliding)


EXACT_CASES = {
    "one cached token, one new": ([1], [1]),
    "a partly filled page gets two": ([15], [2]),
    "new tokens start a page": ([16], [9]),
    "33 new tokens over three pages": ([17], [33]),
    "several sequences": ([100, 7, 40], [5, 1, 17]),
    "past the serial limit": ([2 * SERIAL_PAGES * PAGE_SIZE + 3], [6]),
    "long, every chunk used": ([SPLITS * MIN_PAGES * PAGE_SIZE * 3 + 11], [4]),
}


@pytest.mark.parametrize(("cached", "new"), EXACT_CASES.values(), ids=EXACT_CASES.keys())
def test_exact_mode_rows_are_decode_steps_bit_for_bit(decode_and_paged, cached: list[int], new: list[int]) -> None:
    """The verify forward's attention (the exact mode): sequence ``b``'s new token ``j`` (its k and v in the
    carried heads of q, the pages holding only the cached keys: the slots after them are NaN) gives exactly the
    output and lse a decode step gives it once the pages hold the ``cached[b] + j + 1`` keys; plus a block that
    ends before the rows' tokens (one the sequence shares): every row sees all its keys, as decode does. A sliding
    layer (soft-capped scores, the window's switch in ``sm_scale``, keys' positions starting past 0) too."""
    decode, paged, dtype, sliding = decode_and_paged
    plain = attention_mode.encode(SM_SCALE, windowed=sliding)
    exact = attention_mode.encode(SM_SCALE, windowed=sliding, exact=True)
    rng = np.random.default_rng(sum(cached) + 31 * sum(new))
    full = PagedCache([c + n for c, n in zip(cached, new, strict=True)], rng, dtype=dtype)
    total = sum(new)
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = queries(rng, total, dtype)
    k_new = np.concatenate([full.rows(b)[0][c:] for b, c in enumerate(cached)])
    v_new = np.concatenate([full.rows(b)[1][c:] for b, c in enumerate(cached)])
    rows = [(b, j) for b, n in enumerate(new) for j in range(n)]
    offsets = np.array([5 * b + 3 if sliding else 0 for b in range(len(new))], np.int32)  # the keys' positions

    def table(lengths: list[int], first: list[int]) -> list[tvm.runtime.Tensor]:
        """Page table arrays of sequences of ``lengths`` on the pages of ``full``'s sequences ``first``."""
        counts = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in lengths]
        values = np.concatenate([full.values[full.indptr[b]: full.indptr[b] + c] for b, c in zip(first, counts,
                                                                                                 strict=True)])
        last = np.array([n - (c - 1) * PAGE_SIZE for n, c in zip(lengths, counts, strict=True)], np.int32)
        return [tensor(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)), tensor(values), tensor(last)]

    # decode steps: one "sequence" per row, on the same pages, with its length
    want, want_lse = outputs(total, dtype)
    row_offsets = tensor(np.array([offsets[b] for b, _ in rows], np.int32))
    positions = np.array([offsets[b] + cached[b] + j for b, j in rows], np.int32)
    decode(tensor(carried(q, dtype)), tensor(full.pages), *table([cached[b] + j + 1 for b, j in rows],
                                                               [b for b, _ in rows]),
           row_offsets, tensor(positions), want, want_lse, 0, 1.0, 10000.0, plain)
    # the verify: the pages hold the cached keys only (the new tokens' slots are NaN bits)
    pages = full.pages.copy()
    for b, c in enumerate(cached):
        ids = full.values[full.indptr[b]: full.indptr[b + 1]]
        for pos in range(c, c + new[b]):
            pages.view(np.uint8)[ids[pos // PAGE_SIZE], :, :, pos % PAGE_SIZE] = 0xFF
    verify_table = table(cached, list(range(len(cached))))
    out, lse = outputs(total, dtype)
    paged(tensor(carried(q, dtype, k_new, v_new)), tensor(q_indptr), tensor(pages), *verify_table,
          tensor(offsets), tensor(positions), out, lse, 0, 0, 1.0, 10000.0, exact)
    np.testing.assert_array_equal(out.numpy()[:, :H_Q], want.numpy()[:, :H_Q])
    np.testing.assert_array_equal(lse.numpy()[:, :H_Q], want_lse.numpy()[:, :H_Q])
    # a shared block ending before the rows' tokens: each row sees its keys, as a decode over that block does
    out, lse = outputs(total, dtype)
    paged(tensor(carried(q, dtype, k_new, v_new)), tensor(q_indptr), tensor(pages), *verify_table,
          tensor(offsets), tensor(positions + 1), out, lse, 0, 0, 1.0, 10000.0, exact)
    if sliding:  # each row as a decode step over the shared block from its position (numpy: the window's tests)
        want, want_lse = outputs(total, dtype)
        decode(tensor(carried(q, dtype)), tensor(pages), *table([cached[b] for b, _ in rows], [b for b, _ in rows]),
               row_offsets, tensor(positions + 1), want, want_lse, 0, 1.0, 10000.0, plain)
        np.testing.assert_array_equal(out.numpy()[:, :H_Q], want.numpy()[:, :H_Q])
        np.testing.assert_array_equal(lse.numpy()[:, :H_Q], want_lse.numpy()[:, :H_Q])
        return
    want_out, want_lse = np.zeros((total, H_Q, D)), np.zeros((total, H_Q))
    for b, n in enumerate(new):
        k, v = full.kv(b)
        sl = slice(q_indptr[b], q_indptr[b + 1])
        want_out[sl], want_lse[sl] = attention(seen(q[sl], dtype), k, v, [cached[b]] * n)
    check(out, lse, want_out, want_lse, dtype)


def test_ragged_exact_mode_leaves_the_rows_to_the_paged_kernel(ragged_prefill) -> None:
    """The exact mode: every row's output is 0 and its lse ``EMPTY_LSE`` (the cache's merge passes the paged
    kernel's rows through unchanged)."""
    ragged_prefill, dtype = ragged_prefill
    rng = np.random.default_rng(3)
    q = queries(rng, 7, dtype)
    k, v = (store(rng.standard_normal((7, H_KV, D)).astype(np.float32), dtype)[0] for _ in range(2))
    indptr = np.array([0, 3, 7], np.int32)
    out, lse = outputs(7, dtype)
    ragged_prefill(tensor(carried(q, dtype, k, v)), tensor(indptr), tensor(k), tensor(v), tensor(indptr),
                   tensor(np.zeros(7, np.int32)), tensor(np.zeros(2, np.int32)), out, lse, 1, 0, 1.0, 10000.0, EXACT)
    assert not out.numpy().any() and (lse.numpy() == EMPTY_LSE).all()


WIDE_Q, WIDE_KV, WIDE_D = 6, 3, 128


def test_q8_0_decode_with_heads_of_128_matches_numpy_and_vnni_gives_the_same_bits() -> None:
    """Heads of 128 (four q8_0 blocks; 3 KV heads, so a head's values straddle the cache's rows) against numpy on
    several odd lengths; on a CPU with AVX512-VNNI the ``vpdpbusd`` kernel gives the AVX2 kernel's outputs bit for
    bit (the same integer block sums)."""
    rng = np.random.default_rng(128)
    lengths = [1, 15, 37, 300, 0, 16 * SPLITS * MIN_PAGES + 3]
    cache = PagedCache(lengths, rng, dtype="q8_0", poison=True, h_kv=WIDE_KV, d=WIDE_D)
    layout = KVLayout("q8_0", WIDE_KV, WIDE_D)
    q = rng.standard_normal((len(lengths), WIDE_Q, WIDE_D)).astype(np.float16)
    q_all = np.concatenate([q, np.full((len(lengths), 2 * layout.heads, WIDE_D), np.nan, np.float16)], axis=1)
    zeros = tensor(np.zeros(len(lengths), np.int32))
    vnni = has_vnni(build_features(resolve_target("cpu").tvm_target()))
    results = []
    for with_vnni in (False, True) if vnni else (False,):
        out = tensor(np.full((len(lengths), layout.query_heads(WIDE_Q), WIDE_D), np.nan, np.float16))
        lse = tensor(np.full((len(lengths), layout.query_heads(WIDE_Q)), np.nan, np.float32))
        compiled(decode_attention_kernel, WIDE_KV, WIDE_Q, WIDE_D, "q8_0", vnni=with_vnni)(
            tensor(q_all), *cache.args(), zeros, zeros, out, lse, 0, 1.0, 10000.0, SM_SCALE)
        results.append((out.numpy()[:, :WIDE_Q], lse.numpy()[:, :WIDE_Q]))
    want_out, want_lse = np.zeros((len(lengths), WIDE_Q, WIDE_D)), np.zeros((len(lengths), WIDE_Q))
    for i, n in enumerate(lengths):
        k, v = cache.kv(i)
        want_out[i], want_lse[i] = (x[0] for x in attention(seen(q[i: i + 1], "q8_0"), k, v, [n]))
    out, lse = results[0]
    np.testing.assert_allclose(out.astype(np.float64), want_out, rtol=2.0**-11,
                               atol=2e-5 * max(1.0, np.abs(want_out).max()))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-4)
    for other in results[1:]:
        np.testing.assert_array_equal(other[0], out)
        np.testing.assert_array_equal(other[1], lse)


def test_decode_kernel_rejects_bad_head_counts() -> None:
    with pytest.raises(ValueError, match="head size 36 is not a multiple of 8"):
        decode_attention_kernel(3, 9, 36)
    with pytest.raises(ValueError, match="query heads 8 are not a multiple of KV heads 3"):
        decode_attention_kernel(3, 8, 64)
    with pytest.raises(ValueError, match=r"kv_dtype 'bfloat16' is not supported \(float16, float32, q8_0\)"):
        decode_attention_kernel(3, 9, 64, "bfloat16")
