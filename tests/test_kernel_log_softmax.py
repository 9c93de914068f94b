"""log_softmax_gather: the CPU kernel against the numpy reference and against softmax_with_temperature; the GPU variant
compiles for every target kind (and runs on lavapipe when wgpu and Mesa's CPU Vulkan driver are installed)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_harness import run_cpu, vulkan_kernels_or_skip
from logitproc.tir_kernels import log_softmax, reference, softmax

NAME = log_softmax.NAME
LARGE_VOCABS = (128001, 128256, 151936)
RTOL, ATOL = 1e-6, 2e-6


def run_log_softmax(logits: np.ndarray, target_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logprob, logsumexp) from the CPU kernel; outputs start as NaN so that a missing write fails the checks."""
    nan = np.full(logits.shape[0], np.nan, np.float32)
    logits_after, targets_after, logprob, lse = run_cpu(NAME, logits, target_ids, nan, nan.copy())
    np.testing.assert_array_equal(logits_after, logits)  # inputs are not modified
    np.testing.assert_array_equal(targets_after, target_ids)
    return logprob, lse


def expected(logits: np.ndarray, target_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(divide="ignore", invalid="ignore"):  # rows of -inf: log(0), -inf - -inf (masked by the reference)
        return reference.log_softmax_gather(logits, target_ids)


def check(logits: np.ndarray, target_ids: np.ndarray, logprob: np.ndarray, lse: np.ndarray) -> None:
    want_logprob, want_lse = expected(logits, target_ids)
    assert not np.isnan(logprob).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(logprob, want_logprob, rtol=RTOL, atol=ATOL)
    picked = logits[np.arange(logits.shape[0]), target_ids]
    assert np.all(logprob[np.isneginf(picked)] == -np.inf), "a masked target must have logprob -inf"
    empty = np.all(np.isneginf(logits), axis=1)
    assert np.all(lse[empty] == -np.inf)


def make_case(rng: np.random.Generator, batch: int, vocab: int, scale: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    logits = (rng.standard_normal((batch, vocab)) * scale).astype(np.float32)
    return logits, rng.integers(0, vocab, batch).astype(np.int32)


@pytest.mark.parametrize(
    ("batch", "vocab"),
    [(1, 1), (7, 1), (99, 1), (1, 31), (99, 31), (7, 33), (99, 33), (99, 1000), (1, 128001), (7, 128256),
     (1, 151936)],
)
def test_matches_reference_with_mixed_rows(batch: int, vocab: int) -> None:
    """Some rows partially masked, one row entirely -inf, some targets on masked tokens, some on the row max."""
    rng = np.random.default_rng(batch * 1000 + vocab)
    logits, target_ids = make_case(rng, batch, vocab)
    for r in range(1, batch, 3):
        logits[r, rng.random(vocab) < 0.4] = -np.inf
    if batch > 2:
        logits[2] = -np.inf
    if batch > 4:
        target_ids[3] = np.argmax(logits[3])
        logits[4, target_ids[4]] = -np.inf
    check(logits, target_ids, *run_log_softmax(logits, target_ids))


@pytest.mark.parametrize("vocab", LARGE_VOCABS)
@pytest.mark.parametrize("scale", [0.01, 3.0, 100.0])
def test_large_vocab(vocab: int, scale: float) -> None:
    logits, target_ids = make_case(np.random.default_rng(vocab), 2, vocab, scale)
    check(logits, target_ids, *run_log_softmax(logits, target_ids))


@pytest.mark.parametrize("vocab", [1, 31, 33, 128256])
def test_rows_of_minus_inf_give_minus_inf(vocab: int) -> None:
    logits, target_ids = make_case(np.random.default_rng(3), 4, vocab)
    logits[[0, 2]] = -np.inf
    logprob, lse = run_log_softmax(logits, target_ids)
    assert np.all(logprob[[0, 2]] == -np.inf) and np.all(lse[[0, 2]] == -np.inf)
    check(logits, target_ids, logprob, lse)


@pytest.mark.parametrize("vocab", [2, 33, 128256])
def test_ties_and_single_finite_token(vocab: int) -> None:
    """k tied maxima far above the rest: logprob of each is -log(k); a lone finite token has logprob 0."""
    rng = np.random.default_rng(vocab)
    logits, _ = make_case(rng, 3, vocab)
    tied = sorted({0, vocab // 2, vocab - 1})
    logits[0, tied] = 100.0
    logits[1] = -np.inf
    logits[1, vocab - 1] = 4.5
    logits[2, : vocab // 2] = -np.inf
    target_ids = np.array([tied[-1], vocab - 1, vocab - 1], np.int32)
    logprob, lse = run_log_softmax(logits, target_ids)
    check(logits, target_ids, logprob, lse)
    np.testing.assert_allclose(logprob[0], -np.log(len(tied)), rtol=1e-6)
    assert logprob[1] == 0.0 and lse[1] == 4.5


def test_extreme_logits_are_stable() -> None:
    logits, target_ids = make_case(np.random.default_rng(6), 4, 1000)
    logits[0] += 1e4
    logits[1] -= 1e4
    logits[2, :3] = [3e38, -3e38, 3.4e38]
    target_ids[2] = 0
    logits[3] *= 1e30
    check(logits, target_ids, *run_log_softmax(logits, target_ids))


def test_target_outside_the_vocabulary_has_probability_zero() -> None:
    """Not in the reference (which would raise): ids < 0 or >= vocab give logprob -inf, never a stray read."""
    logits, _ = make_case(np.random.default_rng(8), 3, 50)
    logprob, lse = run_log_softmax(logits, np.array([-1, 50, 1 << 30], np.int32))
    assert np.all(logprob == -np.inf)
    _, want_lse = expected(logits, np.zeros(3, np.int32))
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("vocab", [33, 128256])
def test_agrees_with_the_softmax_kernel(vocab: int) -> None:
    """logprob == log(softmax(logits)[target]) at temperature 1, for targets of non-negligible probability."""
    logits, _ = make_case(np.random.default_rng(9), 6, vocab, scale=2.0)
    logits[1, ::2] = -np.inf
    target_ids = np.argsort(logits, axis=1)[:, -3].astype(np.int32)  # the third most likely token
    logprob, _ = run_log_softmax(logits, target_ids)
    (*_, probs) = run_cpu(softmax.NAME, logits, np.ones(6, np.float32), np.zeros_like(logits))
    np.testing.assert_allclose(logprob, np.log(probs[np.arange(6), target_ids]), rtol=1e-5, atol=1e-5)



def test_gpu_variant_runs_on_lavapipe() -> None:
    """The WGSL variant on Mesa's CPU Vulkan driver, edge cases included (skipped without wgpu / a Vulkan adapter)."""
    kernels = vulkan_kernels_or_skip()
    rng = np.random.default_rng(7)
    for batch, vocab in [(7, 1), (99, 33), (6, 128256)]:
        logits, target_ids = make_case(rng, batch, vocab)
        logits[1::4, rng.random(vocab) < 0.5] = -np.inf
        logits[2] = -np.inf
        logits[3, target_ids[3]] = -np.inf
        logprob = np.full(batch, np.nan, np.float32)
        lse = np.full(batch, np.nan, np.float32)
        kernels[NAME](logits, target_ids, logprob, lse)
        check(logits, target_ids, logprob, lse)
