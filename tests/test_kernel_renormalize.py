"""renormalize_probs: the CPU kernel against ``reference.renormalize``; the GPU variant compiles for every target kind
and runs on lavapipe (when wgpu and Mesa's CPU Vulkan driver are installed).

min-p and top-k decisions are exact (the same float32 product, integer counts). top-p compares sums: float32 in the
kernel, float64 in the reference, so a value whose cumulative mass lies within rounding of ``(1 - top_p) * mass``
could go either way. The tests therefore never use an arbitrary top_p: ``safe_top_p`` moves the wanted value to the
middle of a gap between two consecutive cumulative fractions of the row (after min-p and top-k) that is at least
``2 * TOP_P_MARGIN`` wide, so every decision has a margin of ``TOP_P_MARGIN * mass``, far above float32 rounding.
The kept sets must then match exactly; the kept values to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_harness import PROB_SHAPES, make_probs, run_cpu, vulkan_kernels_or_skip
from logitproc.tir_kernels import reference, renormalize

NAME = renormalize.NAME
TOP_P_MARGIN = 2e-5
RTOL = 2e-6
SHAPES = PROB_SHAPES


def safe_top_p(p: np.ndarray, top_k: int, min_p: float, want: float) -> np.float32:
    """A float32 top_p near ``want`` whose top-p decisions on row p (after min-p and top-k) all have a margin."""
    keep = reference.renormalize(p[None], np.array([top_k], np.int32), np.ones(1, np.float32),
                                 np.array([min_p], np.float32))[0] > 0
    order = np.sort(p[keep].astype(np.float64))
    values = np.unique(order)
    # fraction of the kept mass at or below each distinct value; value j is dropped iff fraction[j] <= 1 - top_p
    fraction = np.cumsum(order)[np.searchsorted(order, values, side="right") - 1] / order.sum()
    edges = np.concatenate([[0.0], fraction])
    mids = (edges[:-1] + edges[1:]) / 2
    wide = np.flatnonzero(np.diff(edges) > 2 * TOP_P_MARGIN + 1e-6)  # slack for rounding top_p to float32
    assert wide.size, "no gap wide enough (the last gap always is)"
    i = wide[np.argmin(np.abs(mids[wide] - (1.0 - want)))]
    top_p = np.float32(1.0 - mids[i])
    drop_fraction = 1.0 - np.float64(top_p)
    assert edges[i] + TOP_P_MARGIN < drop_fraction < edges[i + 1] - TOP_P_MARGIN
    return top_p


def filters_for(rng: np.random.Generator, p: np.ndarray, combo: int) -> tuple[int, np.float32, np.float32]:
    """(top_k, top_p, min_p) for a row; bit 0 of combo turns min-p on, bit 1 top-k, bit 2 top-p."""
    vocab = p.size
    min_p = np.float32(rng.choice([0.001, 0.02, 0.2])) if combo & 1 else np.float32(0)
    top_k = int(rng.choice([1, 2, 5, 50, 1000, vocab - 1])) if combo & 2 else int(rng.choice([0, -1, vocab]))
    if combo & 4 and p.max() > 0:
        top_p = safe_top_p(p, top_k, float(min_p), float(rng.choice([0.05, 0.5, 0.9, 0.99])))
    else:
        top_p = np.float32(1.0)
    return top_k, top_p, min_p


def run_renormalize(probs: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """out from the CPU kernel; the output starts as NaN so that an element left unwritten fails the checks."""
    args = (probs, top_k.astype(np.int32), top_p.astype(np.float32), min_p.astype(np.float32))
    *after, out = run_cpu(NAME, *args, np.full_like(probs, np.nan))
    for a, b in zip(after, args, strict=True):
        np.testing.assert_array_equal(a, b)  # inputs are not modified
    return out


def check(probs: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray, out: np.ndarray) -> None:
    """Same kept set as the reference, values to float32 rounding, rows summing to 1 (zero rows staying zero)."""
    expected = reference.renormalize(probs, top_k, top_p, min_p)
    assert not np.isnan(out).any()
    bad = np.flatnonzero(np.any((out > 0) != (expected > 0), axis=1))
    assert bad.size == 0, (f"kept sets differ in rows {bad[:10]}: kernel keeps {(out[bad] > 0).sum(1)[:10]}, "
                           f"reference {(expected[bad] > 0).sum(1)[:10]}")
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=0)
    assert np.all(out[probs <= 0] == 0)
    live = expected.sum(axis=1) > 0
    np.testing.assert_allclose(out[live].sum(axis=1, dtype=np.float64), 1.0, rtol=0, atol=2e-6)
    assert np.all(out[~live] == 0)


@pytest.mark.parametrize(("batch", "vocab"), SHAPES)
def test_matches_reference_with_mixed_rows(batch: int, vocab: int) -> None:
    """Rows cycle through the eight filter combinations; some rows have zeros, one is all zeros, one is one-hot."""
    rng = np.random.default_rng(batch * 1000 + vocab)
    probs = make_probs(rng, batch, vocab)
    for r in range(1, batch, 3):
        probs[r, rng.random(vocab) < 0.4] = 0  # masked tokens
    if batch > 2:
        probs[2] = 0
    if batch > 3:
        probs[3] = 0
        probs[3, vocab // 2] = 1
    rows = [filters_for(rng, probs[r], (r + vocab) % 8) for r in range(batch)]
    top_k, top_p, min_p = (np.array(col) for col in zip(*rows, strict=True))
    check(probs, top_k, top_p, min_p, run_renormalize(probs, top_k, top_p, min_p))


@pytest.mark.parametrize("combo", range(8))
@pytest.mark.parametrize(("batch", "vocab"), [(99, 33), (7, 128256)])
def test_each_filter_combination(batch: int, vocab: int, combo: int) -> None:
    rng = np.random.default_rng(combo * 7 + vocab)
    probs = make_probs(rng, batch, vocab, scale=rng.choice([1.0, 4.0]))
    rows = [filters_for(rng, probs[r], combo) for r in range(batch)]
    top_k, top_p, min_p = (np.array(col) for col in zip(*rows, strict=True))
    check(probs, top_k, top_p, min_p, run_renormalize(probs, top_k, top_p, min_p))


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_top_p_in_the_dense_bulk(scale: float) -> None:
    """Plain top_p = 0.9 / 0.95 on 128256 values, where the threshold falls among many small, close values.

    No margin is arranged here: the kernel's threshold may differ from the reference's only by values whose
    cumulative fraction lies within float32 rounding (1e-5 of the mass) of ``1 - top_p``.
    """
    rng = np.random.default_rng(int(scale * 10))
    vocab = 128256
    probs = make_probs(rng, 4, vocab, scale=scale)
    top_p = np.array([0.9, 0.95, 0.9, 0.95], np.float32)
    top_k = np.array([0, 0, 20000, 0], np.int32)
    min_p = np.array([0, 0, 0, 1e-4], np.float32)
    out = run_renormalize(probs, top_k, top_p, min_p)
    expected = reference.renormalize(probs, top_k, top_p, min_p)
    before = reference.renormalize(probs, top_k, np.ones(4, np.float32), min_p)  # the set top-p starts from
    for r in range(4):
        t_kernel, t_ref = probs[r][out[r] > 0].min(), probs[r][expected[r] > 0].min()
        assert np.all((out[r] > 0) == (probs[r] >= t_kernel))
        kept = np.sort(probs[r][before[r] > 0].astype(np.float64))
        disputed = np.unique(kept[(kept >= min(t_kernel, t_ref)) & (kept < max(t_kernel, t_ref))])
        fraction = np.cumsum(kept)[np.searchsorted(kept, disputed, side="right") - 1] / kept.sum()
        assert np.all(np.abs(fraction - (1 - np.float64(top_p[r]))) < 1e-5), (r, t_kernel, t_ref, fraction)
        same = out[r] > 0
        np.testing.assert_allclose(out[r][same], (probs[r][same] / probs[r][same].sum(dtype=np.float64)), rtol=RTOL)
        assert 1000 < same.sum() < vocab


def awkward_rows(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """Rows that make interpolating the top-p mass a poor guess: clusters, whole exponent range, ramps, power laws."""
    rows = np.empty((8, vocab), np.float64)
    rows[0] = 1e-12 * (1 + rng.random(vocab))
    rows[0, rng.choice(vocab, 100, replace=False)] = 1e-2 * (1 + 1e-3 * rng.random(100))  # two far clusters
    rows[1] = np.exp2(rng.uniform(-140, 0, vocab))  # spread over the whole exponent range
    rows[2] = 1e-9 * rng.random(vocab)
    rows[2, vocab // 3] = 0.999  # one value holds nearly all the mass
    rows[3] = rng.permutation(vocab) + 1.0  # mass spread evenly over values (a ramp)
    rows[4] = rng.permutation(np.arange(1, vocab + 1, dtype=np.float64) ** -3.0)  # steep power law
    rows[5] = np.exp2(rng.uniform(-126, -120, vocab))
    rows[5, ::7] = np.float32(1e-45) * rng.integers(1, 1000, rows[5, ::7].size)  # subnormals among normals
    rows[6] = np.exp(rng.standard_normal(vocab) * 8)  # very peaked
    rows[7] = np.exp(rng.standard_normal(vocab) * 0.3)  # nearly flat
    return (rows / rows.sum(axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("want", [0.05, 0.5, 0.9, 0.99])
def test_top_p_search_on_awkward_rows(want: float) -> None:
    """top-p (alone and after top-k / min-p) on rows where its interpolated probes land far from the threshold."""
    rng = np.random.default_rng(int(want * 100))
    vocab = 32768
    probs = awkward_rows(rng, vocab)
    top_k = np.array([0, 0, 0, 5000, 0, 0, 300, 0], np.int32)
    min_p = np.array([0, 0, 0, 0, 1e-6, 0, 0, 0.5], np.float32)
    top_p = np.array([safe_top_p(probs[r], int(top_k[r]), float(min_p[r]), want) for r in range(8)], np.float32)
    check(probs, top_k, top_p, min_p, run_renormalize(probs, top_k, top_p, min_p))
    zeros = np.zeros(8, np.float32)
    tiny = np.full(8, 1e-30, np.float32)
    for p in (zeros, tiny):  # only the maximum (with its ties) reaches a goal of (almost) nothing
        out = run_renormalize(probs, top_k, p, min_p)
        check(probs, top_k, p, min_p, out)
        assert np.all((out > 0) == (probs == probs.max(axis=1, keepdims=True)))


def test_all_filters_off_only_rescales() -> None:
    rng = np.random.default_rng(3)
    probs = make_probs(rng, 7, 128256) * np.float32(3.5)  # not normalised
    probs[1, ::2] = 0
    off = (np.array([0, -5, 128256, 10**6, 0, 0, 0], np.int32), np.ones(7, np.float32), np.zeros(7, np.float32))
    out = run_renormalize(probs, *off)
    check(probs, *off, out)
    np.testing.assert_allclose(out, probs / probs.sum(axis=1, keepdims=True, dtype=np.float64), rtol=RTOL)


def ties_case(vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Values from a few levels, with every threshold falling on a group of equal values: (probs, k, top_p, min_p)."""
    rng = np.random.default_rng(vocab)
    levels = np.array([0, 1, 2, 3, 4, 6, 8, 8], np.float32) / 16  # powers of two: exact min-p thresholds
    probs = levels[rng.integers(0, levels.size, (8, vocab))].astype(np.float32)
    n_top = [(probs[r] == probs[r].max()).sum() for r in range(8)]
    top_k = np.array([1, 2, n_top[2], n_top[3] + 1, 0, 0, 3, 0], np.int32)  # cuts inside groups of ties
    min_p = np.array([0, 0, 0, 0, 0.5, 0.25, 0, 0], np.float32)  # thresholds 4/16 and 2/16, equal to levels
    top_p = np.ones(8, np.float32)
    top_p[6] = safe_top_p(probs[6], int(top_k[6]), 0.0, 0.5)
    top_p[7] = safe_top_p(probs[7], 0, 0.0, 0.9)
    return probs, top_k, top_p, min_p


