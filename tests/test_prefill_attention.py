"""The KV cache's prefill attention kernels (``compile/prefill_attention.py``) against a numpy attention
(``attention_reference.py``) on awkward sizes: one new token, new tokens after a partly filled page, blocks of new
tokens the last partial, several sequences (one without history, one without new tokens), pages scattered over the
cache; the paged kernel (new tokens against the cached ones) and the ragged one (new tokens against themselves,
causally); GQA with 9 query heads over 3 KV heads, and 8 over 2 and 4 over 4; float32, float16 and q8_0 caches. The
ragged kernel's exact mode leaves the rows to the paged one. The decode kernel and the exact mode's equality with
decode: ``test_decode_attention.py``."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from attention_reference import (
    DTYPES,
    EMPTY_LSE,
    EXACT,
    H_KV,
    H_Q,
    SM_SCALE,
    D,
    PagedCache,
    attention,
    carried,
    check,
    compiled,
    outputs,
    queries,
    seen,
    store,
    tensor,
)
from logitproc.compile.kv_layout import KVLayout
from logitproc.compile.prefill_attention import QUERY_BLOCK, paged_prefill_kernel, ragged_prefill_kernel


@pytest.fixture(scope="module", params=DTYPES)
def paged_prefill(request):
    return compiled(paged_prefill_kernel, H_KV, H_Q, D, request.param), request.param


@pytest.fixture(scope="module", params=DTYPES)
def ragged_prefill(request):
    return compiled(ragged_prefill_kernel, H_KV, H_Q, D, request.param), request.param


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
