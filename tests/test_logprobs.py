"""runtime.logprobs: compute_logits, compute_logprobs (chunked) and logits_to_logprobs against a float64 numpy
log-softmax, on awkward sizes, extreme logits, bad inputs, and a peak-memory bound for the chunked path."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from logitproc.runtime import logprobs as lp

RTOL, ATOL = 1e-5, 1e-5


def reference_logprobs(logits: np.ndarray, target_ids: np.ndarray) -> np.ndarray:
    """float64 ``log_softmax(logits)[..., target]`` (rows of only -inf give -inf)."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    safe_m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.log(np.exp(x - safe_m).sum(axis=-1)) + safe_m[..., 0]
    picked = np.take_along_axis(x, np.asarray(target_ids)[..., None], axis=-1)[..., 0]
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(lse), -np.inf, picked - lse)


def reference_from_hidden(hidden: np.ndarray, lm_head: np.ndarray, target_ids: np.ndarray) -> np.ndarray:
    return reference_logprobs(hidden.astype(np.float64) @ lm_head.astype(np.float64).T, target_ids)


def make_case(seed: int, leading: tuple[int, ...], hidden_size: int, vocab: int):
    """hidden, lm_head scaled so that logits have a standard deviation of about 3; targets as int64."""
    rng = np.random.default_rng(seed)
    scale = math.sqrt(3.0 / math.sqrt(hidden_size))
    hidden = (rng.standard_normal((*leading, hidden_size)) * scale).astype(np.float32)
    lm_head = (rng.standard_normal((vocab, hidden_size)) * scale).astype(np.float32)
    return hidden, lm_head, rng.integers(0, vocab, leading)


# ---------------------------------------------------------------------------------------------------------------------
# Correctness

CHUNK_CASES = [
    # (vocab, rows, chunk_size)
    *[(1, n, c) for n in (1, 7, 2049) for c in (1, 7, 1024, n + 1)],
    *[(33, n, c) for n in (1, 7, 2049) for c in (1, 7, 1024, n + 1)],
    *[(128001, n, c) for n in (1, 7) for c in (1, 7, 1024, n + 1)],
]


@pytest.mark.parametrize(("vocab", "rows", "chunk_size"), CHUNK_CASES)
def test_compute_logprobs_matches_reference(lib, vocab: int, rows: int, chunk_size: int) -> None:
    hidden, lm_head, targets = make_case(vocab * 7 + rows, (rows,), 24, vocab)
    got = lp.compute_logprobs(hidden, lm_head, targets, chunk_size=chunk_size, library=lib)
    assert got.dtype == np.float32 and got.shape == (rows,)
    np.testing.assert_allclose(got, reference_from_hidden(hidden, lm_head, targets), rtol=RTOL, atol=ATOL)
    if vocab == 1:
        assert np.all(got == 0.0)  # the only token has probability 1


def test_three_dimensional_input_and_views(lib) -> None:
    """[B, T, H] gives [B, T]; a non-contiguous hidden view, Fortran-ordered lm_head and other int dtypes agree."""
    hidden, lm_head, targets = make_case(1, (3, 5), 16, 33)
    want = reference_from_hidden(hidden, lm_head, targets)
    got = lp.compute_logprobs(hidden, lm_head, targets, chunk_size=4, library=lib)
    assert got.shape == (3, 5) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    flat = lp.compute_logprobs(hidden.reshape(15, 16), lm_head, targets.reshape(15), chunk_size=4, library=lib)
    np.testing.assert_array_equal(flat.reshape(3, 5), got)

    hidden_view = np.ascontiguousarray(hidden.transpose(1, 0, 2)).transpose(1, 0, 2)  # [B, T, H], not C-contiguous
    assert not hidden_view.flags.c_contiguous
    for ids in (targets.astype(np.int32), targets.astype(np.uint8), targets.tolist()):
        got2 = lp.compute_logprobs(hidden_view, np.asfortranarray(lm_head), ids, chunk_size=6, library=lib)
        np.testing.assert_allclose(got2, want, rtol=RTOL, atol=ATOL)
    strided_head = np.repeat(lm_head, 2, axis=1)[:, ::2]  # neither C- nor F-contiguous
    got3 = lp.compute_logprobs(hidden, strided_head, targets, library=lib)
    np.testing.assert_allclose(got3, want, rtol=RTOL, atol=ATOL)