@pytest.mark.parametrize("vocab", [33, 128256])
def test_ties_are_kept_or_dropped_together(vocab: int) -> None:
    probs, top_k, top_p, min_p = ties_case(vocab)
    out = run_renormalize(probs, top_k, top_p, min_p)
    check(probs, top_k, top_p, min_p, out)
    for r in range(8):
        kept = out[r] > 0
        assert np.all(kept == (probs[r] >= probs[r][kept].min()))  # the kept set is {p >= threshold}
    assert (out[0] > 0).sum() == (probs[0] == probs[0].max()).sum()  # top-1 keeps every copy of the maximum
    assert np.all((out[4] > 0) == (probs[4] >= 4 / 16)) and np.all((out[5] > 0) == (probs[5] >= 2 / 16))


@pytest.mark.parametrize("vocab", [1, 31, 128001])
def test_zero_rows_stay_zero_and_one_hot_rows_stay_one_hot(vocab: int) -> None:
    combos = [(k, p, m) for k in (0, 1, 5) for p in (1.0, 0.5, 0.0) for m in (0.0, 0.3, 1.0)]
    n = len(combos)
    top_k = np.array([c[0] for c in combos] * 2, np.int32)
    top_p = np.array([c[1] for c in combos] * 2, np.float32)
    min_p = np.array([c[2] for c in combos] * 2, np.float32)
    probs = np.zeros((2 * n, vocab), np.float32)
    probs[n:, vocab - 1] = 0.37  # one-hot (not normalised) on the last token
    out = run_renormalize(probs, top_k, top_p, min_p)
    check(probs, top_k, top_p, min_p, out)
    assert np.all(out[:n] == 0)
    np.testing.assert_allclose(out[n:, vocab - 1], 1.0, rtol=1.5e-7)
    assert np.all(out[n:, : vocab - 1] == 0)


