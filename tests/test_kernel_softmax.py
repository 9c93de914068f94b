"""softmax_with_temperature: the CPU kernel against the numpy reference; the GPU variant compiles for every target kind
(and runs on lavapipe when wgpu and Mesa's CPU Vulkan driver are installed)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_harness import run_cpu, vulkan_kernels_or_skip
from logitproc.tir_kernels import reference, softmax

NAME = softmax.NAME
TEMPERATURES = (0.0, 1e-4, 0.7, 1.0, 2.0)
LARGE_VOCABS = (128001, 128256, 151936)
RTOL, ATOL = 1e-5, 1e-7


def run_softmax(logits: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """probs from the CPU kernel; the output starts as NaN so that an element left unwritten fails the checks."""
    logits_after, temperature_after, probs = run_cpu(NAME, logits, temperature, np.full_like(logits, np.nan))
    np.testing.assert_array_equal(logits_after, logits)  # inputs are not modified
    np.testing.assert_array_equal(temperature_after, temperature)
    return probs


def check_probs(logits: np.ndarray, temperature: np.ndarray, probs: np.ndarray) -> None:
    """probs matches the reference; masked tokens, rows of -inf and greedy rows are exact."""
    expected = reference.softmax_with_temperature(logits, temperature)
    assert not np.isnan(probs).any()
    np.testing.assert_allclose(probs, expected, rtol=RTOL, atol=ATOL)
    assert np.all(probs[np.isneginf(logits)] == 0.0), "a masked token got a nonzero probability"
    empty = np.all(np.isneginf(logits), axis=1)
    assert np.all(probs[empty] == 0.0)
    greedy = (temperature == 0) & ~empty
    np.testing.assert_array_equal(probs[greedy], expected[greedy])  # exact one-hot
    np.testing.assert_allclose(probs[~empty].sum(axis=1, dtype=np.float64), 1.0, rtol=0, atol=2e-6)


def make_logits(rng: np.random.Generator, batch: int, vocab: int, scale: float = 3.0) -> np.ndarray:
    return (rng.standard_normal((batch, vocab)) * scale).astype(np.float32)


@pytest.mark.parametrize(
    ("batch", "vocab"),
    [(1, 1), (7, 1), (99, 1), (1, 31), (99, 31), (7, 33), (99, 33), (99, 1000), (7, 128256), (1, 151936)],
)
def test_matches_reference_with_mixed_rows(batch: int, vocab: int) -> None:
    """Rows cycle through the temperatures; some rows are partially masked and one is entirely -inf."""
    rng = np.random.default_rng(batch * 1000 + vocab)
    logits = make_logits(rng, batch, vocab)
    temperature = np.resize(np.array(TEMPERATURES, np.float32), batch)
    for r in range(1, batch, 3):
        logits[r, rng.random(vocab) < 0.4] = -np.inf  # partially masked (maybe fully, for tiny vocabularies)
    if batch > 2:
        logits[2] = -np.inf
    check_probs(logits, temperature, run_softmax(logits, temperature))


@pytest.mark.parametrize("vocab", LARGE_VOCABS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_large_vocab_each_temperature(vocab: int, temperature: float) -> None:
    rng = np.random.default_rng(vocab)
    logits = make_logits(rng, 1, vocab)
    temperatures = np.array([temperature], np.float32)
    check_probs(logits, temperatures, run_softmax(logits, temperatures))


@pytest.mark.parametrize("vocab", [2, 31, 33, 64, 65, 1025, *LARGE_VOCABS])
def test_ties_at_the_max(vocab: int) -> None:
    """Ties in the vector part and in the scalar tail: greedy takes the lowest id, sampling splits evenly."""
    rng = np.random.default_rng(vocab + 1)
    batch = len(TEMPERATURES)
    logits = make_logits(rng, batch, vocab)
    tied = sorted({vocab - 1, vocab // 2, min(5, vocab - 1)})
    logits[:, tied] = logits.max() + 1.0
    temperature = np.array(TEMPERATURES, np.float32)
    probs = run_softmax(logits, temperature)
    check_probs(logits, temperature, probs)
    assert probs[0, tied[0]] == 1.0 and probs[0].sum() == 1.0  # T = 0: one-hot on the first tied token
    for r in range(1, batch):
        np.testing.assert_allclose(probs[r, tied], probs[r, tied[0]], rtol=1e-6)


@pytest.mark.parametrize("vocab", [1, 33, 128256])
def test_all_equal_row(vocab: int) -> None:
    logits = np.full((len(TEMPERATURES), vocab), 0.25, np.float32)
    temperature = np.array(TEMPERATURES, np.float32)
    probs = run_softmax(logits, temperature)
    check_probs(logits, temperature, probs)
    assert probs[0, 0] == 1.0 and np.all(probs[0, 1:] == 0.0)
    np.testing.assert_allclose(probs[1:], 1.0 / vocab, rtol=1e-5)


@pytest.mark.parametrize("vocab", [1, 31, 33, 128001])
def test_rows_of_minus_inf_give_zeros_at_every_temperature(vocab: int) -> None:
    batch = 2 * len(TEMPERATURES)
    logits = make_logits(np.random.default_rng(3), batch, vocab)
    logits[::2] = -np.inf
    temperature = np.repeat(np.array(TEMPERATURES, np.float32), 2)
    probs = run_softmax(logits, temperature)
    assert np.all(probs[::2] == 0.0)
    check_probs(logits, temperature, probs)


@pytest.mark.parametrize("vocab", [31, 33, 128256])
def test_partially_masked_rows(vocab: int) -> None:
    """A single finite token (first, last, middle), a masked first half, and a sparse row, at every temperature."""
    rng = np.random.default_rng(vocab + 2)
    rows = []
    for keep in (0, vocab - 1, vocab // 2):
        row = np.full(vocab, -np.inf, np.float32)
        row[keep] = rng.standard_normal()
        rows.append(row)
    half = make_logits(rng, 1, vocab)[0]
    half[: vocab // 2] = -np.inf
    sparse = make_logits(rng, 1, vocab)[0]
    sparse[rng.random(vocab) < 0.9] = -np.inf
    base = np.stack([*rows, half, sparse])
    logits = np.repeat(base, len(TEMPERATURES), axis=0)
    temperature = np.tile(np.array(TEMPERATURES, np.float32), len(base))
    probs = run_softmax(logits, temperature)
    check_probs(logits, temperature, probs)
    for i, keep in enumerate((0, vocab - 1, vocab // 2)):
        block = probs[i * len(TEMPERATURES) : (i + 1) * len(TEMPERATURES)]
        assert np.all(block[:, keep] == 1.0) and np.all(np.delete(block, keep, axis=1) == 0.0)


def test_tiny_temperatures() -> None:
    """1e-4 on close logits gives a non-trivial distribution; subnormal temperatures split evenly over ties."""
    rng = np.random.default_rng(5)
    vocab = 4099
    close = (rng.standard_normal((2, vocab)) * 1e-3).astype(np.float32)
    tied = close.copy()
    tied[:, [7, 4098]] = close.max() + 1e-3
    logits = np.concatenate([close, tied])
    temperature = np.array([1e-4, 3e-4, 1e-39, 1e-45], np.float32)
    probs = run_softmax(logits, temperature)
    check_probs(logits, temperature, probs)
    assert 0.0 < probs[0].max() < 1.0
    np.testing.assert_array_equal(probs[2:, [7, 4098]], 0.5)


def test_extreme_logits_are_stable() -> None:
    """Huge offsets and magnitudes (near float32 max) neither overflow nor produce NaN."""
    rng = np.random.default_rng(6)
    vocab = 1000
    logits = make_logits(rng, 4, vocab)
    logits[0] += 1e4
    logits[1] -= 1e4
    logits[2, :3] = [3e38, -3e38, 3.4e38]
    logits[3] *= 1e30
    temperature = np.array([0.7, 1.0, 2.0, 1.0], np.float32)
    probs = run_softmax(logits, temperature)
    check_probs(logits, temperature, probs)
    assert probs[2, 2] == 1.0



def test_gpu_variant_runs_on_lavapipe() -> None:
    """The WGSL variant on Mesa's CPU Vulkan driver, every edge case at once (skipped without wgpu / lavapipe)."""
    kernels = vulkan_kernels_or_skip()
    rng = np.random.default_rng(7)
    for batch, vocab in [(7, 1), (99, 33), (10, 128256)]:
        logits = make_logits(rng, batch, vocab)
        temperature = np.resize(np.array(TEMPERATURES, np.float32), batch)
        logits[1::4, rng.random(vocab) < 0.5] = -np.inf
        logits[2] = -np.inf
        logits[3:5, [vocab // 2, vocab - 1]] = logits.max() + 1
        probs = np.full_like(logits, np.nan)
        kernels[NAME](logits, temperature, probs)
        check_probs(logits, temperature, probs)
