"""The KV cache's decode attention kernel (``compile/decode_attention.py``) against a numpy attention
(``attention_reference.py``) on awkward sizes: one token, partly filled pages, contexts not a multiple of the page
size or of a chunk, on one thread and on both, several sequences of different lengths (one with no pages), pages
scattered over the cache, GQA with 9 query heads over 3 KV heads (and 6 over 3 of 128 on a q8_0 cache, with and
without AVX512-VNNI); float32, float16 and q8_0 caches. And the verify forward's exact mode: the paged prefill
kernel's rows (``compile/prefill_attention.py``) equal decode steps bit for bit, sliding layers included. The prefill
kernels against numpy: ``test_prefill_attention.py`` (the two files' kernels build on two workers with ``-n 2``)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from attention_reference import (
    DTYPES,
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
    tensor,
)
from logitproc.compile import attention_mode
from logitproc.compile.decode_attention import MIN_PAGES, PAGE_SIZE, SERIAL_PAGES, SPLITS, decode_attention_kernel
from logitproc.compile.kv_layout import KVLayout
from logitproc.compile.packed_matvec import has_vnni
from logitproc.compile.prefill_attention import paged_prefill_kernel
from logitproc.runtime.targets import build_features, resolve_target

#: a Gemma-style layer's options for the exact mode's test: a window not a multiple of the page size, a soft-cap
WINDOW, SOFTCAP = 37, 2.0


@pytest.fixture(scope="module", params=DTYPES)
def decode(request):
    """(the decode kernel over pages of this dtype, the dtype)."""
    return compiled(decode_attention_kernel, H_KV, H_Q, D, request.param), request.param


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


@pytest.fixture(scope="module", params=[(dtype, sliding) for dtype in DTYPES for sliding in (False, True)],
                ids=[f"{dtype}{'-sliding' if sliding else ''}" for dtype in DTYPES for sliding in (False, True)])
def decode_and_paged(request):
    """(the decode kernel, the paged prefill kernel, their dtype, whether a sliding layer: kernels built with a
    ``WINDOW`` and a ``SOFTCAP``, called with the window's switch). A plain layer's kernels are the decode and
    prefill tests' builds (the same arguments: the defaults, no soft-cap and no window)."""
    dtype, sliding = request.param
    options = (SOFTCAP, WINDOW) if sliding else ()
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
