"""apply_bitmask_inplace on the CPU against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_harness import run_cpu
from logitproc.tir_kernels import reference


def random_bitmask(rng: np.random.Generator, rows: int, vocab: int, density: float) -> np.ndarray:
    return reference.pack_bitmask(rng.random((rows, vocab)) < density)


@pytest.mark.parametrize(
    ("batch", "vocab"),
    [(1, 1), (1, 31), (7, 33), (1, 128001), (7, 128256), (1, 151936), (99, 33), (99, 1000)],
)
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_bitmask_matches_reference(batch: int, vocab: int, density: float) -> None:
    rng = np.random.default_rng(batch + vocab)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    logits[0, ::3] = -np.inf
    row_ids = np.flatnonzero(rng.random(batch) < 0.6).astype(np.int32)  # only some rows carry a mask
    bitmask = random_bitmask(rng, row_ids.size, vocab, density)
    (out, *_) = run_cpu("apply_bitmask_inplace", logits, row_ids, bitmask)
    np.testing.assert_array_equal(out, reference.apply_bitmask(logits, row_ids, bitmask))


def test_every_token_masked_gives_a_row_of_minus_inf_and_leaves_other_rows() -> None:
    logits = np.random.default_rng(1).standard_normal((3, 128001)).astype(np.float32)
    bitmask = np.zeros((1, (128001 + 31) // 32), dtype=np.int32)
    (out, *_) = run_cpu("apply_bitmask_inplace", logits, np.array([1], np.int32), bitmask)
    assert np.all(out[1] == -np.inf)
    np.testing.assert_array_equal(out[[0, 2]], logits[[0, 2]])


def test_padding_bits_and_wider_rows_are_ignored() -> None:
    """A bitmask wider than ceil(vocab / 32) (model vocab padded) and set padding bits do not matter."""
    vocab = 40
    logits = np.arange(vocab, dtype=np.float32)[None, :]
    bitmask = np.full((1, 4), -1, dtype=np.int32)  # all bits set, 128 bits for 40 tokens
    bitmask[0, 0] = 0  # tokens 0..31 masked
    (out, *_) = run_cpu("apply_bitmask_inplace", logits, np.array([0], np.int32), bitmask)
    assert np.all(out[0, :32] == -np.inf)
    np.testing.assert_array_equal(out[0, 32:], logits[0, 32:])


def test_pack_and_unpack_are_inverse() -> None:
    allowed = np.random.default_rng(2).random((5, 77)) < 0.3
    np.testing.assert_array_equal(reference.unpack_bitmask(reference.pack_bitmask(allowed), 77), allowed)
