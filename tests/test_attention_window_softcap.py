"""The attention kernels' two Gemma options (``compile/decode_attention.py``, ``compile/prefill_attention.py``)
against a numpy attention: ``softcap`` (every score ``cap * tanh(s / cap)``) and ``window`` (a layer whose
``sm_scale`` marks it windowed, ``compile/attention_mode.py``, sees only the keys less than ``window`` positions
behind each query, by the cache's
``q_rope_position`` / ``k_rope_pos_offset``; a positive one sees them all). Awkward sizes: windows not a multiple of
the page size, sequences shorter and longer than the window, several decode chunks wholly outside the window, key
positions starting past 0 (a forked sequence's own block), float32 and float16 caches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from kernel_harness import built_for_cpu
from logitproc.compile import attention_mode
from logitproc.compile.decode_attention import PAGE_SIZE, decode_attention_kernel
from logitproc.compile.prefill_attention import paged_prefill_kernel, ragged_prefill_kernel

H_Q, H_KV, D = 4, 2, 32
SCALE = 1 / math.sqrt(24)
WINDOW, SOFTCAP = 21, 1.5
EMPTY_LSE = -5e4
DEV = tvm.cpu()


def compiled(factory, *args):
    return built_for_cpu(factory, *args)


@pytest.fixture(scope="module", params=["float32", "float16"])
def kernels(request):
    """(decode, paged prefill, ragged prefill) with the soft-cap and the window, and the cache's dtype."""
    dtype = request.param
    return tuple(compiled(k, H_KV, H_Q, D, dtype, SOFTCAP, WINDOW) for k in (
        decode_attention_kernel, paged_prefill_kernel, ragged_prefill_kernel)), dtype


def tensor(a: np.ndarray) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(a, DEV)


def with_carried(q: np.ndarray) -> np.ndarray:
    """``q [n, H_Q, D]`` with the cache's carried heads (``KVLayout.query_heads``: unread here, NaN)."""
    return np.concatenate([q, np.full((q.shape[0], 2 * H_KV, D), np.nan, q.dtype)], axis=1)