def test_inputs_are_not_modified_and_empty_inputs(lib) -> None:
    hidden, lm_head, targets = make_case(2, (9,), 8, 40)
    copies = hidden.copy(), lm_head.copy(), targets.copy()
    lp.compute_logprobs(hidden, lm_head, targets, chunk_size=4, library=lib)
    for before, after in zip(copies, (hidden, lm_head, targets), strict=True):
        np.testing.assert_array_equal(before, after)
    assert lp.compute_logprobs(hidden[:0], lm_head, targets[:0], library=lib).shape == (0,)
    empty = lp.compute_logprobs(np.zeros((2, 0, 8), np.float32), lm_head, np.zeros((2, 0), int), library=lib)
    assert empty.shape == (2, 0)
    assert lp.logits_to_logprobs(np.zeros((0, 5), np.float32), np.zeros(0, np.int32), library=lib).shape == (0,)


def test_chunks_run_through_the_kernel_with_bounded_rows(lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk is one call of the compiled kernel on at most chunk_size rows of logits."""
    kernel = lp._gather_kernel(lib)
    seen: list[tuple[int, ...]] = []

    def counting_kernel(logits, *rest) -> None:
        seen.append(tuple(logits.shape))
        kernel(logits, *rest)

    monkeypatch.setattr(lp, "_gather_kernel", lambda library: counting_kernel)
    hidden, lm_head, targets = make_case(3, (100,), 8, 50)
    got = lp.compute_logprobs(hidden, lm_head, targets, chunk_size=32, library=lib)
    assert seen == [(32, 50), (32, 50), (32, 50), (4, 50)]
    np.testing.assert_allclose(got, reference_from_hidden(hidden, lm_head, targets), rtol=RTOL, atol=ATOL)


def test_kernel_calls_stay_within_int32_sizes_and_copy_blocks(lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caps on one kernel call (rows * V < 2**31) and on the copy block, made small enough to exercise here."""
    kernel = lp._gather_kernel(lib)
    seen: list[int] = []

    def counting_kernel(logits, *rest) -> None:
        seen.append(logits.shape[0])
        kernel(logits, *rest)

    monkeypatch.setattr(lp, "_gather_kernel", lambda library: counting_kernel)
    monkeypatch.setattr(lp, "_MAX_KERNEL_ELEMENTS", 33 * 5 + 2)  # at most 5 rows of 33 logits per call
    hidden, lm_head, targets = make_case(10, (12,), 8, 33)
    got = lp.compute_logprobs(hidden, lm_head, targets, chunk_size=1024, library=lib)
    assert seen == [5, 5, 2]
    np.testing.assert_allclose(got, reference_from_hidden(hidden, lm_head, targets), rtol=RTOL, atol=ATOL)

    seen.clear()
    logits = lp.compute_logits(hidden, lm_head)
    in_place = lp.logits_to_logprobs(logits, targets, library=lib)  # in place, capped
    np.testing.assert_allclose(in_place, got, rtol=RTOL, atol=ATOL)
    assert seen == [5, 5, 2]
    seen.clear()
    monkeypatch.setattr(lp, "_COPY_BLOCK_BYTES", 33 * 4 * 3)  # copies of 3 rows
    copied = lp.logits_to_logprobs(np.asfortranarray(logits), targets, library=lib)
    np.testing.assert_allclose(copied, got, rtol=RTOL, atol=ATOL)
    assert seen == [3, 3, 3, 3]


def test_a_library_is_required(lib) -> None:
    """The kernel library is an explicit argument: nothing is compiled behind the caller's back."""
    logits, ids = np.zeros((2, 5), np.float32), np.zeros(2, np.int32)
    with pytest.raises(TypeError, match="library must be a KernelLibrary"):
        lp.logits_to_logprobs(logits, ids, library=None)
    with pytest.raises(TypeError, match="library"):
        lp.logits_to_logprobs(logits, ids)  # type: ignore[call-arg]


def test_compute_logits() -> None:
    hidden, lm_head, _ = make_case(4, (2, 3), 16, 33)
    for h in (hidden, hidden[0], hidden[0, 0]):  # [B, T, H], [N, H], [H]
        got = lp.compute_logits(h, lm_head)
        assert got.dtype == np.float32 and got.shape == (*h.shape[:-1], 33)
        assert lp._zero_copy_ok(got.reshape(-1, 33))  # logits_to_logprobs reads them in place
        np.testing.assert_allclose(got, h.astype(np.float64) @ lm_head.astype(np.float64).T, rtol=1e-5, atol=1e-5)


def test_logits_to_logprobs_shapes_and_layouts(lib) -> None:
    """[V], [N, V], [B, T, V]; misaligned, non-contiguous and read-only logits are read correctly, never modified."""
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((2, 3, 33)) * 3).astype(np.float32)
    targets = rng.integers(0, 33, (2, 3))
    want = reference_logprobs(logits, targets)
    got = lp.logits_to_logprobs(logits, targets, library=lib)
    assert got.shape == (2, 3) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    one_row = lp.logits_to_logprobs(logits[1, 2], targets[1, 2], library=lib)
    np.testing.assert_allclose(one_row, want[1, 2], rtol=RTOL, atol=ATOL)

    padded = np.zeros(logits.size + 1, np.float32)
    misaligned = padded[1:].reshape(logits.shape)  # data 4 bytes past an allocation: not 64-byte aligned
    misaligned[...] = logits
    readonly = logits.copy()
    readonly.flags.writeable = False
    transposed = np.ascontiguousarray(logits.transpose(1, 0, 2)).transpose(1, 0, 2)
    for variant in (misaligned, readonly, transposed, np.asfortranarray(logits)):
        before = variant.copy()
        np.testing.assert_allclose(lp.logits_to_logprobs(variant, targets, library=lib), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(variant, before)


def test_logits_to_logprobs_large_vocab_and_masked_tokens(lib) -> None:
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((4, 128001)) * 3).astype(np.float32)
    targets = rng.integers(0, 128001, 4)
    logits[1, targets[1]] = -np.inf  # a masked target
    logits[2] = -np.inf  # every token masked
    logits[3, ::2] = -np.inf
    got = lp.logits_to_logprobs(logits, targets, library=lib)
    assert got[1] == -np.inf and got[2] == -np.inf
    np.testing.assert_allclose(got, reference_logprobs(logits, targets), rtol=RTOL, atol=ATOL)


