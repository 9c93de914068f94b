"""argmax on the CPU against the numpy reference; its GPU variants compile for every GPU target, and run on Vulkan
(lavapipe) when wgpu and an adapter are present."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_harness import run_cpu, vulkan_kernels_or_skip
from logitproc.tir_kernels import argmax, reference

SHAPES = [(1, 1), (99, 1), (7, 31), (99, 31), (99, 33), (7, 128001), (1, 128256), (7, 128256), (1, 151936)]


def logits_with_special_rows(rng: np.random.Generator, batch: int, vocab: int, ties: bool) -> np.ndarray:
    """Random rows (small integers when ``ties``: equal values everywhere); from row 1 on, cycling: a row of -inf, a
    single finite value, 90 % masked, the maximum repeated at the last index and in the middle, an untouched row."""
    if ties:
        x = rng.integers(-4, 4, size=(batch, vocab)).astype(np.float32)
    else:
        x = rng.standard_normal((batch, vocab)).astype(np.float32)
    for r in range(1, batch):
        kind = (r - 1) % 5
        if kind == 0:
            x[r] = -np.inf
        elif kind == 1:
            keep = rng.integers(vocab)
            x[r, np.arange(vocab) != keep] = -np.inf
        elif kind == 2:
            x[r, rng.random(vocab) < 0.9] = -np.inf
        elif kind == 3:
            x[r, [vocab // 2, vocab - 1]] = x[r].max() + 1
    return x


def run_argmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    batch = x.shape[0]
    _, index, value = run_cpu(argmax.NAME, x, np.full(batch, -7, np.int32), np.zeros(batch, np.float32))
    return index, value


def assert_matches_reference(index: np.ndarray, value: np.ndarray, x: np.ndarray) -> None:
    ref_index, ref_value = reference.argmax(x)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_array_equal(value, ref_value)


@pytest.mark.parametrize(("batch", "vocab"), SHAPES)
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "normal"])
def test_argmax_matches_reference(batch: int, vocab: int, ties: bool) -> None:
    x = logits_with_special_rows(np.random.default_rng(batch * 7 + vocab), batch, vocab, ties)
    assert_matches_reference(*run_argmax(x), x)


@pytest.mark.parametrize("vocab", [1, 33, 128256])
def test_row_of_minus_inf_gives_index_0(vocab: int) -> None:
    index, value = run_argmax(np.full((3, vocab), -np.inf, np.float32))
    np.testing.assert_array_equal(index, 0)
    assert np.all(value == -np.inf)


@pytest.mark.parametrize("vocab", [33, 200])
def test_single_finite_value_at_every_position(vocab: int) -> None:
    """Row r holds one finite value, at index r: every lane, chunk and tail position is visited."""
    x = np.full((vocab, vocab), -np.inf, np.float32)
    x[np.arange(vocab), np.arange(vocab)] = -1e30
    index, value = run_argmax(x)
    np.testing.assert_array_equal(index, np.arange(vocab))
    np.testing.assert_array_equal(value, np.float32(-1e30))


def test_ties_resolve_to_the_lowest_index_across_lanes_chunks_and_tail() -> None:
    vocab = 128001  # 2000 chunks of 64 and a tail of 1
    positions = [0, 1, 15, 16, 63, 64, 65, 127, 128, 64000, 127999, 128000]
    rows = []
    for first in range(len(positions)):
        row = np.zeros(vocab, np.float32)
        row[positions[first:]] = 3.0
        rows.append(row)
    index, value = run_argmax(np.stack(rows))
    np.testing.assert_array_equal(index, positions)
    np.testing.assert_array_equal(value, 3.0)


def test_constant_rows_and_extreme_values() -> None:
    x = np.zeros((4, 1000), np.float32)
    x[1] = -3.4e38
    x[2, 500:] = 3.4e38
    x[3, 7] = np.inf
    x[3, 9] = np.inf
    index, value = run_argmax(x)
    np.testing.assert_array_equal(index, [0, 0, 500, 7])
    assert_matches_reference(index, value, x)


def test_nan_is_never_selected_and_a_row_of_nan_gives_index_0() -> None:
    """Logits are never NaN; the documented behaviour keeps the index a valid token id anyway."""
    x = np.array([[np.nan, 1.0, np.nan, 2.0], [np.nan] * 4], np.float32)
    index, value = run_argmax(x)
    np.testing.assert_array_equal(index, [3, 0])
    np.testing.assert_array_equal(value, np.array([2.0, -np.inf], np.float32))



@pytest.fixture(scope="module")
def vulkan_kernels():
    return vulkan_kernels_or_skip()


@pytest.mark.parametrize(("batch", "vocab"), [(7, 1), (99, 33), (11, 257), (7, 128001), (1, 151936)])
def test_vulkan_matches_reference(vulkan_kernels, batch: int, vocab: int) -> None:
    x = logits_with_special_rows(np.random.default_rng(batch + vocab), batch, vocab, ties=True)
    index, value = np.full(batch, -7, np.int32), np.zeros(batch, np.float32)
    vulkan_kernels[argmax.NAME](x, index, value)
    assert_matches_reference(index, value, x)