def test_top_k_edges() -> None:
    rng = np.random.default_rng(11)
    vocab = 128256
    probs = make_probs(rng, 8, vocab)
    probs[5, 100:] = 0  # 100 positive values
    probs[6, 1000:] = 0
    top_k = np.array([1, vocab - 1, vocab, -3, 0, 150, 1000, 2], np.int32)
    ones, zeros = np.ones(8, np.float32), np.zeros(8, np.float32)
    out = run_renormalize(probs, top_k, ones, zeros)
    check(probs, top_k, ones, zeros, out)
    assert (out[0] > 0).sum() == 1 and out[0, probs[0].argmax()] > 0.999999
    assert (out[1] > 0).sum() == vocab - 1 and out[1, probs[1].argmin()] == 0
    assert (out[5] > 0).sum() == 100 and (out[6] > 0).sum() == 1000 and (out[7] > 0).sum() == 2


def test_top_p_and_min_p_edges() -> None:
    rng = np.random.default_rng(12)
    vocab = 151936
    probs = make_probs(rng, 7, vocab)
    probs[3, probs[3].argmax() + 1] = probs[3].max()  # a tie at the maximum
    top_p = np.array([0.0, 1.0, 1.5, 0.0, 1.0, 1.0, 1.0], np.float32)
    min_p = np.array([0.0, 0.0, 0.0, 0.0, 1.0, 1e-30, 1.5], np.float32)
    top_k = np.zeros(7, np.int32)
    out = run_renormalize(probs, top_k, top_p, min_p)
    check(probs, top_k, top_p, min_p, out)
    assert (out[0] > 0).sum() == 1  # top_p = 0 keeps the maximum only (with its ties)
    assert (out[3] > 0).sum() == 2
    assert (out[1] > 0).sum() == vocab and (out[2] > 0).sum() == vocab and (out[5] > 0).sum() == vocab
    assert (out[4] > 0).sum() == 1  # min_p = 1: the maximum
    assert np.all(out[6] == 0)  # min_p > 1 keeps nothing


