"""multinomial_from_uniform: the CPU kernel against ``reference.multinomial_from_uniform``; the GPU variant compiles
for every target kind and runs on lavapipe (when wgpu and Mesa's CPU Vulkan driver are installed).

The kernel sums in float32, the reference in float64: where ``uniform * sum`` lies within rounding of a cumulative
sum, the two may pick neighbouring tokens. ``check`` therefore demands the reference's token on every row whose
target is farther than ``EDGE`` (relative to the row's sum) from every cumulative sum, and on the others a token
of positive probability whose cumulative interval reaches within ``EDGE`` of the target.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_harness import PROB_SHAPES, make_probs, run_cpu, vulkan_kernels_or_skip
from logitproc.tir_kernels import multinomial, reference

NAME = multinomial.NAME
EDGE = 1e-5
ALMOST_ONE = np.nextafter(np.float32(1), np.float32(0))
SHAPES = PROB_SHAPES


def run_multinomial(probs: np.ndarray, uniform: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token, chosen_prob) from the CPU kernel; outputs start as garbage so that an unwritten one fails."""
    batch = probs.shape[0]
    uniform = uniform.astype(np.float32)
    probs_after, uniform_after, token, chosen = run_cpu(NAME, probs, uniform, np.full(batch, -7, np.int32),
                                                        np.full(batch, np.nan, np.float32))
    np.testing.assert_array_equal(probs_after, probs)  # inputs are not modified
    np.testing.assert_array_equal(uniform_after, uniform)
    return token, chosen


def check(probs: np.ndarray, uniform: np.ndarray, token: np.ndarray, chosen: np.ndarray) -> None:
    """The reference's token away from the knife edge; a valid neighbour within it; never a zero-probability one."""
    ref_token, ref_chosen = reference.multinomial_from_uniform(probs, uniform)
    for r in range(probs.shape[0]):
        p = probs[r].astype(np.float64)
        t = int(token[r])
        if not np.any(p > 0):
            assert t == -1 and chosen[r] == 0, (r, t, chosen[r])
            continue
        assert 0 <= t < p.size and p[t] > 0, f"row {r}: token {t} has probability {p[t] if 0 <= t < p.size else '?'}"
        assert chosen[r] == probs[r, t]
        csum = np.cumsum(p)
        total = csum[-1]
        goal = np.float64(np.float32(uniform[r])) * total
        positive = p > 0
        margin = np.min(np.abs(csum[positive] - goal)) / total
        if margin > EDGE:
            assert t == ref_token[r], (r, t, ref_token[r], margin)
            assert chosen[r] == ref_chosen[r]
        else:  # within rounding of a boundary: the chosen token's interval must reach the target
            assert csum[t] - p[t] <= goal + EDGE * total and csum[t] > goal - EDGE * total, (r, t, ref_token[r])


