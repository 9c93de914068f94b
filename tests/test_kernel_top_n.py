"""top_n on the CPU against the numpy reference; its GPU variants compile for every GPU target, and run on Vulkan
(lavapipe) when wgpu and an adapter are present."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_harness import run_cpu, vulkan_kernels_or_skip
from logitproc.tir_kernels import reference, top_n
from test_kernel_argmax import logits_with_special_rows

SHAPES = [(1, 1), (99, 1), (7, 31), (99, 31), (99, 33), (5, 200), (7, 128001), (1, 128256), (1, 151936)]


def widths(vocab: int) -> list[int]:
    """n = 1, 5, 20 (those <= vocab) and n = vocab for small vocabularies."""
    return sorted({n for n in (1, 5, 20) if n <= vocab} | ({vocab} if vocab <= 200 else set()))


def run_top_n(x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    batch = x.shape[0]
    _, values, indices = run_cpu(top_n.NAME, x, np.zeros((batch, n), np.float32), np.full((batch, n), -7, np.int32))
    return values, indices


def assert_matches_reference(values: np.ndarray, indices: np.ndarray, x: np.ndarray, n: int) -> None:
    ref_values, ref_indices = reference.top_n(x, n)
    np.testing.assert_array_equal(indices, ref_indices)
    np.testing.assert_array_equal(values, ref_values)


@pytest.mark.parametrize(("batch", "vocab"), SHAPES)
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "normal"])
def test_top_n_matches_reference(batch: int, vocab: int, ties: bool) -> None:
    x = logits_with_special_rows(np.random.default_rng(batch * 5 + vocab), batch, vocab, ties)
    for n in widths(vocab):
        assert_matches_reference(*run_top_n(x, n), x, n)


@pytest.mark.parametrize(("vocab", "n"), [(1, 1), (33, 20), (128256, 20)])
def test_row_of_minus_inf_gives_the_first_ids(vocab: int, n: int) -> None:
    values, indices = run_top_n(np.full((2, vocab), -np.inf, np.float32), n)
    assert np.all(values == -np.inf)
    np.testing.assert_array_equal(indices, np.broadcast_to(np.arange(n), (2, n)))


@pytest.mark.parametrize("vocab", [33, 200])
def test_single_finite_value_then_masked_ids_in_order(vocab: int) -> None:
    """Row r holds one finite value, at index r: it comes first, then the -inf ids in increasing order."""
    n = min(vocab, 20)
    x = np.full((vocab, vocab), -np.inf, np.float32)
    x[np.arange(vocab), np.arange(vocab)] = 2.5
    values, indices = run_top_n(x, n)
    np.testing.assert_array_equal(values[:, 0], 2.5)
    assert np.all(values[:, 1:] == -np.inf)
    np.testing.assert_array_equal(indices[:, 0], np.arange(vocab))
    assert_matches_reference(values, indices, x, n)


def test_duplicates_across_lanes_chunks_and_tail_come_in_id_order() -> None:
    vocab = 128001  # 2000 chunks of 64 and a tail of 1
    positions = [0, 1, 15, 16, 63, 64, 65, 127, 128, 64000, 127999, 128000]
    x = np.zeros((3, vocab), np.float32)
    x[0, positions] = 1.0
    x[1, positions[::2]] = 1.0
    x[1, positions[1::2]] = -1.0
    x[2] = -np.inf
    x[2, positions[::-1][:5]] = 4.0
    values, indices = run_top_n(x, 20)
    np.testing.assert_array_equal(indices[0, :12], positions)
    assert_matches_reference(values, indices, x, 20)


def test_full_sort_of_a_small_vocabulary_with_ties_and_masks() -> None:
    """n = vocab walks the previous pick through every chunk and the tail (vocab 200 = 3 chunks of 64 + 8)."""
    rng = np.random.default_rng(3)
    x = rng.integers(-2, 3, size=(6, 200)).astype(np.float32)
    x[1, rng.random(200) < 0.5] = -np.inf
    x[2] = -np.inf
    x[3, ::7] = np.inf
    assert_matches_reference(*run_top_n(x, 200), x, 200)


@pytest.mark.parametrize("n", [1, 20, 32, 33, 64])
def test_blocks_of_equal_values_up_to_and_past_the_candidate_list(n: int) -> None:
    """The CPU kernel selects from a list of the entries at or above the n-th largest maximum of blocks of 256. With
    64 blocks of equal values (decreasing block by block) before noise, n <= 32 fits the list (ties in id order),
    larger n overflow it and the rounds scan the whole row: every case equals the reference."""
    vocab = 300 * 256 + 5
    x = np.random.default_rng(n).random((2, vocab)).astype(np.float32)
    for k in range(64):
        x[:, k * 256:(k + 1) * 256] = 100 - k
    x[1, 5 * 256:6 * 256:3] = 101  # more ties, above every block
    assert_matches_reference(*run_top_n(x, n), x, n)


def test_zero_width_outputs_are_accepted_and_nothing_is_selected() -> None:
    values, indices = run_top_n(np.zeros((2, 300), np.float32), 0)
    assert values.shape == (2, 0) and indices.shape == (2, 0)


def test_n_larger_than_vocab_fills_with_minus_inf_and_minus_1() -> None:
    """A caller error (the runtime rejects it); the kernel still writes only defined values."""
    x = np.array([[1.0, -np.inf, 3.0], [-np.inf, -np.inf, -np.inf]], np.float32)
    values, indices = run_top_n(x, 5)
    np.testing.assert_array_equal(indices, [[2, 0, 1, -1, -1], [0, 1, 2, -1, -1]])
    np.testing.assert_array_equal(values, np.array([[3, 1, -np.inf, -np.inf, -np.inf], [-np.inf] * 5], np.float32))



@pytest.fixture(scope="module")
def vulkan_kernels():
    return vulkan_kernels_or_skip()


def run_vulkan(kernels, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    values, indices = np.zeros((x.shape[0], n), np.float32), np.full((x.shape[0], n), -7, np.int32)
    kernels[top_n.NAME](x, values, indices)
    return values, indices


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "normal"])
@pytest.mark.parametrize(("batch", "vocab", "n"), [(7, 1, 1), (99, 33, 33), (11, 257, 20), (6, 128001, 5),
                                                   (1, 151936, 20), (12, 128256, 20), (3, 5000, 32), (2, 4097, 8)])
def test_vulkan_matches_reference(vulkan_kernels, batch: int, vocab: int, n: int, ties: bool) -> None:
    """Rows split over blocks (n <= 32, rows long enough for a bound: group maxima, per-chunk candidates, a merge)
    and the rounds over the row (n = 33, short rows, rows whose candidates overflow) on random and special rows."""
    x = logits_with_special_rows(np.random.default_rng(batch + vocab), batch, vocab, ties=ties)
    assert_matches_reference(*run_vulkan(vulkan_kernels, x, n), x, n)


def test_vulkan_rows_that_overflow_the_split_and_ties_at_the_bound(vulkan_kernels) -> None:
    """Sorted rows (every chunk near the top holds hundreds of values above the bound), a value repeated across
    every chunk exactly where the n-th largest falls, and a row of equal values: each equals the reference."""
    vocab, n = 70001, 20
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, vocab)).astype(np.float32)
    x[0] = np.arange(vocab, dtype=np.float32)
    x[1] = -np.arange(vocab, dtype=np.float32)
    x[2, rng.choice(vocab, 400, replace=False)] = 5.0  # 400 equal values above the noise, in every chunk
    x[3] = 1.5
    x[4, ::3001] = 9.0  # 24 equal maxima, one in each chunk or so: ties straddle the n-th place
    assert_matches_reference(*run_vulkan(vulkan_kernels, x, n), x, n)


def test_vulkan_rows_alone_and_in_a_batch_give_the_same_bits(vulkan_kernels) -> None:
    x = logits_with_special_rows(np.random.default_rng(11), 9, 128256, ties=False)
    together = run_vulkan(vulkan_kernels, x, 20)
    for r in (0, 4, 8):
        alone = run_vulkan(vulkan_kernels, x[r:r + 1].copy(), 20)
        np.testing.assert_array_equal(alone[0][0], together[0][r])
        np.testing.assert_array_equal(alone[1][0], together[1][r])