def test_tiny_and_denormal_values() -> None:
    """Thresholds among subnormal values and values spread over the whole float32 exponent range."""
    rng = np.random.default_rng(13)
    vocab = 4096
    exponents = rng.uniform(-149, 0, (6, vocab))
    probs = np.exp2(exponents).astype(np.float32)
    probs[0, :] = np.float32(1e-45) * rng.integers(1, 50, vocab).astype(np.float32)  # subnormals only
    top_k = np.array([7, 300, 0, 0, 20, 4000], np.int32)
    min_p = np.array([0, 0, 1e-20, 0, 0, 1e-30], np.float32)
    top_p = np.ones(6, np.float32)
    top_p[3] = safe_top_p(probs[3], 0, 0.0, 0.9)
    top_p[4] = safe_top_p(probs[4], 20, 0.0, 0.5)
    check(probs, top_k, top_p, min_p, run_renormalize(probs, top_k, top_p, min_p))



def test_gpu_variant_runs_on_lavapipe() -> None:
    """The WGSL variant on Mesa's CPU Vulkan driver (skipped without wgpu / lavapipe)."""
    kernels = vulkan_kernels_or_skip()
    rng = np.random.default_rng(17)
    for batch, vocab in [(7, 1), (99, 33), (8, 128256)]:
        probs = make_probs(rng, batch, vocab)
        probs[1, rng.random(vocab) < 0.5] = 0
        probs[2] = 0
        rows = [filters_for(rng, probs[r], r % 8) for r in range(batch)]
        top_k, top_p, min_p = (np.array(col) for col in zip(*rows, strict=True))
        out = np.full_like(probs, np.nan)
        kernels[NAME](probs, top_k.astype(np.int32), top_p.astype(np.float32), min_p.astype(np.float32), out)
        check(probs, top_k, top_p, min_p, out)
    probs, top_k, top_p, min_p = ties_case(4099)
    probs[1] = 0
    probs[2] = 0
    probs[2, 4098] = 0.3  # one-hot on the last token
    out = np.full_like(probs, np.nan)
    kernels[NAME](probs, top_k, top_p, min_p, out)
    check(probs, top_k, top_p, min_p, out)