def test_huge_logits_keep_full_precision(lib) -> None:
    """Rows offset by +-1e4: the logprob is computed as (logit - max) - log_sum, without cancelling two values of 1e4.

    Hidden states and weights are multiples of 1/32 and small, so the float32 matmul is exact and the float64
    reference sees the very same logits: the comparison is tight (float32 ``logit - logsumexp`` near 1e4 would be off by
    up to half an ulp of 1e4, about 5e-4)."""
    rng = np.random.default_rng(7)
    rows, hidden_size, vocab = 6, 32, 1000
    hidden = (rng.integers(-32, 33, (rows, hidden_size)) / 32).astype(np.float32)
    lm_head = (rng.integers(-32, 33, (vocab, hidden_size)) / 32).astype(np.float32)
    lm_head[:, 0] = 1.0
    hidden[0, 0] = 1e4
    hidden[3, 0] = -1e4
    targets = rng.integers(0, vocab, rows)
    logits = lp.compute_logits(hidden, lm_head)
    np.testing.assert_array_equal(logits, hidden.astype(np.float64) @ lm_head.astype(np.float64).T)  # exact
    want = reference_logprobs(logits, targets)
    for chunk_size in (1, 4, 1024):
        got = lp.compute_logprobs(hidden, lm_head, targets, chunk_size=chunk_size, library=lib)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=2e-5)
    np.testing.assert_allclose(lp.logits_to_logprobs(logits, targets, library=lib), want, rtol=1e-6, atol=2e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs

H, V = 8, 33
_HID = np.zeros((4, H), np.float32)
_HEAD = np.zeros((V, H), np.float32)
_IDS = np.arange(4)

BAD_COMPUTE_LOGPROBS = [
    # (hidden, lm_head, target_ids, chunk_size, error, message pattern)
    (np.zeros(H, np.float32), _HEAD, 0, 8, ValueError, r"hidden must have shape \[B, T, H\] or \[N, H\].*\(8,\)"),
    (np.zeros((1, 2, 4, H), np.float32), _HEAD, _IDS, 8, ValueError, r"rank 3 or 2\), got shape \(1, 2, 4, 8\)"),
    (_HID, np.zeros(V, np.float32), _IDS, 8, ValueError, r"lm_head must have shape \[V, H\].*\(33,\)"),
    (_HID, np.zeros((V, H + 1), np.float32), _IDS, 8, ValueError, r"hidden size 9 does not match .* 8"),
    (_HID, _HEAD, np.arange(5), 8, ValueError, r"target_ids has shape \(5,\), expected \(4,\)"),
    (_HID, _HEAD, np.array([0, 1, 33, -1]), 8, ValueError, r"target_ids\[2\] = 33 is outside .*\[0, 33\)"),
    (_HID.reshape(2, 2, H), _HEAD, np.array([[0, -5], [1, 40]]), 8, ValueError, r"target_ids\[0, 1\] = -5"),
    (_HID, _HEAD, _IDS, 0, ValueError, r"chunk_size must be >= 1, got 0"),
    (_HID, _HEAD, _IDS, -3, ValueError, r"chunk_size must be >= 1, got -3"),
    (_HID, _HEAD, _IDS, 2.0, TypeError, r"chunk_size must be an int"),
    (_HID, _HEAD, _IDS, True, TypeError, r"chunk_size must be an int"),
    (_HID, _HEAD, _IDS.astype(np.float32), 8, TypeError, r"target_ids must have an integer dtype, got float32"),
    (_HID, _HEAD, np.array([True, False, True, False]), 8, TypeError, r"target_ids must have an integer dtype"),
    (_HID.astype(np.float64), _HEAD, _IDS, 8, TypeError, r"hidden must have dtype float32, got float64.*astype"),
    (_HID.astype(np.float16), _HEAD, _IDS, 8, TypeError, r"hidden must have dtype float32, got float16"),
    (_HID, _HEAD.astype(np.float64), _IDS, 8, TypeError, r"lm_head must have dtype float32, got float64"),
    (_HID.astype(np.int32), _HEAD, _IDS, 8, TypeError, r"hidden must have dtype float32, got int32"),
    (_HID.tolist(), _HEAD, _IDS, 8, TypeError, r"hidden must be a numpy.ndarray of float32, got list"),
]


@pytest.mark.parametrize(("hidden", "lm_head", "target_ids", "chunk_size", "error", "pattern"), BAD_COMPUTE_LOGPROBS)
def test_compute_logprobs_rejects_bad_inputs(lib, hidden, lm_head, target_ids, chunk_size, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        lp.compute_logprobs(hidden, lm_head, target_ids, chunk_size=chunk_size, library=lib)


def test_compute_logits_and_logits_to_logprobs_reject_bad_inputs(lib) -> None:
    with pytest.raises(ValueError, match=r"hidden must have shape \[\.\.\., H\] \(rank >= 1\)"):
        lp.compute_logits(np.ones((), np.float32), _HEAD)
    with pytest.raises(TypeError, match=r"hidden must be a numpy.ndarray of float32, got a numpy scalar"):
        lp.compute_logits(np.float32(1.0), _HEAD)
    with pytest.raises(ValueError, match=r"hidden size 8 does not match the hidden size 5"):
        lp.compute_logits(np.zeros((2, 5), np.float32), _HEAD)
    with pytest.raises(TypeError, match=r"hidden must have dtype float32, got float64"):
        lp.compute_logits(np.zeros((2, H)), _HEAD)
    logits = np.zeros((4, V), np.float32)
    with pytest.raises(TypeError, match=r"logits must have dtype float32, got float64"):
        lp.logits_to_logprobs(logits.astype(np.float64), _IDS, library=lib)
    with pytest.raises(ValueError, match=r"logits must have shape \[\.\.\., V\]"):
        lp.logits_to_logprobs(np.zeros((), np.float32), 0, library=lib)
    with pytest.raises(ValueError, match=r"target_ids has shape \(4, 1\), expected \(4,\) .*of logits"):
        lp.logits_to_logprobs(logits, _IDS[:, None], library=lib)
    with pytest.raises(ValueError, match=r"target_ids\[3\] = 33 is outside the vocabulary \[0, 33\)"):
        lp.logits_to_logprobs(logits, np.array([0, 1, 2, 33]), library=lib)
    with pytest.raises(TypeError, match=r"target_ids must have an integer dtype, got float64"):
        lp.logits_to_logprobs(logits, [0.0, 1.0, 2.0, 3.0], library=lib)


# ---------------------------------------------------------------------------------------------------------------------
# Memory


def test_chunked_peak_memory_is_far_below_full_logits(lib) -> None:
    """N=4096 rows, V=32000, H=64, chunk 256: the chunked path peaks near one chunk of logits (256*V*4 = 33 MB), far
    below the N*V*4 = 524 MB of the full logits, which the naive computation does allocate (tracemalloc sees numpy)."""
    rows, hidden_size, vocab, chunk = 4096, 64, 32000, 256
    hidden, lm_head, targets = make_case(8, (rows,), hidden_size, vocab)
    full_bytes = rows * vocab * 4
    lp.compute_logprobs(hidden[:1], lm_head, targets[:1], library=lib)  # load the kernel outside the measurement

    tracemalloc.start()
    try:
        got = lp.compute_logprobs(hidden, lm_head, targets, chunk_size=chunk, library=lib)
        _, chunked_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert chunk * vocab * 4 <= chunked_peak < full_bytes / 4, (chunked_peak, full_bytes)

    tracemalloc.start()
    try:
        full_logits = hidden @ lm_head.T  # what the chunking avoids
        _, naive_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert naive_peak >= full_bytes, (naive_peak, full_bytes)

    some = slice(0, rows, 97)
    np.testing.assert_allclose(got[some], reference_logprobs(full_logits[some], targets[some]), rtol=RTOL, atol=ATOL)
    del full_logits