@pytest.mark.parametrize(("batch", "vocab"), SHAPES)
def test_matches_reference_with_mixed_rows(batch: int, vocab: int) -> None:
    """Random uniforms plus 0 and the largest float32 below 1; rows with zeros, a zero row, a one-hot row."""
    rng = np.random.default_rng(batch * 1000 + vocab)
    probs = make_probs(rng, batch, vocab)
    for r in range(1, batch, 3):
        probs[r, rng.random(vocab) < 0.4] = 0  # masked tokens
    uniform = rng.random(batch, dtype=np.float32)
    uniform[0::5] = 0
    uniform[1::5] = ALMOST_ONE
    if batch > 2:
        probs[2] = 0
    if batch > 3:
        probs[3] = 0
        probs[3, vocab // 3] = 0.25  # one-hot, not normalised
    if batch > 4:
        probs[4] *= np.float32(1e-30)  # tiny, not normalised
    if batch > 5:
        probs[5] *= np.float32(1e6)
    check(probs, uniform, *run_multinomial(probs, uniform))


@pytest.mark.parametrize("vocab", [1, 31, 33, 128256])
def test_uniform_edges_pick_the_first_and_last_positive_token(vocab: int) -> None:
    rng = np.random.default_rng(vocab + 5)
    probs = make_probs(rng, 4, vocab)
    probs[:, :1] = 0
    probs[:, -1:] = 0
    probs[2:, : vocab // 2] = 0
    uniform = np.array([0, ALMOST_ONE, 0, ALMOST_ONE], np.float32)
    token, chosen = run_multinomial(probs, uniform)
    check(probs, uniform, token, chosen)
    for r in range(4):
        positive = np.flatnonzero(probs[r] > 0)
        if positive.size == 0:
            assert token[r] == -1
        elif uniform[r] == 0:
            assert token[r] == positive[0]
        else:  # the last positive token unless the last ones are within rounding of the end
            assert token[r] in positive and probs[r, token[r] + 1:].sum(dtype=np.float64) <= EDGE * probs[r].sum()


def test_one_hot_rows_always_give_their_token() -> None:
    vocab = 128256
    hot = np.array([0, 1, 4095, 4096, 70000, vocab - 65, vocab - 64, vocab - 1], np.int32)
    probs = np.zeros((hot.size, vocab), np.float32)
    probs[np.arange(hot.size), hot] = np.float32(0.3)
    for uniform in (np.zeros(hot.size, np.float32), np.full(hot.size, ALMOST_ONE), np.linspace(0, 1, hot.size,
                                                                                             endpoint=False)):
        token, chosen = run_multinomial(probs, uniform)
        np.testing.assert_array_equal(token, hot)
        np.testing.assert_array_equal(chosen, np.float32(0.3))


def test_rows_of_zeros_give_minus_one() -> None:
    for vocab in (1, 33, 151936):
        probs = np.zeros((3, vocab), np.float32)
        token, chosen = run_multinomial(probs, np.array([0, 0.5, ALMOST_ONE], np.float32))
        np.testing.assert_array_equal(token, -1)
        np.testing.assert_array_equal(chosen, 0)


@pytest.mark.parametrize("vocab", [31, 33, 1000, 128001])
def test_zero_probability_tokens_are_never_sampled(vocab: int) -> None:
    """The hard rule, over many uniforms, including every cumulative boundary itself and its float32 neighbours."""
    rng = np.random.default_rng(vocab)
    base = make_probs(rng, 1, vocab, scale=4.0)[0]
    base[rng.random(vocab) < 0.5] = 0  # zeros everywhere, including runs of them
    base[:3] = 0
    base[-3:] = 0
    base[vocab // 2: vocab // 2 + 5] = 0
    csum = np.cumsum(base.astype(np.float64))
    boundaries = (csum[base > 0] / csum[-1]).astype(np.float32)
    if vocab > 1000:  # keep the batch small: 100 boundaries and 100 random uniforms
        boundaries = rng.choice(boundaries, 100, replace=False)
        spread = rng.random(100, dtype=np.float32)
    else:
        spread = np.concatenate([np.linspace(0, 1, 1000, endpoint=False, dtype=np.float32),
                                 rng.random(1000, dtype=np.float32)])
    uniform = np.concatenate([boundaries, np.nextafter(boundaries, np.float32(0)),
                              np.nextafter(boundaries, np.float32(1)), spread, np.array([0, ALMOST_ONE], np.float32)])
    uniform = uniform[uniform < 1]
    probs = np.broadcast_to(base, (uniform.size, vocab)).copy()
    token, chosen = run_multinomial(probs, uniform)
    assert np.all(token >= 0) and np.all(base[token] > 0), "a zero-probability token was sampled"
    np.testing.assert_array_equal(chosen, base[token])
    check(probs, uniform, token, chosen)


def test_frequencies_match_the_probabilities() -> None:
    """The statistical rule: empirical frequencies over 200000 uniforms match probs (unnormalised, with zeros)."""
    rng = np.random.default_rng(2024)
    weights = np.array([0.5, 0, 3, 1, 0, 0.25, 2, 7, 0, 1.25], np.float32)  # sums to 15
    n = 200_000
    probs = np.broadcast_to(weights, (n, weights.size)).copy()
    token, chosen = run_multinomial(probs, rng.random(n, dtype=np.float32))
    counts = np.bincount(token, minlength=weights.size)
    expected = weights / weights.sum()
    assert np.all(counts[weights == 0] == 0)
    sigma = np.sqrt(n * expected * (1 - expected))
    assert np.all(np.abs(counts - n * expected) <= 5 * sigma + 1e-9), (counts, n * expected)
    chi2 = np.sum((counts - n * expected)[weights > 0] ** 2 / (n * expected[weights > 0]))
    assert chi2 < 30.0  # 6 degrees of freedom: P(chi2 > 30) < 1e-4


def test_ties_split_evenly_by_position() -> None:
    """Equal probabilities: the token is the position of the target, floor(uniform * vocab) away from boundaries."""
    vocab = 1000
    uniform = (np.arange(99, dtype=np.float32) * 10 + 5.5) / vocab
    probs = np.full((99, vocab), 1e-3, np.float32)
    token, _ = run_multinomial(probs, uniform)
    np.testing.assert_array_equal(token, np.floor(uniform.astype(np.float64) * vocab).astype(np.int32))



def test_gpu_variant_runs_on_lavapipe() -> None:
    """The WGSL variant on Mesa's CPU Vulkan driver (skipped without wgpu / lavapipe)."""
    kernels = vulkan_kernels_or_skip()
    rng = np.random.default_rng(19)
    for batch, vocab in [(7, 1), (99, 33), (8, 128256), (3, 151936)]:
        probs = make_probs(rng, batch, vocab)
        probs[1, rng.random(vocab) < 0.5] = 0
        probs[2] = 0
        uniform = rng.random(batch, dtype=np.float32)
        uniform[0] = 0
        uniform[-1] = ALMOST_ONE
        token = np.full(batch, -7, np.int32)
        chosen = np.full(batch, np.nan, np.float32)
        kernels[NAME](probs, uniform, token, chosen)
        check(probs, uniform, token, chosen)
    # the hard rule on the GPU variant: zero-probability tokens, uniforms on every boundary
    base = make_probs(rng, 1, 33, scale=4.0)[0]
    base[::2] = 0
    csum = np.cumsum(base.astype(np.float64))
    edges = (csum[base > 0] / csum[-1]).astype(np.float32)
    uniform = np.concatenate([edges, np.nextafter(edges, np.float32(0)), np.linspace(0, 1, 200, endpoint=False,
                                                                                     dtype=np.float32)])
    uniform = uniform[uniform < 1]
    probs = np.broadcast_to(base, (uniform.size, 33)).copy()
    token = np.full(uniform.size, -7, np.int32)
    chosen = np.full(uniform.size, np.nan, np.float32)
    kernels[NAME](probs, uniform, token, chosen)
    assert np.all(base[token] > 0)
    check(probs, uniform, token, chosen)