def test_gpu_candidate_list_and_row_searches_on_lavapipe() -> None:
    """The GPU search's two paths on lavapipe: rows whose values above the bound pass's lower bound fit the list in
    shared memory (peaked rows with top-k, top-p, min-p with top-p, top-k with top-p, ties straddling a pivot) and
    rows that overflow it (a flat row with top_p near 1, a top-k of thousands), against the reference."""
    kernels = vulkan_kernels_or_skip()
    rng = np.random.default_rng(23)
    vocab = 20000
    probs = np.stack([make_probs(rng, 1, vocab, scale)[0] for scale in (6.0, 6.0, 4.0, 0.05, 2.5, 6.0)]
                     + [np.full(vocab, 1e-7, np.float32)] * 2)
    for r in (6, 7):  # the maximum, and ten values of exactly half of it (just below the first pivot)
        probs[r, 3] = 0.5
        probs[r, 100:110] = 0.25
    top_k = np.array([20, 0, 0, 0, 3000, 50, 5, 0], np.int32)
    min_p = np.array([0, 0, 0.01, 0, 0, 0, 0, 0], np.float32)
    top_p = np.ones(8, np.float32)
    for r, want in ((1, 0.9), (2, 0.5), (3, 0.99), (5, 0.9), (7, 0.6)):
        top_p[r] = safe_top_p(probs[r], int(top_k[r]), float(min_p[r]), want)
    out = np.full_like(probs, np.nan)
    kernels[NAME](probs, top_k, top_p, min_p, out)
    check(probs, top_k, top_p, min_p, out)
    assert (out[6] > 0).sum() == 11  # the five largest, with every value tied at the fifth