def outputs(rows: int, dtype: str) -> tuple[tvm.runtime.Tensor, tvm.runtime.Tensor]:
    """NaN-filled output and lse buffers with the carried heads."""
    return (tensor(np.full((rows, H_Q + 2 * H_KV, D), np.nan, dtype)),
            tensor(np.full((rows, H_Q + 2 * H_KV), np.nan, np.float32)))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seen: list[range]) -> tuple[np.ndarray, np.ndarray]:
    """``q [m, H_Q, D]`` against ``k, v [n, H_KV, D]``, query ``i`` seeing the keys ``seen[i]``, scores capped: the
    output and the base-2 log-sum-exp (0 and -5e4 for a query that sees nothing)."""
    out, lse = np.zeros(q.shape, np.float64), np.full(q.shape[:2], EMPTY_LSE)
    for i, keys in enumerate(seen):
        if not len(keys):
            continue
        for h in range(H_Q):
            s = k[keys, h // (H_Q // H_KV)].astype(np.float64) @ q[i, h].astype(np.float64) * SCALE
            s = SOFTCAP * np.tanh(s / SOFTCAP) * math.log2(math.e)
            w = np.exp2(s - s.max())
            out[i, h] = w @ v[keys, h // (H_Q // H_KV)] / w.sum()
            lse[i, h] = s.max() + math.log2(w.sum())
    return out, lse


def pages_of(lengths: list[int], rng: np.random.Generator, dtype: str):
    """Sequences' keys and values in scattered pages: (k, v per sequence, pages, indptr, values, last lengths)."""
    counts = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in lengths]
    total = sum(counts) + 3
    pages = (rng.standard_normal((total, 2, H_KV, PAGE_SIZE, D)) * 2).astype(dtype)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    values = rng.permutation(total).astype(np.int32)[: indptr[-1]]
    last = np.array([n - (c - 1) * PAGE_SIZE if c else 0 for n, c in zip(lengths, counts, strict=True)], np.int32)
    kv = []
    for b, n in enumerate(lengths):
        ids = values[indptr[b]: indptr[b + 1]]
        kv.append(tuple(pages[ids, i].transpose(0, 2, 1, 3).reshape(-1, H_KV, D)[:n] for i in (0, 1)))
    return kv, [tensor(a) for a in (pages, indptr, values, last)]


def check(out, lse, want_out, want_lse, dtype: str) -> None:
    rtol = 2.0**-10 if dtype == "float16" else 0
    np.testing.assert_allclose(out.numpy()[:, :H_Q].astype(np.float64), want_out, rtol=rtol,
                               atol=5e-5 * max(1.0, np.abs(want_out).max()))
    np.testing.assert_allclose(lse.numpy()[:, :H_Q], want_lse, rtol=1e-5, atol=2e-4)


LENGTHS = [1, 7, WINDOW, WINDOW + 1, 40, 333]
#: positions of each sequence's first key in the pages (a forked sequence's own block starts past 0)
OFFSETS = [0, 3, 0, 16, 5, 32]


@pytest.mark.parametrize("windowed", [True, False], ids=["sliding layer", "global layer"])
def test_decode_sees_the_window_of_a_sliding_layer(kernels, windowed: bool) -> None:
    (decode, _, _), dtype = kernels
    rng = np.random.default_rng(11)
    kv, args = pages_of(LENGTHS, rng, dtype)
    b = len(LENGTHS)
    q = rng.standard_normal((b, H_Q, D)).astype(dtype)
    out, lse = outputs(b, dtype)
    offsets = np.array(OFFSETS, np.int32)
    positions = offsets + np.array(LENGTHS, np.int32) - 1  # the query is each sequence's last token
    decode(tensor(with_carried(q)), *args, tensor(offsets), tensor(positions), out, lse, 0, 1.0, 10000.0,
           attention_mode.encode(SCALE, windowed=windowed))
    want = [attention(q[i: i + 1], *kv[i], [range(max(0, n - WINDOW) if windowed else 0, n)])
            for i, n in enumerate(LENGTHS)]
    check(out, lse, np.concatenate([w[0] for w in want]), np.concatenate([w[1] for w in want]), dtype)


@pytest.mark.parametrize("windowed", [True, False], ids=["sliding layer", "global layer"])
def test_prefill_sees_the_window_of_a_sliding_layer(kernels, windowed: bool) -> None:
    """New tokens against the cached ones (paged, not causal) and against themselves (ragged, causal)."""
    (_, paged, ragged), dtype = kernels
    rng = np.random.default_rng(12)
    cached, new = [0, 5, 30, 100], [3, 30, 1, 45]
    kv, args = pages_of(cached, rng, dtype)
    total = sum(new)
    q = rng.standard_normal((total, H_Q, D)).astype(dtype)
    k_new, v_new = (rng.standard_normal((total, H_KV, D)).astype(dtype) for _ in range(2))
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    offsets = np.array([0, 16, 7, 2], np.int32)
    positions = np.concatenate([o + c + np.arange(n) for o, c, n in zip(offsets, cached, new, strict=True)])
    scale = attention_mode.encode(SCALE, windowed=windowed)
    results = []
    for kernel, k_offsets in ((paged, offsets), (ragged, offsets + np.array(cached, np.int32))):
        out, lse = outputs(total, dtype)
        if kernel is paged:
            kernel(tensor(with_carried(q)), tensor(q_indptr), *args, tensor(k_offsets),
                   tensor(positions.astype(np.int32)), out, lse, 0, 0, 1.0, 10000.0, scale)
        else:
            kernel(tensor(with_carried(q)), tensor(q_indptr), tensor(k_new), tensor(v_new), tensor(q_indptr),
                   tensor(positions.astype(np.int32)), tensor(k_offsets), out, lse, 1, 0, 1.0, 10000.0, scale)
        results.append((out, lse))
    for part, (out, lse) in enumerate(results):
        want_out, want_lse = np.zeros((total, H_Q, D)), np.zeros((total, H_Q))
        for b, (c, n) in enumerate(zip(cached, new, strict=True)):
            rows = slice(q_indptr[b], q_indptr[b + 1])
            if part == 0:  # paged: the cached keys 0 .. c - 1; the new token r sits at c + r
                seen = [range(max(0, c + r - WINDOW + 1) if windowed else 0, c) for r in range(n)]
                want_out[rows], want_lse[rows] = attention(q[rows], *kv[b], seen)
            else:  # ragged: the new keys 0 .. r
                seen = [range(max(0, r - WINDOW + 1) if windowed else 0, r + 1) for r in range(n)]
                want_out[rows], want_lse[rows] = attention(q[rows], k_new[rows], v_new[rows], seen)
        check(out, lse, want_out, want_lse, dtype)
